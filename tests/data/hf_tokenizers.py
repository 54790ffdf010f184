"""Byte-level BPE tokenizer.json files of the GPT-2, Llama-3 and Qwen2 kinds, trained here with
Hugging Face `tokenizers` on a small multilingual corpus, and what `tokenizers` makes of a set of
test texts: the oracle of tests/data/test_tokenizer.cpp.

    hf_tokenizers.py OUT_DIR
writes OUT_DIR/<kind>/tokenizer.json and OUT_DIR/<kind>/expected.json:
    {"vocab_size": largest id + 1, "texts": [...], "ids": [...], "ids_special": [...],
     "decoded": [...], "decoded_skip": [...], "offsets": [[[start, end]...]...]}
(ids without and with add_special_tokens; decode of ids_special, and with skip_special_tokens;
the offsets of ids, return_offsets_mapping's, in bytes of the text), and "jsonl_ids", "txt_ids":
OUT_DIR/data.jsonl and OUT_DIR/data.txt tokenized as run_clm does. The "trim_offsets" kind is GPT-2's
with the post-processor GPT-2's own file has (ByteLevel, trim_offsets) and a token that takes the
whitespace after it.
"""
import json
import os
import random
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The pre-tokenization regexes of the Llama-3 and Qwen2 tokenizer.json files.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")

SAMPLES = [
    "Hello world! I'm here, you're there; they'll see. DON'T SHOUT, We'VE 'Ll",
    "The year 2024 had 365 days; pi is 3.14159265 and 1,000,000 is a million. 12345678901234",
    "  leading spaces, trailing spaces   ", "tabs\tand\t\ttabs", "new\nlines\n\n\nand\r\nCRLF\r\n",
    "a    b     c", "   ", "\n", "x", "",
    "你好，世界！今天天气很好。我们一起学习自然语言处理。",
    "日本語のテキストです。カタカナとひらがな、漢字。",
    "한국어 텍스트입니다. 안녕하세요!",
    "Привет, мир! Это тест токенизатора.",
    "Γειά σου Κόσμε", "مرحبا بالعالم، هذا اختبار.", "नमस्ते दुनिया, यह परीक्षण है।", "สวัสดีชาวโลก",
    "emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🎉🎉🎉",
    "combining: e\u0301 cafe\u0301 A\u030a Zalgo: Z\u0351\u0307a\u0308l\u0303g\u0304o\u030a",
    "precomposed: café Å ñ ü", "math: ∑ x² ≤ ∞ → ∀ε>0", "code: def f(x):\n    return x**2  # square\n",
    "URL https://example.com/a?b=c&d=e and email someone@example.org",
    "mixed 中文English混合123文字",
    "<|endoftext|>after a special token<|endoftext|>", "before <mask> after", "two  <mask>  spaces",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>",
    "Qwen is a model; qwen is not Qwen.", "one</s> two <s>three </s>", "<s>at the start",
]


# Llama-3's vocabulary holds words no merge makes; this one stands for them.
UNTRAINED = "\u0120zxcvbnm"


def corpus(rng):
    pool = ("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ 0123456789 ,.;:!?'\"-()[]{} \t\n\r"
            "你好世界学习日本語テキスト한국어Приветмирαβγδ😀👍🏽éñü\u0301\u030a")
    lines = SAMPLES * 8
    for _ in range(400):
        lines.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 60))))
    return lines


def build_sentencepiece(kind, lines):
    """Llama-2's tokenizer.json as transformers converts it (legacy: Prepend + Replace normalizers,
    no pre-tokenizer), or Mistral's newer form (a Metaspace pre-tokenizer, prepend_scheme first);
    BPE with byte_fallback over an alphabet cut to the 150 commonest characters, so rarer ones fall
    back to their <0xNN> byte tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if kind == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False),
                                         decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=150,
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # sentencepiece's byte pieces, as Llama-2's vocabulary has them
        vocab.setdefault(f"<0x{b:02X}>", max(vocab.values()) + 1)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def build(kind, lines):
    if kind in ("llama2", "mistral"):
        return build_sentencepiece(kind, lines)
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        special = ["<|endoftext|>"]
    else:
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
        pattern = LLAMA3 if kind == "llama3" else QWEN2
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        special = (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
                   if kind == "llama3" else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=1, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    if kind == "gpt2":  # a special token that takes the whitespace before it, as RoBERTa's <mask>
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False)])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
    else:  # an ordinary added token, matched in the normalized text
        tok.add_tokens([AddedToken("Qwen", normalized=True, special=False)])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    spec = json.loads(tok.to_str())
    if kind == "llama3":
        # As Llama-3's file: ignore_merges, and a word in the vocabulary that no merge makes (so it
        # encodes as one token only because of ignore_merges).
        spec["model"]["ignore_merges"] = True
        assert UNTRAINED not in spec["model"]["vocab"]
        spec["model"]["vocab"][UNTRAINED] = max(spec["model"]["vocab"].values()) + 1
    return Tokenizer.from_str(json.dumps(spec))


# Each behavior of tokenizers' Split, on a literal delimiter, before a ByteLevel step without a regex.
BEHAVIORS = ("removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous")


def with_pre_tokenizer(base, pre):
    spec = json.loads(base.to_str())
    spec["pre_tokenizer"] = json.loads(pre.__getstate__())
    return Tokenizer.from_str(json.dumps(spec))


def variant(gpt2, kind):
    if kind in BEHAVIORS:
        return with_pre_tokenizer(gpt2, pre_tokenizers.Sequence([
            pre_tokenizers.Split("-", behavior=kind), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    # "prefix_space": ByteLevel's add_prefix_space, which applies to each piece an earlier step cut
    return with_pre_tokenizer(gpt2, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d+"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=True)]))


def trimmed(gpt2):
    tok = Tokenizer.from_str(gpt2.to_str())
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.add_special_tokens([AddedToken("<R>", lstrip=False, rstrip=True, normalized=False)])
    return tok


def byte_offsets(text, offsets):
    at = [len(text[:i].encode()) for i in range(len(text) + 1)]
    return [[at[b], at[e]] for b, e in offsets]


def transformers_flags(tok, out, texts):
    """OUT_DIR/llama2_flags: the llama2 kind beside a tokenizer_config.json asking for BOS and EOS
    (add_bos_token, add_eos_token), and expected.json's "ids_special" as transformers' AutoTokenizer
    encodes the texts from that directory (its tokenizers backend, with add_special_tokens)."""
    from transformers import AutoTokenizer
    d = os.path.join(out, "llama2_flags")
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "add_bos_token": True, "add_eos_token": True}, f)
    hf = AutoTokenizer.from_pretrained(d)
    with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"texts": texts, "ids_special": [hf(t)["input_ids"] for t in texts]}, f, ensure_ascii=False)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = random.Random(7)
    lines = corpus(rng)
    texts = SAMPLES + ["keyboard row: zxcvbnm zxcvbnm, zxcvbnmzxcvbnm",  # not trained on
                       "the-final--countdown", "-a-", "--", "a---b-c -", "<R>  after\u3000<R>\u00a0 x <R>",
                       "  <mask> <R> ", " a"]
    pool = "ab c\t\n 1234 ,.'!-你好😀👍🏽é\u0301<>|"
    for _ in range(200):  # random mixtures: runs of whitespace, digits, marks and scripts side by side
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 40))))
    records = [t for t in SAMPLES if t] + ["a \"quoted\" \\ backslash\tand\u0007 control"]
    with open(os.path.join(out, "data.jsonl"), "w", encoding="utf-8") as f:
        for k, r in enumerate(records):  # escaped and literal non-ASCII alike
            f.write(json.dumps({"id": k, "text": r}, ensure_ascii=k % 2 == 0) + "\n" + "\n" * (k == 3))
    txt_lines = [t.replace("\n", " ").replace("\r", " ") + "\n" for t in SAMPLES] + ["no newline at the end"]
    with open(os.path.join(out, "data.txt"), "w", encoding="utf-8", newline="") as f:
        f.write("".join(txt_lines))
    gpt2 = build("gpt2", lines)
    for kind in ("gpt2", "llama3", "qwen2", "llama2", "mistral", "prefix_space", "trim_offsets") + BEHAVIORS:
        tok = (gpt2 if kind == "gpt2" else trimmed(gpt2) if kind == "trim_offsets" else
               variant(gpt2, kind) if kind in BEHAVIORS + ("prefix_space",) else build(kind, lines))
        d = os.path.join(out, kind)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        encodings = [tok.encode(t, add_special_tokens=False) for t in texts]
        ids = [e.ids for e in encodings]
        ids_special = [tok.encode(t, add_special_tokens=True).ids for t in texts]
        expected = {
            "vocab_size": max(tok.get_vocab(with_added_tokens=True).values()) + 1,
            "texts": texts, "ids": ids, "ids_special": ids_special,
            "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids_special],
            "decoded_skip": [tok.decode(i, skip_special_tokens=True) for i in ids_special],
            "offsets": [byte_offsets(t, e.offsets) for t, e in zip(texts, encodings)],
        }
        if kind in ("llama2", "mistral"):  # a cut UTF-8 sequence in byte-fallback tokens, then text
            partial = [tok.token_to_id("<0xE4>"), tok.token_to_id("<0xBD>")] + ids[0][:4]
            expected["partial_ids"] = partial
            expected["partial_decoded"] = tok.decode(partial)
        # Files as Hugging Face's run_clm tokenizes them: each JSONL "text", each line of a text file
        # with its newline, encoded with add_special_tokens and concatenated.
        expected["jsonl_ids"] = [i for r in records for i in tok.encode(r, add_special_tokens=True).ids]
        expected["txt_ids"] = [i for l in txt_lines for i in tok.encode(l, add_special_tokens=True).ids]
        with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(expected, f, ensure_ascii=False)
        if kind == "llama2":
            transformers_flags(tok, out, texts)


if __name__ == "__main__":
    main()
