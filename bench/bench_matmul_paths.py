"""The matmul path each precision takes, and what it costs: memrt's main job in fp32, bf16 and
fp16 on this CPU as it is, and with oneDNN capped below AVX512-FP16
(`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`), which makes LibTorch's fp16 GEMM take its scalar loop
as on a CPU without native fp16 (an AMD Zen 4) — and memrt take its fp32-arithmetic path
(docs/precision.md, "Matrix products on the CPU").

1. GEMM throughput, PyTorch (the wheel memrt's LibTorch comes from) in a child process per
   setting: a 2048x768 @ 768x3072 product per dtype, GFLOP/s over `--gemm_seconds`.
2. The main job (configs/train.yaml with configs/ds_config.json, ds_bf16.json, ds_fp16_dp.json)
   for `--steps` steps under each setting: the median per-step tokens/s after `--warmup` steps
   (metrics.jsonl), the median over `--repeats` alternating runs; its step time against fp32's
   under the same setting; the start-up line naming each dtype's path.

    build/bin/launcher (scripts/build.sh --target launcher memrt_plugins), then:
    <venv python> bench/bench_matmul_paths.py [--steps 40] [--warmup 5] [--repeats 3] [--build build]
"""
import argparse
import json
import os
import statistics
import sys
import time

from bench_common import cpu, launcher, run

CONFIGS = {"fp32": "configs/ds_config.json", "bf16": "configs/ds_bf16.json",
           "fp16": "configs/ds_fp16_dp.json"}
SETTINGS = {"as it is": {}, "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}


def gemm_child(a):
    import torch
    torch.set_num_threads(a.threads)
    M, K, N = 2048, 768, 3072
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        x, w = torch.randn(M, K, dtype=dt), torch.randn(K, N, dtype=dt)
        torch.mm(x, w)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.gemm_seconds:
            torch.mm(x, w)
            n += 1
        out[name] = 2 * M * K * N * n / (time.perf_counter() - t0) / 1e9
    print(json.dumps(out))


def gemm(a, env):
    text, _ = run([sys.executable, os.path.abspath(__file__), "--gemm_child", f"--threads={a.threads}",
                   f"--gemm_seconds={a.gemm_seconds}"], env)
    return json.loads(text.strip().splitlines()[-1])


def main_job(a, precision, env):
    r = launcher(a.build, CONFIGS[precision], a.steps, env, ["--logging_steps=1"])
    rows = r["metrics"]
    if len(rows) != a.steps:
        sys.exit(f"{precision}: metrics.jsonl has {len(rows)} rows, expected {a.steps}\n{r['console']}")
    line = next((l for l in r["console"].splitlines() if l.startswith("cpu:")), "?")
    return {"tokens_per_s": statistics.median(m["tokens_per_s"] for m in rows if m["step"] > a.warmup),
            "line": line, "last_loss": rows[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gemm_seconds", type=float, default=2.0)
    ap.add_argument("--gemm_child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.gemm_child:
        return gemm_child(a)
    envs = {s: dict(os.environ, OMP_NUM_THREADS=str(a.threads), **e) for s, e in SETTINGS.items()}

    flops = {s: gemm(a, env) for s, env in envs.items()}
    runs = {(s, p): [] for s in SETTINGS for p in CONFIGS}
    for _ in range(a.repeats):
        for s, env in envs.items():
            for p in CONFIGS:
                runs[s, p].append(main_job(a, p, env))
    tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}

    model, flags = cpu()
    print(f"machine: {model} ({flags}), {os.cpu_count()} cores, threads {a.threads}; main job "
          f"batch 16 x 128 tokens, {a.steps} steps, tokens/s = median of steps > {a.warmup}, "
          f"median of {a.repeats} alternating runs")
    print()
    print("GEMM 2048x768 @ 768x3072, PyTorch, GFLOP/s:")
    print("| setting | fp32 | bf16 | fp16 |")
    print("|---|---:|---:|---:|")
    for s in SETTINGS:
        print(f"| {s} | " + " | ".join(f"{flops[s][p]:.1f}" for p in CONFIGS) + " |")
    print()
    print("memrt's main job:")
    print("| setting | precision | tokens/s | step time vs fp32 | last loss |")
    print("|---|---|---:|---:|---:|")
    for s in SETTINGS:
        for p in CONFIGS:
            print(f"| {s} | {p} | {tps[s, p]:.0f} | {tps[s, 'fp32'] / tps[s, p]:.3f} | "
                  f"{runs[s, p][0]['last_loss']:.4f} |")
    print()
    for s in SETTINGS:
        print(f"start-up line, {s}: {runs[s, 'fp32'][0]['line']}")
    for (s, p), v in runs.items():
        print(f"{s}, {p}: tokens/s {[round(r['tokens_per_s']) for r in v]}")


if __name__ == "__main__":
    main()
