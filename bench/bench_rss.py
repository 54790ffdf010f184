"""Resident memory against the allocator: glibc's malloc for tensor storage against memrt's block
cache (docs/memory.md, "Resident memory"), speed and RSS side by side in one run.

Three workloads, each run under both policies, alternated `--repeats` times:

- the main job (configs/ds_config.json + configs/train.yaml, fp32, batch 16 x 128 tokens);
- bench/bench_checkpoint.py's model (GPT-2, 12 blocks, context 512, batch `--batch`) without and
  with `activation_checkpointing`.

Policies for tensor storage:
- `glibc`: `MEMRT_HOST_ALLOCATOR=glibc`, every block from malloc, as LibTorch's default CPU
  allocator does;
- `glibc, fixed mmap threshold`: the same with `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=262144`
  (a fixed threshold: every block of 256 KiB and more is mapped and unmapped each time);
- `jemalloc`, `mimalloc`: malloc from Debian's libjemalloc2 / libmimalloc2.0 through LD_PRELOAD
  (left out, with a note, where not installed);
- `block cache`: memrt's default, blocks of 256 KiB and more from its block cache. For each run,
from rank 0 of memory_report.json: the allocator's peak, the RSS before the model was built (the
idle launcher) and the process's peak RSS (`resident`); growth = peak RSS - idle RSS, the memory
the training itself made resident. Step time is the median per-step time after `--warmup` steps
(metrics.jsonl); every figure is the median over the repeats.

    build/bin/launcher (scripts/build.sh --target launcher memrt_plugins), then:
    <venv python> bench/bench_rss.py [--steps 20] [--warmup 4] [--repeats 3] [--build build]
"""
import argparse
import ctypes.util
import os
import statistics
import sys

import bench_checkpoint
from bench_common import cpu, fmt, launcher

GLIBC = {"MEMRT_HOST_ALLOCATOR": "glibc"}


def policies():
    """{name: environment} of the policies this machine has; notes for those it lacks."""
    out = {"glibc": GLIBC,
           "glibc, fixed mmap threshold": dict(GLIBC, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=262144")}
    notes = []
    for name, lib, pkg in (("jemalloc", "jemalloc", "libjemalloc2"), ("mimalloc", "mimalloc", "libmimalloc2.0")):
        so = ctypes.util.find_library(lib)
        if so:
            out[name] = dict(GLIBC, LD_PRELOAD=so)
        else:
            notes.append(f"{name} left out: not installed (apt-get install {pkg})")
    out["block cache"] = {}
    return out, notes
WORKLOADS = ("main job", "12 blocks", "12 blocks, checkpointed")


def main_job(a, env):
    r = launcher(a.build, "configs/ds_config.json", a.steps, env, ["--logging_steps=1"])
    rows = r["metrics"]
    if len(rows) != a.steps:
        sys.exit(f"main job: metrics.jsonl has {len(rows)} rows, expected {a.steps}\n{r['console']}")
    tokens = 16 * 128
    meas = r["report"]["measured"]
    return {"step_s": statistics.median(tokens / m["tokens_per_s"] for m in rows if m["step"] > a.warmup),
            "peak": meas["peak_bytes"], "resident": meas["resident"]}


def measure(a, workload, policy_env):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), **policy_env)
    if workload == "main job":
        r = main_job(a, env)
    else:
        r = bench_checkpoint.memrt(a, env, checkpointing=workload.endswith("checkpointed"))
    res = r["resident"]
    return {"step_s": r["step_s"], "peak": r["peak"], "idle": res["idle_bytes"],
            "rss": res["peak_bytes"], "growth": res["peak_bytes"] - res["idle_bytes"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="batch of the 12-block model")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--workloads", default=";".join(WORKLOADS), help="a subset, separated by ';'")
    ap.add_argument("--policies", default=None, help="a subset, separated by ';' (glibc is always run)")
    a = ap.parse_args()
    workloads = [w for w in WORKLOADS if w in a.workloads.split(";")]

    pols, notes = policies()
    if a.policies:
        pols = {p: e for p, e in pols.items() if p == "glibc" or p in a.policies.split(";")}
    runs = {(w, p): [] for w in workloads for p in pols}
    for _ in range(a.repeats):
        for w in workloads:
            for p, env in pols.items():
                runs[w, p].append(measure(a, w, env))
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}

    model, flags = cpu()
    print(f"machine: {model} ({flags}), {os.cpu_count()} cores, threads {a.threads}; "
          f"{a.steps} steps, step time = median of steps > {a.warmup}; medians of {a.repeats} "
          f"alternating runs; bytes exact, MB = 10^6 bytes")
    for n in notes:
        print(n)
    print()
    print("| workload | tensor storage | step time (s) | allocator peak | idle RSS | "
          "peak RSS | growth | growth / allocator peak | step time vs glibc |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for w in workloads:
        for p in pols:
            m, base = med[w, p], med[w, "glibc"]
            print(f"| {w} | {p} | {m['step_s']:.4f} | {fmt(m['peak'])} | {fmt(m['idle'])} | "
                  f"{fmt(m['rss'])} | {fmt(m['growth'])} | {m['growth'] / m['peak']:.3f} | "
                  f"{m['step_s'] / base['step_s']:.3f} |")
    print()
    for w in workloads:
        print(f"{w}, each run: " + "; ".join(
            f"{p}: step time {[round(r['step_s'], 4) for r in runs[w, p]]}, growth / peak "
            f"{[round(r['growth'] / r['peak'], 3) for r in runs[w, p]]}" for p in pols))


if __name__ == "__main__":
    main()
