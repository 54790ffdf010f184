"""Main-job memory: memrt's measured table (docs/memory.md) next to PyTorch eager, in one run.

Runs memrt's launcher on the shipped main-job configs for `--steps` steps and reads rank 0 of its
memory_report.json (`measured`: the cells at the peak, the peak, the activations kept by forward
and their peak; `estimate`: the plan), then bench/torch_eager_memory.py twice on the same model,
batch, optimizer and threads: once under the profiler (the CPU allocator's timeline in memrt's
cells) and once plain (its peak RSS). Prints one table, in bytes and MB = 10^6 bytes:

    build/bin/launcher must exist (scripts/build.sh launcher memrt_plugins), then:
    <venv python> bench/bench_memory.py [--steps 5] [--threads N] [--repeats 3] [--build build]

The peak RSS is each process's ru_maxrss (wait4), the median of `--repeats` runs of the launcher
and of the unprofiled eager script. `--report FILE` reads a memory_report.json instead of running
the launcher (memrt's RSS is then not known).
"""
import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from bench_common import CATEGORIES, ROOT, cells, fmt, launcher, ratio, run


def memrt(args, env):
    """Rank 0 of the run's memory_report.json and the launcher's peak RSS (wait4)."""
    if args.report:
        report = json.loads(Path(args.report).read_text())
        return next(r for r in report["ranks"] if r["rank"] == 0), None
    r = launcher(args.build, "configs/ds_config.json", args.steps, env)
    return r["report"], r["rss"]


def eager(args, env, profile):
    cmd = [sys.executable, str(ROOT / "bench/torch_eager_memory.py"), f"--steps={args.steps}",
           f"--threads={args.threads}"] + (["--profile"] if profile else [])
    text, rss = run(cmd, env)
    result = json.loads([l for l in text.splitlines() if l.startswith("{")][-1])
    return result, rss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3, help="runs for the peak RSS medians")
    ap.add_argument("--build", default="build")
    ap.add_argument("--report", help="memory_report.json to read instead of running the launcher")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))

    # Runs alternate; the tables come from the first memrt run and the profiled eager run, the
    # peak RSS is the median over --repeats runs of each (the eager ones without the profiler).
    memrt_runs, plain_runs = [], []
    for _ in range(args.repeats):
        memrt_runs.append(memrt(args, env))
        plain_runs.append(eager(args, env, profile=False))
        if args.report:
            break
    prof, _ = eager(args, env, profile=True)
    rank0 = memrt_runs[0][0]
    plain = plain_runs[0][0]
    memrt_rss = None if args.report else statistics.median(r for _, r in memrt_runs)
    eager_rss = statistics.median(r for _, r in plain_runs)
    eager_rss_train = statistics.median(p["peak_rss_bytes"] for p, _ in plain_runs)
    eager_rss_import = statistics.median(p["peak_rss_after_import_bytes"] for p, _ in plain_runs)
    peaks = sorted({r["measured"]["peak_bytes"] for r, _ in memrt_runs})
    failed = [k for k, ok in prof["checks"].items() if not ok]
    if failed:
        sys.exit("eager: hand checks failed: " + "; ".join(failed))

    meas, est = rank0["measured"], rank0["estimate"]
    m_cells, e_cells = cells(meas["categories"]), cells(est["categories"])
    t_cells = prof["categories_at_peak"]
    steady = prof["per_step"][str(min(3, args.steps))]
    rows = []
    for c in CATEGORIES:
        if c in ("weights", "gradients", "optimizer_state", "activations", "other",
                 "unattributed") or m_cells[c] or e_cells[c] or t_cells[c]:
            rows.append((f"{c} (at the peak)", m_cells[c], e_cells[c], t_cells[c]))
    rows += [
        ("allocator peak", meas["peak_bytes"], est["peak_bytes"], prof["peak_bytes"]),
        ("activations kept by forward", meas["activations_kept_bytes"], None,
         steady["activations_kept_bytes"]),
        ("activation peak", meas["activations_peak_bytes"], None,
         max(s["activations_peak_bytes"] for s in prof["per_step"].values())),
        ("peak RSS (process, median of runs)", memrt_rss, None, eager_rss),
    ]

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"threads {args.threads}; torch {plain['torch']}; {args.steps} steps, batch "
          f"{plain['batch']} x {plain['block']} tokens")
    print(f"memrt: rank 0 of memory_report.json, peak at step {meas.get('peak_step')}, "
          f"{meas.get('allocations'):,} allocations, leaks {rank0.get('leaks')}"
          + (f" (from {args.report})" if args.report else
             f"; measured peak_bytes of the {len(memrt_runs)} runs: "
             + ", ".join(f"{p:,}" for p in peaks)))
    print(f"eager: the profiled run peaks in {prof['peak_at']}; activations kept = live after "
          f"forward - live before forward of step {min(3, args.steps)}")
    print("peak RSS: ru_maxrss of the process (wait4), launcher against the unprofiled eager run; "
          f"runs: memrt {[r for _, r in memrt_runs] if not args.report else '—'}, "
          f"eager {[r for _, r in plain_runs]}; eager's own ru_maxrss at the end of training "
          f"(before interpreter exit) {eager_rss_train:,} B, right after `import torch` "
          f"{eager_rss_import:,} B (medians)")
    print()
    print("| | memrt measured | memrt estimate | PyTorch eager | memrt / eager |")
    print("|---|---:|---:|---:|---:|")
    for name, m, e, t in rows:
        print(f"| {name} | {fmt(m)} | {fmt(e)} | {fmt(t)} | {ratio(m, t)} |")

    print()
    print("PyTorch eager per step (CPU allocator, from the profiler's allocation events):")
    print("| step | live before forward | live after forward | kept by forward | "
          "activation peak | step peak |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k in sorted({"1", str(min(3, args.steps))}, key=int):
        s = prof["per_step"][k]
        print(f"| {k} | {fmt(s['live_before_forward'])} | {fmt(s['live_after_forward'])} | "
              f"{fmt(s['activations_kept_bytes'])} | {fmt(s['activations_peak_bytes'])} | "
              f"{fmt(s['peak_bytes'])} |")
    print()
    print(f"eager nbytes: parameters {plain['parameters']:,} in {plain['parameter_tensors']} tensors "
          f"= {plain['weights_nbytes']:,} B (4 x parameters); all gradients "
          f"{plain['gradients_nbytes']:,} B; AdamW state {plain['optimizer_state_nbytes']:,} B "
          f"in {plain['optimizer_state_tensors']} tensors (exp_avg, exp_avg_sq and a 4-byte step "
          f"per parameter); hand checks: {len(prof['checks'])} passed")
    print(f"eager profiled run: {prof['allocations']:,} allocations; its peak RSS (profiler "
          f"included) {prof['peak_rss_bytes']:,} B; categories at the peak {prof['categories_at_peak']}")
    print(f"eager kept by forward in step {min(3, args.steps)}, by op:",
          ", ".join(f"{op} {v['bytes']:,} B ({v['tensors']})"
                    for op, v in steady["kept_by_op"].items()))
    if "timeline" in rank0:
        print("memrt timeline:", json.dumps(rank0["timeline"]))


if __name__ == "__main__":
    main()
