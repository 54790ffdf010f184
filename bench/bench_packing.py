"""Packing against padding on a skewed-length dataset (docs/tokenizers.md, "Packing").

    python bench/bench_packing.py [--build build] [--records 2000] [--steps 20] [--repeats 2]

Alpaca records whose responses' lengths are long-tailed (a log-normal number of verses of the
built-in corpus: most a few dozen tokens, a few near sequence_len) are trained by memrt's launcher on
a small Llama with its own byte-level BPE tokenizer (trained here with `tokenizers`, as
bench_tokenizer.py trains it), as axolotl YAMLs name them: once one sample per row padded to the
longest of its micro-batch (sample_packing: false), once packed (sample_packing: true) — the same
records, sequence_len, micro-batch and steps. Prints the CPU, each run's data line (records,
samples, tokens; the packed run's rows and how full they are: real tokens / rows x sequence_len),
the real tokens per second of each (padding never counted: the launcher's "done" line) and their
ratio, medians of --repeats, and one JSON line.
"""
import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import ROOT, cpu
from bench_tokenizer import MULTILINGUAL, train

SEQUENCE_LEN = 1024
MICRO = 4
MODEL = "model: {arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 128, d_ff: 384, vocab_size: VOCAB, n_ctx: 1024}\n"


def launcher(build, *args):
    r = subprocess.run([str(ROOT / build / "bin" / "launcher"), *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"launcher {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def records(n, verses, seed=0):
    """Alpaca records, responses of a log-normal number of verses (median 2, a long tail), capped at 40."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = min(40, max(1, int(math.exp(rng.gauss(math.log(2), 1.1)))))
        start = rng.randrange(len(verses) - k)
        out.append({"instruction": f"Continue the passage {i}.", "input": verses[start][:80],
                    "output": " ".join(verses[start + 1:start + 1 + k])})
    return out


def run(build, tmp, base, data, packed, steps):
    out = os.path.join(tmp, "packed" if packed else "padded")
    shutil.rmtree(out, ignore_errors=True)
    yaml = os.path.join(tmp, "run.yaml")
    Path(yaml).write_text(f"base_model: {base}\ndatasets:\n  - path: {data}\n    type: alpaca\n"
                          f"sequence_len: {SEQUENCE_LEN}\nsample_packing: {'true' if packed else 'false'}\n"
                          f"micro_batch_size: {MICRO}\ngradient_accumulation_steps: 1\nmax_steps: {steps}\n"
                          f"logging_steps: 1\nlearning_rate: 1.0e-3\nsave_strategy: 'no'\n"
                          f"dataset_prepared_path: {os.path.join(tmp, 'prepared')}\n")
    console = launcher(build, "--deepspeed", os.path.join(tmp, "ds.json"), yaml, f"--output_dir={out}")
    done = re.search(r"done: \d+ steps .* in ([\d.]+) s, .*, (\d+) tok/s", console)
    data_line = next(l for l in console.splitlines() if l.startswith("data: "))
    full = re.search(r"packed (\d+)% full", data_line)
    return {"tok_s": float(done.group(2)), "seconds": float(done.group(1)), "data": data_line,
            "packed_full": int(full.group(1)) if full else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    corpus = (ROOT / "runtime/src/data/corpus/kjv.txt").read_text(encoding="utf-8").split("\n")
    verses = [l for l in corpus if l]
    with tempfile.TemporaryDirectory() as tmp:
        tok = os.path.join(tmp, "tokenizer.json")
        vocab = train(tok, corpus + MULTILINGUAL)
        # A random-init Llama saved as a Hugging Face directory, the tokenizer beside it.
        init = os.path.join(tmp, "init.yaml")
        Path(init).write_text(MODEL.replace("VOCAB", str(vocab)) + "max_steps: 1\nsave_steps: 1\n")
        ds = os.path.join(tmp, "ds.json")
        Path(ds).write_text("{}")  # the batch and everything else from the YAMLs
        launcher(args.build, "--deepspeed", ds, init, f"--output_dir={os.path.join(tmp, 'init')}")
        base = os.path.join(tmp, "base")
        launcher(args.build, "export", os.path.join(tmp, "init"), base)
        shutil.copy(tok, base)
        Path(base, "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
        data = os.path.join(tmp, "skewed.jsonl")
        Path(data).write_text("".join(json.dumps(r) + "\n" for r in records(args.records, verses)))

        name, isa = cpu()
        print(f"CPU: {name} ({isa}); {os.cpu_count()} cores")
        print(f"model: Llama 2 x 128, vocabulary {vocab}; {args.records} alpaca records; sequence_len "
              f"{SEQUENCE_LEN}, micro-batch {MICRO}, {args.steps} steps")
        results = {False: [], True: []}
        for _ in range(args.repeats):
            for packed in (False, True):
                results[packed].append(run(args.build, tmp, base, data, packed, args.steps))
        padded, packed = results[False][0], results[True][0]
        print(padded["data"])
        print(packed["data"])
        tok_s = {p: statistics.median(r["tok_s"] for r in results[p]) for p in (False, True)}
        print(f"{'run':>7} | {'rows full':>9} | {'tok/s (real)':>12} | runs")
        print(f"{'padded':>7} | {'—':>9} | {tok_s[False]:>12.0f} | {', '.join(str(int(r['tok_s'])) for r in results[False])}")
        print(f"{'packed':>7} | {str(packed['packed_full']) + '%':>9} | {tok_s[True]:>12.0f} | "
              f"{', '.join(str(int(r['tok_s'])) for r in results[True])}")
        print(f"packed / padded tokens/s: {tok_s[True] / tok_s[False]:.2f}")
        print(json.dumps({"bench": "packing", "records": args.records, "sequence_len": SEQUENCE_LEN,
                          "packed_full": packed["packed_full"], "padded_tok_s": tok_s[False],
                          "packed_tok_s": tok_s[True], "ratio": tok_s[True] / tok_s[False]}))


if __name__ == "__main__":
    main()
