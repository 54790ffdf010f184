"""A frozen 4-bit projection's forward and backward (the input's gradient, as a QLoRA step runs each
base layer): memrt's NF4 Linear4bit (double quantization) against the same layer dense in the same
dtype, measured in one process (build/bin/bench_linear4bit), and bitsandbytes' Linear4bit (its CPU
backend, training mode, from the test venv) on the same shapes, dtype and threads, in a child
process. Shapes: Llama-7B's projections (4096 x 4096, 11008 x 4096 and 4096 x 11008), 512 tokens.
Goal (issue 24): memrt's NF4 layer within 1.3x the dense layer's time, and ahead of bitsandbytes.

Each figure is the median of `--rounds` rounds of 3 calls (memrt's two alternate within a round).
Ends with one JSON line per shape and dtype.

    scripts/build.sh --target bench_linear4bit, then:
    <venv python> bench/bench_linear4bit.py [--threads 2] [--dtypes f32,bf16] [--tokens 512]
"""
import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings

from bench_common import ROOT, cpu, run

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))  # (out, in): q/k/v/o, gate/up, down


def bnb_child(out, inp, tokens, dtype, rounds):
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import bitsandbytes as bnb
    import torch

    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(inp, out, bias=False, compute_dtype=dt, compress_statistics=True, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(out, inp) * 0.02, requires_grad=False, quant_type="nf4",
                                     compress_statistics=True, blocksize=64)
    layer = layer.to("cpu")
    layer.train()
    x0 = torch.randn(tokens, inp).to(dt)
    dy = torch.randn(tokens, out).to(dt)

    def step():
        x = x0.detach().requires_grad_(True)
        layer(x).backward(dy)

    step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        times.append((time.perf_counter() - t0) / 3 * 1e3)
    print(json.dumps({"impl": "bnb_nf4", "ms": statistics.median(times), "threads": torch.get_num_threads()}))


def main():
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        return bnb_child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    rows = []
    for dtype in a.dtypes.split(","):
        for out, inp in SHAPES:
            args = [str(out), str(inp), str(a.tokens), dtype, str(a.rounds)]
            text, _ = run([str(ROOT / a.build / "bin/bench_linear4bit"), *args], env)
            ms = {r["impl"]: r["ms"] for r in map(json.loads, text.strip().splitlines())}
            text, _ = run([sys.executable, os.path.abspath(__file__), "--child", *args], env)
            ms["bnb_nf4"] = json.loads(text.strip().splitlines()[-1])["ms"]
            rows.append((dtype, out, inp, ms))

    model, flags = cpu()
    print(f"machine: {model} ({flags}), {os.cpu_count()} cores, threads {a.threads}; {a.tokens} tokens; "
          f"forward + backward (input gradient) of a frozen layer; ms = median of {a.rounds} rounds of 3 calls")
    print()
    print("| dtype | out x in | dense ms | memrt NF4 ms | bnb NF4 ms | NF4 / dense (goal <= 1.3) | bnb / memrt (goal > 1) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype, out, inp, ms in rows:
        print(f"| {dtype} | {out} x {inp} | {ms['dense']:.1f} | {ms['memrt_nf4']:.1f} | {ms['bnb_nf4']:.1f} | "
              f"{ms['memrt_nf4'] / ms['dense']:.2f} | {ms['bnb_nf4'] / ms['memrt_nf4']:.2f} |")
    print()
    for dtype, out, inp, ms in rows:
        print(json.dumps({"bench": "linear4bit", "dtype": dtype, "out": out, "in": inp, "tokens": a.tokens,
                          **{k + "_ms": v for k, v in ms.items()},
                          "nf4_over_dense": ms["memrt_nf4"] / ms["dense"],
                          "bnb_over_memrt": ms["bnb_nf4"] / ms["memrt_nf4"]}))


if __name__ == "__main__":
    main()
