"""Tokenizer throughput: memrt's tokenizer.json encoder against Hugging Face `tokenizers` (its Rust
core, `encode_batch`) on the same tokenizer, text and threads, in one run.

    <venv python> bench/bench_tokenizer.py [--build build] [--threads 1 2] [--repeats 5] [--copies 8]

The tokenizer is trained here with `tokenizers` (a Llama-3-kind byte-level BPE: Llama-3's Split regex,
ByteLevel, ignore_merges; 16k tokens) on the built-in corpus plus a multilingual sample; the text
encoded is the built-in corpus `--copies` times, one line per document (verse), and the multilingual
sample, as short documents (a verse each) and long ones (`--join` verses each). Both sides must produce
the same ids (their count and sum are compared). Prints the CPU, a table of MB/s per document length
and thread count with memrt / HF, and one JSON line per row.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, cpu  # noqa: E402

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
MULTILINGUAL = [
    "你好，世界！今天天气很好。我们一起学习自然语言处理和机器学习的基本方法。",
    "日本語のテキストです。カタカナとひらがな、そして漢字が混ざっています。",
    "Привет, мир! Это тест токенизатора на русском языке с цифрами 12345.",
    "emoji 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and code: def f(x):\n    return x ** 2  # square",
    "مرحبا بالعالم، هذا اختبار. नमस्ते दुनिया, यह परीक्षण है। café naïve Å",
] * 200

HF_SIDE = r"""
import json, statistics, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
lines = open(sys.argv[2], encoding="utf-8").read().split("\n")[:-1]
times = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter()
    out = tok.encode_batch(lines, add_special_tokens=False)
    times.append(time.perf_counter() - t0)
print(json.dumps({"tokens": sum(len(e.ids) for e in out), "checksum": sum(sum(e.ids) for e in out),
                  "seconds": statistics.median(times)}))
"""


def train(path, text_lines):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=16000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text_lines, trainer)
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = True
    Path(path).write_text(json.dumps(spec))
    return len(spec["model"]["vocab"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--join", type=int, nargs="+", default=[1, 64],
                    help="verses per document (joined by spaces): short documents, then long ones")
    args = ap.parse_args()
    corpus = (ROOT / "runtime/src/data/corpus/kjv.txt").read_text(encoding="utf-8").split("\n")
    with tempfile.TemporaryDirectory() as tmp:
        tj = os.path.join(tmp, "tokenizer.json")
        vocab = train(tj, corpus + MULTILINGUAL)
        name, isa = cpu()
        print(f"CPU: {name} ({isa})")
        print(f"tokenizer: byte-level BPE, Llama-3 kind, {vocab} tokens")
        print(f"{'docs':>6} | {'MB':>5} | {'threads':>7} | {'memrt MB/s':>10} | {'HF MB/s':>8} | {'memrt / HF':>10} | tokens")
        verses = [l for l in corpus if l] * args.copies
        for join in args.join:
            lines = [" ".join(verses[i:i + join]) for i in range(0, len(verses), join)] + MULTILINGUAL
            text = os.path.join(tmp, f"text{join}.txt")
            Path(text).write_text("".join(l + "\n" for l in lines), encoding="utf-8")
            measure(args, tj, text, lines, join)


def measure(args, tj, text, lines, join):
    mb = sum(len(l.encode()) for l in lines) / 1e6
    for t in args.threads:
        env = dict(os.environ, RAYON_NUM_THREADS=str(t), TOKENIZERS_PARALLELISM="true")
        hf = json.loads(subprocess.run([sys.executable, "-c", HF_SIDE, tj, text, str(args.repeats)], env=env,
                                       check=True, capture_output=True, text=True).stdout)
        memrt = json.loads(subprocess.run([str(ROOT / args.build / "bin" / "bench_tokenizer"), tj, text, str(t),
                                           str(args.repeats)], check=True, capture_output=True, text=True).stdout)
        if (memrt["tokens"], memrt["checksum"]) != (hf["tokens"], hf["checksum"]):
            sys.exit(f"the ids differ: memrt {memrt['tokens']} tokens (sum {memrt['checksum']}), "
                     f"HF {hf['tokens']} (sum {hf['checksum']})")
        print(f"{len(lines):>6} | {mb:>5.2f} | {t:>7} | {mb / memrt['seconds']:>10.2f} | {mb / hf['seconds']:>8.2f} | "
              f"{hf['seconds'] / memrt['seconds']:>10.2f} | {memrt['tokens']}")
        print(json.dumps({"bench": "tokenizer", "verses_per_doc": join, "docs": len(lines), "threads": t,
                          "mb": round(mb, 3), "tokens": memrt["tokens"], "memrt_s": memrt["seconds"],
                          "hf_s": hf["seconds"], "memrt_over_hf": hf["seconds"] / memrt["seconds"]}))


if __name__ == "__main__":
    main()
