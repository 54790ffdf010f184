"""Mixed precision on the main job: memrt in fp32, bf16 and fp16 against PyTorch eager with
autocast, measured in one run.

memrt: the launcher on configs/train.yaml with configs/ds_config.json (fp32), configs/ds_bf16.json
(bf16) and configs/ds_fp16_dp.json (fp16, DeepSpeed's dynamic loss scaling) for `--steps` steps:
the median per-step tokens/s after `--warmup` steps (metrics.jsonl), the allocator peak and its
cells (rank 0 `measured` of memory_report.json), the process's peak RSS (wait4).

PyTorch eager: bench/torch_eager_gpt2.py, the same model, batch, AdamW and threads, in fp32 and
under `torch.autocast("cpu", dtype=bfloat16 | float16)` with fp32 weights and AdamW (fp16 with
`torch.amp.GradScaler("cpu")`): tokens/s as above and the peak RSS of that process; the allocator
peak and its cells from bench/torch_eager_memory.py `--profile` (the profiler's raw allocation
events replayed in memrt's cells, `--profile_steps` steps, run once per precision after the timed
runs: its peak is reached in step 2 and repeats).

The timed runs alternate (memrt fp32, eager fp32, memrt bf16, ..., `--repeats` times); every figure
is the median over the repeats.

    build/bin/launcher and its plugins (scripts/build.sh --target launcher memrt_plugins), then:
    <venv python> bench/bench_precision.py [--steps 40] [--warmup 5] [--repeats 3] [--build build]
"""
import argparse
import json
import os
import statistics
import sys

from bench_common import CATEGORIES, ROOT, cells, cpu, fmt, launcher, ratio, run

PRECISIONS = {"fp32": "configs/ds_config.json", "bf16": "configs/ds_bf16.json",
              "fp16": "configs/ds_fp16_dp.json"}
SYSTEMS = ("memrt", "eager")


def memrt(args, precision, env):
    r = launcher(args.build, PRECISIONS[precision], args.steps, env, ["--logging_steps=1"])
    rows = r["metrics"]
    if len(rows) != args.steps or not all(m["step"] == i + 1 for i, m in enumerate(rows)):
        sys.exit(f"memrt {precision}: metrics.jsonl has steps {[m['step'] for m in rows]}\n"
                 f"{r['console']}")
    meas = r["report"]["measured"]
    return {"tokens_per_s": statistics.median(m["tokens_per_s"] for m in rows
                                              if m["step"] > args.warmup),
            "rss": r["rss"], "peak": meas["peak_bytes"], "cells": cells(meas["categories"]),
            "kept": meas["activations_kept_bytes"], "peak_step": meas.get("peak_step"),
            "estimate": r["report"]["estimate"]["peak_bytes"], "leaks": r["report"].get("leaks"),
            "last_loss": rows[-1]["loss"], "loss_scales": [m["loss_scale"] for m in rows
                                                           if "loss_scale" in m]}


def eager(args, precision, env):
    text, rss = run([sys.executable, str(ROOT / "bench/torch_eager_gpt2.py"),
                     f"--steps={args.steps}", f"--threads={args.threads}",
                     f"--precision={precision}"], env)
    rows = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
    return {"tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in rows
                                              if r["step"] > args.warmup),
            "rss": rss, "last_loss": rows[-1]["loss"],
            "loss_scales": [r["loss_scale"] for r in rows if "loss_scale" in r]}


def eager_profiled(args, precision, env):
    text, _ = run([sys.executable, str(ROOT / "bench/torch_eager_memory.py"), "--profile",
                   f"--steps={args.profile_steps}", f"--threads={args.threads}",
                   f"--precision={precision}"], env)
    prof = json.loads([l for l in text.splitlines() if l.startswith("{")][-1])
    failed = [k for k, ok in prof["checks"].items() if not ok]
    if failed:
        sys.exit(f"eager {precision}: hand checks failed: " + "; ".join(failed))
    steady = prof["per_step"][str(min(3, args.profile_steps))]
    return {"peak": prof["peak_bytes"], "cells": prof["categories_at_peak"],
            "kept": steady["activations_kept_bytes"], "peak_at": prof["peak_at"],
            "kept_by_op": steady["kept_by_op"], "torch": prof["torch"],
            "checks": len(prof["checks"]), "allocations": prof["allocations"],
            "step_peaks": {k: s["peak_bytes"] for k, s in prof["per_step"].items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile_steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--build", default="build")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))

    runs = {(s, p): [] for p in PRECISIONS for s in SYSTEMS}
    for _ in range(args.repeats):
        for p in PRECISIONS:
            runs["memrt", p].append(memrt(args, p, env))
            runs["eager", p].append(eager(args, p, env))
    prof = {p: eager_profiled(args, p, env) for p in PRECISIONS}

    med = {}
    for (s, p), rs in runs.items():
        med[s, p] = {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "rss")}
        med[s, p]["peak"] = rs[0]["peak"] if s == "memrt" else prof[p]["peak"]
    if any(len({r["peak"] for r in runs["memrt", p]}) > 1 for p in PRECISIONS):
        print("note: memrt's allocator peak differs between runs (the table has the first run's)")

    model, flags = cpu()
    print(f"machine: {model} ({flags}), {os.cpu_count()} cores, "
          f"threads {args.threads} (OMP_NUM_THREADS); torch {prof['fp32']['torch']}; "
          f"batch 16 x 128 tokens; {args.steps} steps, tokens/s = median of steps > {args.warmup}; medians of "
          f"{args.repeats} alternating runs; MB = 10^6 bytes")
    print()
    print("| precision | system | tokens/s | allocator peak | peak RSS | tokens/s vs fp32 | "
          "allocator peak vs fp32 | peak RSS vs fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for p in PRECISIONS:
        for s in SYSTEMS:
            m, base = med[s, p], med[s, "fp32"]
            print(f"| {p} | {s} | {m['tokens_per_s']:.0f} | {fmt(m['peak'])} | {fmt(m['rss'])} | "
                  f"{ratio(m['tokens_per_s'], base['tokens_per_s'])} | "
                  f"{ratio(m['peak'], base['peak'])} | {ratio(m['rss'], base['rss'])} |")
        a, b = med["memrt", p], med["eager", p]
        print(f"| {p} | memrt / eager | {ratio(a['tokens_per_s'], b['tokens_per_s'])} | "
              f"{ratio(a['peak'], b['peak'])} | {ratio(a['rss'], b['rss'])} | | | |")

    print()
    print("Cells at the allocator peak (memrt: rank 0 `measured` of the first run; eager: the "
          "profiled run's replay):")
    cols = [(s, p) for p in PRECISIONS for s in SYSTEMS]
    print("| | " + " | ".join(f"{s} {p}" for s, p in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    cell = {(s, p): (runs[s, p][0] if s == "memrt" else prof[p])["cells"] for s, p in cols}
    for c in CATEGORIES:
        if any(cell[k][c] for k in cols) or c in ("weights", "gradients", "activations"):
            print(f"| {c} | " + " | ".join(fmt(cell[k][c]) for k in cols) + " |")
    print("| activations kept by forward | " + " | ".join(
        fmt((runs[s, p][0] if s == "memrt" else prof[p])["kept"]) for s, p in cols) + " |")

    print()
    for p in PRECISIONS:
        mr = runs["memrt", p]
        print(f"memrt {p}: allocator peaks of the runs {sorted({r['peak'] for r in mr})}, at step "
              f"{mr[0]['peak_step']}; estimate {mr[0]['estimate']:,} B; leaks {mr[0]['leaks']}; "
              f"tokens/s {[round(r['tokens_per_s']) for r in mr]}; peak RSS "
              f"{[r['rss'] for r in mr]}; last loss {[round(r['last_loss'], 4) for r in mr]}"
              + (f"; loss scale min/max {min(min(r['loss_scales']) for r in mr):g}/"
                 f"{max(max(r['loss_scales']) for r in mr):g}" if mr[0]["loss_scales"] else ""))
    for p in PRECISIONS:
        er, pr = runs["eager", p], prof[p]
        print(f"eager {p}: tokens/s {[round(r['tokens_per_s']) for r in er]}; peak RSS "
              f"{[r['rss'] for r in er]}; last loss {[round(r['last_loss'], 4) for r in er]}"
              + (f"; loss scale min/max {min(min(r['loss_scales']) for r in er):g}/"
                 f"{max(max(r['loss_scales']) for r in er):g}" if er[0]["loss_scales"] else "")
              + f"; profiled ({args.profile_steps} steps, {pr['allocations']:,} allocations, "
              f"{pr['checks']} hand checks passed): peak in {pr['peak_at']}, step peaks "
              f"{pr['step_peaks']}; kept by forward in step {min(3, args.profile_steps)}, by op: "
              + ", ".join(f"{op} {v['bytes']:,} B ({v['tensors']})"
                          for op, v in pr["kept_by_op"].items()))


if __name__ == "__main__":
    main()
