"""Which collective should reduce a ZeRO gradient bucket on a CPU: c10d's Gloo all_reduce (what
plugins/zero does with reduce_scatter false: the in-place sum, then each rank adds its partition's
share), reduce_scatter (each rank receives only its share of the sum), or a reduce to the one rank
whose partition holds the bucket (what plugins/zero does by default: memrt's partitions are ranges
of a flat buffer, so a segment's bucket mostly belongs to one rank).

    <venv python> bench/bench_collectives.py [--ranks 2] [--sizes 16384,262144,1048576,4194304]

Runs `--ranks` processes on loopback (torch.distributed with Gloo: the same c10d ProcessGroupGloo
memrt's Communicator wraps), one thread each, fp32 buckets of each size (elements). Each collective
is timed over enough calls to move 64 MB, `--repeats` times alternating the three, and the median
time per call is printed with its ratio against all_reduce's (below 1: faster). The last lines are
JSON, one per size.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu  # noqa: E402

KINDS = ("all_reduce", "reduce_scatter", "reduce")


def worker(rank, args, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    results = {}
    for n in args.sizes:
        bucket, share = torch.randn(n), torch.empty(n // args.ranks)
        calls = max(5, (64 << 20) // (4 * n))
        ops = {"all_reduce": lambda: dist.all_reduce(bucket),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(share, bucket),
               "reduce": lambda: dist.reduce(bucket, dst=0)}
        times = {k: [] for k in KINDS}
        for repeat in range(args.repeats):
            for kind in (KINDS if repeat % 2 == 0 else KINDS[::-1]):
                ops[kind]()  # warm
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    ops[kind]()
                dist.barrier()
                times[kind].append((time.perf_counter() - t0) / calls)
        results[n] = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="16384,262144,1048576,4194304")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    model, flags = cpu()
    print(f"cpu: {model} ({flags}); torch {torch.__version__}, Gloo on loopback, "
          f"{args.ranks} ranks x 1 thread, median of {args.repeats}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, args.port, out)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    results = out.get()
    for proc in procs:
        proc.join()
    print(f"{'elements':>10} {'all_reduce':>12} {'reduce_scatter':>16} {'reduce':>16}")
    for n, t in results.items():
        base = t["all_reduce"]
        print(f"{n:>10} {base * 1e3:>9.3f} ms {t['reduce_scatter'] * 1e3:>9.3f} ms ({t['reduce_scatter'] / base:.2f})"
              f" {t['reduce'] * 1e3:>8.3f} ms ({t['reduce'] / base:.2f})")
    for n, t in results.items():
        print(json.dumps({"bench": "collectives", "ranks": args.ranks, "elements": n,
                          **{f"{k}_ms": round(v * 1e3, 4) for k, v in t.items()},
                          "reduce_scatter_vs_all_reduce": round(t["reduce_scatter"] / t["all_reduce"], 3),
                          "reduce_vs_all_reduce": round(t["reduce"] / t["all_reduce"], 3)}))


if __name__ == "__main__":
    main()
