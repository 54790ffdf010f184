"""The optimizer step against the memory roofline: memrt's fused step (fp32, and mixed precision
with a bf16 or fp16 compute copy), LibTorch's C++ AdamW and torch.optim.AdamW (foreach on and off), each
stepping N fp32 parameters, beside the machine's memory bandwidth for Adam's traffic measured in
the same run (read p, g, m, v and write p, m, v: 28 bytes per parameter). With `--deepspeed`,
also DeepSpeed's CPU Adam (DeepSpeedCPUAdam, adamw_mode, fp32: the step ZeRO-Offload takes),
run in bench_deepspeed.py's DeepSpeed venv (created, and its CPU Adam compiled, on first use).
With `--lowbit`, also plugins/quant's low-bit steps (bitsandbytes' AdamW8bit and torchao's AdamW8bit
and AdamW4bit kernels) beside the libraries' own CPU optimizers from the test venv
(bitsandbytes.optim.AdamW8bit, torchao.optim.AdamW8bit / AdamW4bit, the last two compiled by
torch.compile in their untimed first steps). With `--lowbit` every size is rounded up to a multiple
of 256: torchao quantizes only a tensor of whole blocks and steps any other in fp32 (so a size like
10,000,000 would time its fp32 AdamW under the 8-bit name); the child checks each library's state
is the low-bit one it times.

Each implementation runs in its own process (build/bin/bench_optimizer_step, or this file as a
child for torch.optim), alternated `--repeats` times; params/s is parameters stepped per second
after 2 untimed steps, over at least `--seconds`; the median over repeats. ratio = params/s over
the roofline's params/s. Ends with one JSON line per implementation and size.

    scripts/build.sh --target bench_optimizer_step, then:
    <venv python> bench/bench_optimizer.py [--sizes 10000000,100000000] [--threads 2] [--deepspeed] [--lowbit]
"""
import argparse
import json
import os
import statistics
import sys
import time

import bench_deepspeed
from bench_common import ROOT, cpu, run

NATIVE = ("roofline", "memrt_fp32", "memrt_mixed", "memrt_mixed_fp16", "libtorch_adamw")
TORCH = ("torch_adamw_foreach", "torch_adamw_for_loop")
DEEPSPEED = "deepspeed_cpu_adam"
LOWBIT_NATIVE = ("memrt_bnb8", "memrt_ao8", "memrt_ao4")
LOWBIT_TORCH = ("bnb_adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit")


def torch_child(impl, n, seconds):
    import torch
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    if impl == DEEPSPEED:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    elif impl == "bnb_adamw8bit":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit([p], lr=1e-3, weight_decay=0.01)
    elif impl.startswith("torchao_"):
        import torchao.optim
        cls = torchao.optim.AdamW8bit if impl == "torchao_adamw8bit" else torchao.optim.AdamW4bit
        opt = cls([p], lr=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01,
                                foreach=impl == "torch_adamw_foreach")
    opt.step()
    opt.step()
    check_lowbit_state(impl, opt.state[p])
    steps, t0 = 0, time.perf_counter()
    while True:
        opt.step()
        steps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    print(json.dumps({"impl": impl, "params": n, "threads": torch.get_num_threads(),
                      "params_per_s": steps * n / elapsed}))


def check_lowbit_state(impl, state):
    """Raises unless a low-bit library holds the moments in its low-bit format (not fp32)."""
    if impl == "bnb_adamw8bit":
        kinds = {str(state["state1"].dtype), str(state["state2"].dtype)}
        want = {"torch.uint8"}
    elif impl.startswith("torchao_"):
        kinds = {type(state["exp_avg"]).__name__, type(state["exp_avg_sq"]).__name__}
        want = {"OptimState8bit" if impl == "torchao_adamw8bit" else "OptimState4bit"}
    else:
        return
    if kinds != want:
        raise SystemExit(f"{impl}: the library keeps this tensor's state as {sorted(kinds)}, not {sorted(want)} "
                         "(torchao quantizes only tensors of whole blocks: use a size that is a multiple of 256)")


def measure(a, impl, n, env, ds_py):
    child = [os.path.abspath(__file__), "--child", impl, str(n), str(a.seconds)]
    if impl in NATIVE + LOWBIT_NATIVE:
        cmd = [str(ROOT / a.build / "bin/bench_optimizer_step"), impl, str(n), str(a.seconds)]
    elif impl == DEEPSPEED:
        cmd, env = [str(ds_py), *child], bench_deepspeed.ds_env(ds_py, env)
    else:
        cmd = [sys.executable, *child]
    text, _ = run(cmd, env)
    return json.loads(text.strip().splitlines()[-1])["params_per_s"]


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        return torch_child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--sizes", default="10000000,100000000")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--deepspeed", action="store_true",
                    help="also DeepSpeed's CPU Adam, from bench_deepspeed.py's venv")
    ap.add_argument("--lowbit", action="store_true",
                    help="also the low-bit steps: memrt's kernels, bitsandbytes' and torchao's optimizers")
    a = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.lowbit and any(n % 256 for n in sizes):
        sizes = [n + (-n) % 256 for n in sizes]
        print(f"sizes rounded up to multiples of 256 for the low-bit steps: {sizes}")
    impls = NATIVE + TORCH + ((DEEPSPEED,) if a.deepspeed else ()) + (LOWBIT_NATIVE + LOWBIT_TORCH if a.lowbit else ())
    ds_py = None
    if a.deepspeed:
        ds_py = bench_deepspeed.ds_venv()
        bench_deepspeed.compile_ops(ds_py, timeout=1800)
    runs = {(i, n): [] for i in impls for n in sizes}
    for _ in range(a.repeats):
        for n in sizes:
            for i in impls:
                runs[i, n].append(measure(a, i, n, env, ds_py))
    med = {k: statistics.median(v) for k, v in runs.items()}

    model, flags = cpu()
    print(f"machine: {model} ({flags}), {os.cpu_count()} cores, threads {a.threads}; params/s = "
          f"median of {a.repeats} alternating runs of >= {a.seconds} s; roofline: read p, g, m, v "
          f"and write p, m, v (28 bytes/param)")
    print()
    print("| parameters | implementation | params/s | GB/s at 28 B/param | ratio to roofline | time vs memrt fp32 |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in sizes:
        roof, fp32 = med["roofline", n], med["memrt_fp32", n]
        for i in impls:
            r = med[i, n]
            print(f"| {n:,} | {i} | {r:.4g} | {r * 28 / 1e9:.1f} | {r / roof:.3f} | {fp32 / r:.3f} |")
    print()
    for n in sizes:
        for i in impls:
            print(f"{i}, {n}: params/s {[f'{r:.4g}' for r in runs[i, n]]}")
    for n in sizes:
        for i in impls:
            print(json.dumps({"bench": "optimizer", "impl": i, "params": n, "params_per_s": med[i, n],
                              "ratio_to_roofline": med[i, n] / med["roofline", n]}))


if __name__ == "__main__":
    main()
