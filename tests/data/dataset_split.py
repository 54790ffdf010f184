"""Hugging Face datasets' load_dataset(DIR, split="train") on a split held in several files, the
oracle of Tokenizer.ASplitInSeveralFilesIsOneDatasetAsDatasetsReadsIt (tests/data/test_tokenizer.cpp):

    dataset_split.py OUT TOKENIZER_JSON

makes two dataset directories, OUT/jsonl (its train split in three JSONL shards of "text"
documents, written out of order, and a test split) and OUT/txt (a train/ folder of two text files,
the first without a final newline), and writes OUT/want.json: {"jsonl": {"text", "ids"}, "txt":
{"text", "ids"}} — "text" the split's documents as datasets reads them, in its order (JSONL: each
"text" and a newline; text files: each line with its newline, keep_linebreaks as run_clm reads
text), "ids" each document encoded with the tokenizer's special tokens and concatenated (run_clm's
tokenization).
"""
import json
import os
import sys

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
import datasets  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

DOCS = ["In the beginning God created the heaven and the earth.", "你好，世界 👋🏽 — café",
        "digits 1234567 and  spaces\tand tabs", "", "Ruth 1:16 whither thou goest, I will go",
        "e\u0301 combining, Å precomposed", "the last document"]


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def main():
    out, tokenizer = sys.argv[1], Tokenizer.from_file(sys.argv[2])
    shards = [DOCS[:3], DOCS[3:5], DOCS[5:]]
    for k in (2, 0, 1):  # written out of order: the order is datasets', not the file system's
        write(os.path.join(out, "jsonl", "data", f"train-{k:05d}-of-00003.jsonl"),
              "".join(json.dumps({"text": t}, ensure_ascii=k == 1) + "\n" for t in shards[k]))
    write(os.path.join(out, "jsonl", "data", "test-00000-of-00001.jsonl"), json.dumps({"text": "held out"}) + "\n")
    write(os.path.join(out, "txt", "train", "a.txt"), "first file, line 1\nfirst file, no final newline")
    write(os.path.join(out, "txt", "train", "b.txt"), "second file 你好\n\nafter an empty line\n")

    cache = os.path.join(out, "hf_cache")
    want = {}
    for name, kwargs, sep in (("jsonl", {}, "\n"), ("txt", {"keep_linebreaks": True}, "")):
        docs = datasets.load_dataset(os.path.join(out, name), split="train", cache_dir=cache, **kwargs)["text"]
        want[name] = {"text": "".join(d + sep for d in docs),
                      "ids": [i for d in docs for i in tokenizer.encode(d, add_special_tokens=True).ids]}
    with open(os.path.join(out, "want.json"), "w", encoding="utf-8") as f:
        json.dump(want, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
