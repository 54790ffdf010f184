"""LLaMA-Factory's datasets and what it trains on: the oracle of
Records.LlamaFactoryDatasetsTokenizeAsLlamaFactoryDoes (tests/data/test_records.cpp).

    llamafactory_records.py OUT_DIR TOKENIZER_ROOT
TOKENIZER_ROOT holds hf_tokenizers.py's llama3/, qwen2/ and llama2/ tokenizer.json files. This
writes OUT_DIR/<kind>/ model directories (tokenizer.json, tokenizer_config.json naming BOS and EOS,
and for some a chat_template.jinja of tests/data/chat_templates/; the gemma and phi kinds are the
Llama-2 kind with those models' turn tokens added), OUT_DIR/data/ (dataset_info.json and its record
files, one a directory of two), and OUT_DIR/expected.json:
    {"cases": {NAME: {"kind": KIND, "yaml": {train.yaml keys}, "ids": [[...]...], "labels": [[0|1...]...],
                      "dropped": n}  or  {"kind", "yaml", "error": "LLaMA-Factory's message"}},
     "infer_seqlen": [[source, target, cutoff, kept source, kept target]...]}  (a grid, its boundaries)

Each case is computed by LLaMA-Factory itself, imported from the installed `llamafactory` wheel:
parser.get_dataset_list reads dataset_info.json, the records load as Hugging Face `datasets` loads a
JSON file (the columns of every record, null where a record lacks one; max_samples its first ones),
converter.get_dataset_converter aligns them, template.get_template_and_fix_tokenizer chooses and
fixes the template on transformers' tokenizer (AutoTokenizer on the directory), and
SupervisedDatasetProcessor.preprocess_dataset makes the samples. labels[i] is 1 where LLaMA-Factory's
label is not -100 (and is then the token itself, asserted). "dropped" counts the records
preprocess_dataset drops. Only its package's __init__ files are skipped (they import its whole
training stack); `datasets` and `torchaudio`, which the data modules import but these functions do not
use, are stand-ins, and peft.utils the two file names the constants module reads.
"""
import copy
import importlib.util
import json
import os
import shutil
import sys
import types
from types import SimpleNamespace

import transformers  # before the stand-ins: transformers probes the real packages
import transformers.image_utils  # noqa: F401  (mm_plugin's imports, loaded with the real torchaudio probe)
from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer


def import_llamafactory():
    root = os.path.dirname(importlib.util.find_spec("llamafactory").origin)

    def module(name, path=None, **attrs):
        m = types.ModuleType(name)
        if path:
            m.__path__ = [path]
        m.__dict__.update(attrs)
        sys.modules[name] = m

    for name, sub in (("llamafactory", ""), ("llamafactory.data", "data"), ("llamafactory.extras", "extras"),
                      ("llamafactory.data.processor", "data/processor")):
        module(name, os.path.join(root, sub))
    module("datasets", DatasetDict=None, concatenate_datasets=None, interleave_datasets=None)
    module("torchaudio")
    module("peft", [])
    module("peft.utils", SAFETENSORS_WEIGHTS_NAME="adapter_model.safetensors", WEIGHTS_NAME="adapter_model.bin")
    from llamafactory.data import converter, parser, template
    from llamafactory.data.processor import supervised
    return converter, parser, template, supervised


HERE = os.path.dirname(os.path.abspath(__file__))

# Qwen2.5's way with the system prompt: its own when the conversation has none.
QWEN25 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
          "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
          "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == "
          "'system' and loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
          "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# kind -> (hf_tokenizers.py kind it starts from, BOS, EOS, turn tokens added, chat template file)
KINDS = {
    "llama3": ("llama3", "<|begin_of_text|>", "<|end_of_text|>", ["<|eom_id|>"], "llama3.jinja"),
    "qwen2": ("qwen2", None, "<|endoftext|>", [], "qwen25"),
    "chatml": ("qwen2", None, "<|endoftext|>", [], "chatml_blocks.jinja"),
    "qwen3": ("qwen2", None, "<|im_end|>", [], "qwen3.jinja"),
    "llama2": ("llama2", "<s>", "</s>", [], None),
    "mistral": ("llama2", "<s>", "</s>", [], "mistral.jinja"),
    "gemma": ("llama2", "<s>", "</s>", ["<start_of_turn>", "<end_of_turn>"], None),
    "phi": ("llama2", "<s>", "</s>", ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], None),
}

ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well, sleep, move."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour", "system": "You translate."},
    {"instruction": "Summarize.", "input": "你好，世界！今天天气很好。", "output": "天气很好 👍🏽",
     "history": [["Hi", "Hello! 😀"], ["How are you?", "Fine, thanks."]]},
    {"instruction": "", "input": "Only an input", "output": "ok"},
    {"instruction": "No output string", "input": "", "output": None},
    {"instruction": "A long one " + "word " * 120, "input": "", "output": "a response that runs " + "on " * 60},
    {"instruction": "Tabs\tand\nnewlines {{content}}", "input": "x = 1\n", "output": "  spaced  out  "},
]

SHAREGPT = [
    {"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "Hi there."}]},
    {"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "2+2?"},
                       {"from": "gpt", "value": "4"}, {"from": "human", "value": "And 3+3?"},
                       {"from": "gpt", "value": "6, as 3 doubled " + "is six " * 20}]},
    {"conversations": [{"from": "human", "value": "Weather?"}, {"from": "gpt", "value": "Let me look."},
                       {"from": "observation", "value": "{\"temp\": 21}"}, {"from": "gpt", "value": "21 °C"}]},
    {"conversations": [{"from": "gpt", "value": "out of turn"}, {"from": "human", "value": "dropped"}]},
    {"conversations": [{"from": "human", "value": "odd count"}]},
    {"conversations": [{"from": "human", "value": "日本語で？"}, {"from": "gpt", "value": "はい、日本語です。🇯🇵"}]},
]

CHAT = [
    {"messages": [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "A haiku, please."},
                  {"role": "assistant", "content": "Old pond\nfrog leaps in\nsplash"}]},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]},
    # chat_demo's tags name no observation_tag: the role is out of turn, the record broken
    {"messages": [{"role": "user", "content": "Look it up."}, {"role": "assistant", "content": "Looking."},
                  {"role": "observation", "content": "found"}, {"role": "assistant", "content": "Found."}]},
]

THINK = [
    {"conversations": [{"from": "human", "value": "Why is the sky blue?"},
                       {"from": "gpt", "value": "<think>\nRayleigh scattering.\n</think>\n\nShort wavelengths scatter."}]},
    {"conversations": [{"from": "human", "value": "1+1?"}, {"from": "gpt", "value": "2"},
                       {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "<think>\nadd\n</think>\n\n\n4"}]},
]

# formatting openai: tool responses in a row are one turn (a trailing one is dropped), a late system
# message breaks the record, and the system prompt gets Nemotron's "detailed thinking off"
OPENAI = [
    {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "Checking."}, {"role": "tool", "content": "{\"temp\": 21}"},
                  {"role": "tool", "content": "{\"wind\": 3}"}, {"role": "assistant", "content": "21 °C, calm."},
                  {"role": "tool", "content": "late"}]},
    {"messages": [{"role": "system", "content": "Think. detailed thinking on"}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"},
                  {"role": "assistant", "content": "b"}]},
    {"messages": [{"role": "user", "content": "odd"}, {"role": "assistant", "content": "count"},
                  {"role": "user", "content": "left over"}]},
]

MULTI = [
    [{"conversations": [{"from": "human", "value": "first file"}, {"from": "gpt", "value": "one"}]}],
    [{"conversations": [{"from": "human", "value": "second file"}, {"from": "gpt", "value": "two"}]},
     {"conversations": [{"from": "human", "value": "second file again"}, {"from": "gpt", "value": "three"}]}],
]

DATASET_INFO = {
    "alpaca_demo": {"file_name": "alpaca.json"},
    "alpaca_full": {"file_name": "alpaca.json", "columns": {"prompt": "instruction", "query": "input",
                                                            "response": "output", "history": "history",
                                                            "system": "system"}},
    "sharegpt_demo": {"file_name": "sharegpt.jsonl", "formatting": "sharegpt"},
    "chat_demo": {"file_name": "chat.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant", "system_tag": "system"}},
    "think_demo": {"file_name": "think.jsonl", "formatting": "sharegpt"},
    "openai_demo": {"file_name": "openai.jsonl", "formatting": "openai", "columns": {"messages": "messages"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant", "observation_tag": "tool", "system_tag": "system"}},
    "dir_demo": {"file_name": "multi", "formatting": "sharegpt"},
    "hub_demo": {"hf_hub_url": "someone/dataset"},
}

# name -> (kind, train.yaml keys beyond dataset_dir)
CASES = {
    "llama3 alpaca": ("llama3", {"dataset": "alpaca_demo", "template": "llama3", "cutoff_len": 128}),
    "llama3 two datasets, prompt trained": ("llama3", {"dataset": "alpaca_full, sharegpt_demo", "template": "llama3",
                                                       "cutoff_len": 128, "train_on_prompt": True}),
    "llama3 mask_history": ("llama3", {"dataset": "sharegpt_demo,alpaca_full", "template": "llama3", "cutoff_len": 48,
                                       "mask_history": True}),
    "llama3 default_system": ("llama3", {"dataset": "chat_demo", "template": "llama3", "cutoff_len": 128,
                                         "default_system": "Be brief."}),
    "alpaca": ("llama3", {"dataset": "alpaca_full", "template": "alpaca", "cutoff_len": 256}),
    "default": ("llama3", {"dataset": "sharegpt_demo", "template": "default", "cutoff_len": 256}),
    "vicuna": ("llama3", {"dataset": "sharegpt_demo", "template": "vicuna", "cutoff_len": 256}),
    "empty": ("llama3", {"dataset": "chat_demo", "template": "empty", "cutoff_len": 256}),
    "llama3 directory, max_samples": ("llama3", {"dataset": ["dir_demo", "chat_demo"], "template": "llama3",
                                                 "max_samples": 1, "cutoff_len": 64}),
    "qwen": ("qwen2", {"dataset": "chat_demo,sharegpt_demo", "template": "qwen", "cutoff_len": 128}),
    "qwen openai": ("qwen2", {"dataset": "openai_demo", "template": "qwen", "cutoff_len": 128}),
    "llama3 openai, mask_history": ("llama3", {"dataset": "openai_demo", "template": "llama3", "cutoff_len": 128,
                                               "mask_history": True}),
    "chatml": ("qwen2", {"dataset": "sharegpt_demo", "template": "chatml", "cutoff_len": 128}),
    "phi4": ("qwen2", {"dataset": "chat_demo", "template": "phi4", "cutoff_len": 128}),
    "qwen3": ("qwen3", {"dataset": "think_demo,chat_demo", "template": "qwen3", "cutoff_len": 128}),
    "qwen3 without thinking": ("qwen3", {"dataset": "think_demo", "template": "qwen3", "cutoff_len": 128,
                                         "enable_thinking": False}),
    "qwen3 mask_history": ("qwen3", {"dataset": "think_demo", "template": "qwen3", "cutoff_len": 128,
                                     "mask_history": True}),
    "qwen3_nothink": ("qwen3", {"dataset": "think_demo", "template": "qwen3_nothink", "cutoff_len": 128}),
    "llama2": ("llama2", {"dataset": "chat_demo,sharegpt_demo", "template": "llama2", "cutoff_len": 128}),
    "mistral": ("llama2", {"dataset": "chat_demo,sharegpt_demo", "template": "mistral", "cutoff_len": 128}),
    "gemma": ("gemma", {"dataset": "chat_demo", "template": "gemma", "cutoff_len": 128}),
    "gemma3": ("gemma", {"dataset": "alpaca_full", "template": "gemma3", "cutoff_len": 128}),
    "phi": ("phi", {"dataset": "chat_demo", "template": "phi", "cutoff_len": 128}),
    "parsed llama3": ("llama3", {"dataset": "chat_demo,alpaca_full", "cutoff_len": 128}),
    "parsed, a default system": ("qwen2", {"dataset": "chat_demo,sharegpt_demo", "cutoff_len": 128}),
    "parsed reasoning": ("qwen3", {"dataset": "think_demo", "cutoff_len": 128}),
    "no chat template: empty": ("llama2", {"dataset": "chat_demo", "cutoff_len": 128}),
    "a template that refuses a lone system message": ("mistral", {"dataset": "chat_demo", "cutoff_len": 128}),
    "a template whose slots do not parse": ("chatml", {"dataset": "chat_demo", "cutoff_len": 128}),
    "an EOS the tokenizer lacks": ("llama2", {"dataset": "chat_demo", "template": "llama3", "cutoff_len": 128}),
}


def make_kinds(out, tok_root):
    for kind, (base, bos, eos, added, chat_template) in KINDS.items():
        d = os.path.join(out, kind)
        os.makedirs(d, exist_ok=True)
        tok = Tokenizer.from_file(os.path.join(tok_root, base, "tokenizer.json"))
        if added:
            tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in added])
        tok.save(os.path.join(d, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                  "model_max_length": 4096}
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        if chat_template == "qwen25":
            with open(os.path.join(d, "chat_template.jinja"), "w") as f:
                f.write(QWEN25)
        elif chat_template:
            shutil.copy(os.path.join(HERE, "chat_templates", chat_template), os.path.join(d, "chat_template.jinja"))


def write_data(data):
    os.makedirs(os.path.join(data, "multi"), exist_ok=True)
    with open(os.path.join(data, "dataset_info.json"), "w") as f:
        json.dump(DATASET_INFO, f, indent=1)
    with open(os.path.join(data, "alpaca.json"), "w", encoding="utf-8") as f:
        json.dump(ALPACA, f, ensure_ascii=False, indent=1)
    with open(os.path.join(data, "chat.json"), "w", encoding="utf-8") as f:
        json.dump(CHAT, f, ensure_ascii=True)
    for name, records in (("sharegpt.jsonl", SHAREGPT), ("think.jsonl", THINK), ("openai.jsonl", OPENAI),
                          ("multi/b.jsonl", MULTI[1]),
                          ("multi/a.jsonl", MULTI[0])):
        with open(os.path.join(data, name), "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


def load_records(path):
    """A JSON or JSONL file as `datasets` loads it: every record with every column (null where absent)."""
    files = [os.path.join(path, n) for n in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    records = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            records += json.load(fh) if f.endswith(".json") else [json.loads(line) for line in fh if line.strip()]
    columns = []
    for r in records:
        columns += [c for c in r if c not in columns]
    return [{c: r.get(c) for c in columns} for r in records]


def run_case(lf, kind_dir, data, keys, originals):
    converter, parser, template, supervised = lf
    names = keys["dataset"] if isinstance(keys["dataset"], list) else [n.strip() for n in keys["dataset"].split(",")]
    data_args = SimpleNamespace(template=keys.get("template"), train_on_prompt=keys.get("train_on_prompt", False),
                                mask_history=keys.get("mask_history", False), default_system=keys.get("default_system"),
                                enable_thinking=keys.get("enable_thinking", True), preserve_thinking=False,
                                tool_format=None, cutoff_len=keys["cutoff_len"], dataset_dir=data,
                                max_samples=keys.get("max_samples"), media_dir=data)
    template.TEMPLATES.clear()  # get_template_and_fix_tokenizer changes the template it returns
    template.TEMPLATES.update(copy.deepcopy(originals))
    tok = AutoTokenizer.from_pretrained(kind_dir)
    try:
        tmpl = template.get_template_and_fix_tokenizer(tok, data_args)
        batch = {k: [] for k in ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")}
        for attr in parser.get_dataset_list(names, data):
            records = load_records(os.path.join(data, attr.dataset_name))
            if data_args.max_samples is not None:
                records = records[:data_args.max_samples]
            convert = converter.get_dataset_converter(attr.formatting, attr, data_args)
            for r in records:
                for k, v in convert(r).items():
                    batch[k].append(v)
        # A stand-in for the processor of a multimodal model (gemma3's plugin asks for one; text
        # without <image> placeholders never uses it).
        mm = SimpleNamespace(boi_token="<start_of_image>", full_image_sequence="<start_of_image>",
                             image_processor=object())
        processor = supervised.SupervisedDatasetProcessor(template=tmpl, tokenizer=tok, processor=mm,
                                                          data_args=data_args)
        made = processor.preprocess_dataset(batch)
    except Exception as e:  # LLaMA-Factory refuses the case: so must memrt
        return {"error": "%s: %s" % (type(e).__name__, e)}
    if len(tok) > len(Tokenizer.from_file(os.path.join(kind_dir, "tokenizer.json")).get_vocab(with_added_tokens=True)):
        return {"error": "LLaMA-Factory added tokens to the vocabulary (resize_vocab)"}
    for ids, labels in zip(made["input_ids"], made["labels"]):
        assert all(l == -100 or l == i for i, l in zip(ids, labels)), "a label that is not its token"
    return {"ids": made["input_ids"], "labels": [[int(l != -100) for l in labels] for labels in made["labels"]],
            "dropped": len(batch["_prompt"]) - len(made["input_ids"])}


def main():
    out, tok_root = sys.argv[1], sys.argv[2]
    lf = import_llamafactory()
    make_kinds(out, tok_root)
    data = os.path.join(out, "data")
    write_data(data)
    originals = copy.deepcopy(lf[2].TEMPLATES)
    cases = {}
    for name, (kind, keys) in CASES.items():
        cases[name] = {"kind": kind, "yaml": keys, **run_case(lf, os.path.join(out, kind), data, keys, originals)}
    from llamafactory.data.processor.processor_utils import infer_seqlen
    seqlen = [[s, t, c, *infer_seqlen(s, t, c)] for s in range(21) for t in range(21) for c in range(1, 43)]
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"cases": cases, "infer_seqlen": seqlen}, f)


if __name__ == "__main__":
    main()
