"""Main-job throughput and memory: memrt against PyTorch eager in Python, measured in one run.

Runs, alternately and `--repeats` times each, memrt's launcher on the shipped main-job configs and
bench/torch_eager_gpt2.py on the same model, batch and threads, and prints the median per-step
tokens/s (after `--warmup` steps) and the peak RSS of each process, with their ratios:

    build/bin/launcher must exist (scripts/build.sh), then:
    <venv python> bench/bench_train.py [--steps 60] [--warmup 10] [--repeats 3]
"""
import argparse
import json
import os
import platform
import statistics
import sys

from bench_common import ROOT, launcher, run


def memrt(args, env):
    r = launcher(args.build, "configs/ds_config.json", args.steps, env, ["--logging_steps=1"])
    tps = [m["tokens_per_s"] for m in r["metrics"] if m["step"] > args.warmup]
    return statistics.median(tps), r["rss"]


def eager(args, env):
    text, rss = run([sys.executable, str(ROOT / "bench/torch_eager_gpt2.py"), f"--steps={args.steps}",
                     f"--threads={args.threads}"], env)
    rows = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
    tps = [r["tokens"] / r["seconds"] for r in rows if r["step"] > args.warmup]
    return statistics.median(tps), rss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--build", default="build")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))

    results = {"memrt": [], "eager": []}
    for _ in range(args.repeats):
        results["memrt"].append(memrt(args, env))
        results["eager"].append(eager(args, env))
    med = {k: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v))
           for k, v in results.items()}
    mib = 1024 * 1024
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"threads {args.threads}; {args.steps} steps, median of steps > {args.warmup}, "
          f"{args.repeats} runs each")
    print("| | tokens/s | peak RSS (MiB) |")
    print("|---|---:|---:|")
    for k in ("memrt", "eager"):
        print(f"| {k} | {med[k][0]:.0f} | {med[k][1] / mib:.1f} |")
    print(f"| memrt / eager | {med['memrt'][0] / med['eager'][0]:.3f} | "
          f"{med['memrt'][1] / med['eager'][1]:.3f} |")


if __name__ == "__main__":
    main()
