"""Hugging Face datasets' load_dataset(DIR), the oracle of DataFiles.SplitsAreTheOnesDatasetsLoads
(tests/data/test_data_files.cpp):

    dataset_dirs.py OUT
makes one dataset directory per case under OUT (the layouts users download or write: split files,
split folders, shards, keywords in names, hidden and special folders, a README.md's configs, other
formats) and writes OUT/want.json: {"cases": [{"name", "dir", "config", "module", "splits":
[[split, [file relative to dir, ...]], ...]} or {"name", "dir", "config", "error"}]} — the builder
and data files datasets.load_dataset_builder(dir, name=config) chooses, in its order. It reads no
data, so the files hold one line each.
"""
import json
import os
import sys

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
import datasets  # noqa: E402

CARD_TWO_CONFIGS = """---
configs:
- config_name: sft
  data_files:
  - split: train
    path: sft/*.jsonl
  - split: test
    path: sft_test.jsonl
- config_name: other
  data_files: other.jsonl
---
# Two configs, neither the default
"""

CARD_DEFAULT = """---
configs:
- config_name: small
  data_files: small.jsonl
- config_name: full
  default: true
  data_files:
  - split: train
    path: [full/a.jsonl, full/b.jsonl]
  - split: validation
    path: full/val*.jsonl
---
"""

CARD_DATA_DIR = """---
configs:
- config_name: default
  data_dir: sub
---
"""

CASES = [
    ("split_files", ["train.jsonl", "test.jsonl", "README.md"], None),
    ("one_file", ["data.jsonl", "notes.md", "LICENSE", "config.json"], None),
    ("split_folders", ["data/train/a.jsonl", "data/train/b.jsonl", "data/validation/c.jsonl", "data/train/x.png"], None),
    ("shards", ["data/train-00000-of-00002.jsonl", "data/train-00001-of-00002.jsonl",
                "data/test-00000-of-00001.jsonl", "data/random-00000-of-00001.jsonl", "other.jsonl"], None),
    ("keywords", ["my_train.jsonl", "dev.jsonl", "eval_set.jsonl", "trainer.jsonl", ".hidden/train.jsonl",
                  "__pycache__/test.jsonl", "nested/deep/training-1.jsonl"], None),
    ("text", ["train.txt", "valid.txt", "readme.txt.bak"], None),
    ("vote", ["a.txt", "b.txt", "c.jsonl"], None),
    ("tie", ["a.txt", "c.jsonl"], None),
    ("compressed", ["train.jsonl.gz", "test.jsonl"], None),
    ("parquet", ["data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"], None),
    ("two_formats", ["train.jsonl", "test.csv"], None),
    ("empty", ["README.md", "LICENSE"], None),
    ("card_sft", ["README.md", "sft/a.jsonl", "sft/b.jsonl", "sft_test.jsonl", "other.jsonl"], "sft"),
    ("card_other", ["README.md", "sft/a.jsonl", "sft_test.jsonl", "other.jsonl"], "other"),
    ("card_none", ["README.md", "sft/a.jsonl", "sft_test.jsonl", "other.jsonl"], None),
    ("card_missing", ["README.md", "sft/a.jsonl", "sft_test.jsonl", "other.jsonl"], "nope"),
    ("card_default", ["README.md", "small.jsonl", "full/a.jsonl", "full/b.jsonl", "full/val1.jsonl"], None),
    ("card_data_dir", ["README.md", "sub/train.jsonl", "sub/test.jsonl", "train.jsonl"], None),
    ("no_card_config", ["train.jsonl"], "sft"),
]
CARDS = {"card_sft": CARD_TWO_CONFIGS, "card_other": CARD_TWO_CONFIGS, "card_none": CARD_TWO_CONFIGS,
         "card_missing": CARD_TWO_CONFIGS, "card_default": CARD_DEFAULT, "card_data_dir": CARD_DATA_DIR}


def main():
    out = sys.argv[1]
    cases = []
    for name, files, config in CASES:
        root = os.path.join(out, name)
        for f in files:
            path = os.path.join(root, f)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(CARDS.get(name, "# a dataset\n") if f == "README.md" else '{"text": "x"}\n')
        case = {"name": name, "dir": root, "config": config}
        try:
            builder = datasets.load_dataset_builder(root, name=config)
            case["module"] = type(builder).__module__.split(".")[-1]
            case["splits"] = [[str(split), [os.path.relpath(f, root) for f in files]]
                              for split, files in builder.config.data_files.items()]
        except Exception as e:  # what datasets refuses, memrt must refuse
            case["error"] = f"{type(e).__name__}: {e}"
        cases.append(case)
    with open(os.path.join(out, "want.json"), "w") as f:
        json.dump({"datasets": datasets.__version__, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
