"""Activation checkpointing: memory saved against recompute time paid, memrt and PyTorch eager,
measured in one run.

The model is bench/torch_eager_gpt2.py's GPT-2 (pre-LayerNorm, fused qkv, tanh GELU, learned
positions, tied embeddings) with 12 blocks at context 512 (d_model 256, 4 heads, d_ff 1024,
vocabulary 256, fp32, AdamW, clipping 1.0, no dropout). Four trainings, alternated `--repeats`
times:

- memrt without checkpointing, and with `activation_checkpointing` (every block) — memrt's
  launcher; step time from metrics.jsonl, memory from memory_report.json (the tracking allocator:
  the activations cell at the peak, what forward kept, the allocator's peak);
- PyTorch eager without checkpointing, and with `torch.utils.checkpoint.checkpoint(block, x,
  use_reentrant=False)` around every block — step time from a plain run, memory from one more run
  under `torch.profiler` (profile_memory): the CPU allocator's live bytes at the end of forward and
  at their largest during forward + backward, minus the live bytes before forward (activations
  kept by forward; activations and new gradients at the peak).

Peak RSS (wait4) of each process is printed too. Step time is the median over steps after
`--warmup`, then the median over repeats.

    <venv python> bench/bench_checkpoint.py --build build [--steps 8] [--warmup 2] [--repeats 2]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common import run

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(n_layer=12, n_head=4, d_model=256, d_ff=1024, vocab=256, block=512)


def memrt(a, env, checkpointing):
    m = MODEL
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ds = {"train_micro_batch_size_per_gpu": a.batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
        if checkpointing:
            ds["activation_checkpointing"] = {}
        (d / "ds.json").write_text(json.dumps(ds))
        (d / "train.yaml").write_text(
            f"model: {{arch: gpt2, n_layer: {m['n_layer']}, n_head: {m['n_head']}, "
            f"d_model: {m['d_model']}, d_ff: {m['d_ff']}, vocab_size: {m['vocab']}, "
            f"n_ctx: {m['block']}}}\nblock_size: {m['block']}\nmax_steps: {a.steps}\n"
            f"logging_steps: 1\nseed: 0\nsave_strategy: \"no\"\n")
        console, rss = run([str(ROOT / a.build / "bin/launcher"), "--deepspeed", str(d / "ds.json"),
                            str(d / "train.yaml"), f"--output_dir={d / 'out'}"], env)
        rows = [json.loads(l) for l in (d / "out/metrics.jsonl").read_text().splitlines()]
        report = json.loads((d / "out/memory_report.json").read_text())["ranks"][0]
    tokens = a.batch * m["block"]
    step_s = statistics.median(tokens / r["tokens_per_s"] for r in rows if r["step"] > a.warmup)
    meas = report["measured"]
    at_peak = sum(meas["categories"]["activations"].values())
    est = sum(report["estimate"]["categories"]["activations"].values())
    return {"step_s": step_s, "rss": rss, "activations_at_peak": at_peak,
            "activations_estimate": est, "kept": meas["activations_kept_bytes"],
            "activations_peak": meas["activations_peak_bytes"], "peak": meas["peak_bytes"],
            "resident": meas["resident"]}


# ---- the eager side: this file run as a child process with --eager ---------------------------------
def eager_child(a):
    import torch
    import torch.utils.checkpoint
    from torch.profiler import ProfilerActivity, profile, record_function
    sys.path.insert(0, str(ROOT / "bench"))
    from torch_eager_gpt2 import GPT

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    ns = argparse.Namespace(**MODEL)
    model = GPT(ns)
    if a.checkpointing:
        for i, block in enumerate(model.h):
            class Checkpointed(torch.nn.Module):
                def __init__(self, inner):
                    super().__init__()
                    self.inner = inner

                def forward(self, x):
                    return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
            model.h[i] = Checkpointed(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    params = list(model.parameters())

    def step(idx):
        with record_function("bench:forward"):
            loss = model(idx[:, :-1], idx[:, 1:])
        with record_function("bench:backward"):
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if not a.profile:
        for s in range(a.steps):
            idx = torch.randint(0, MODEL["vocab"], (a.batch, MODEL["block"] + 1))
            t0 = time.perf_counter()
            step(idx)
            print(json.dumps({"step": s + 1, "seconds": time.perf_counter() - t0}), flush=True)
        return
    idx = torch.randint(0, MODEL["vocab"], (a.batch, MODEL["block"] + 1))
    step(idx)  # AdamW's state exists from here on, as in memrt
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        step(idx)
    from torch._C._profiler import _EventType
    marks, allocs = {}, []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.name.startswith("bench:"):
            marks[e.name] = (e.start_time_ns, e.end_time_ns)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            allocs.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
    allocs.sort()
    f0, f1 = marks["bench:forward"]
    _, b1 = marks["bench:backward"]
    # Live bytes just before forward: the first event inside it, minus its own size.
    first = next(x for x in allocs if x[0] >= f0)
    before = first[2] - first[1]
    after_forward = [x for x in allocs if x[0] <= f1][-1][2]
    peak = max(x[2] for x in allocs if f0 <= x[0] <= b1)
    print(json.dumps({"kept": after_forward - before, "peak_working": peak - before}), flush=True)


def eager(a, env, checkpointing):
    base = [sys.executable, str(Path(__file__).resolve()), "--eager", f"--batch={a.batch}",
            f"--threads={a.threads}", f"--steps={a.steps}"] + (["--checkpointing"] if checkpointing else [])
    text, rss = run(base, env)
    rows = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
    step_s = statistics.median(r["seconds"] for r in rows if r["step"] > a.warmup)
    return {"step_s": step_s, "rss": rss}


def eager_memory(a, env, checkpointing):
    text, _ = run([sys.executable, str(Path(__file__).resolve()), "--eager", "--profile",
                   f"--batch={a.batch}", f"--threads={a.threads}"] +
                  (["--checkpointing"] if checkpointing else []), env)
    return json.loads([l for l in text.splitlines() if l.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.eager:
        return eager_child(a)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    runs = {k: [] for k in ("memrt", "memrt_ckpt", "eager", "eager_ckpt")}
    for _ in range(a.repeats):
        runs["memrt"].append(memrt(a, env, False))
        runs["memrt_ckpt"].append(memrt(a, env, True))
        runs["eager"].append(eager(a, env, False))
        runs["eager_ckpt"].append(eager(a, env, True))
    mem = {"eager": eager_memory(a, env, False), "eager_ckpt": eager_memory(a, env, True)}
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    for k in mem:
        med[k].update(mem[k])
    mb = lambda v: f"{v:,} B ({v / 1e6:.1f} MB)"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, threads "
          f"{a.threads}; GPT-2 12 blocks, context 512, d_model 256, batch {a.batch}, fp32; "
          f"{a.steps} steps, median of steps > {a.warmup}, {a.repeats} runs each")
    print("| | step time (s) | activations kept by forward | activations at the peak | "
          "allocator peak | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in ("memrt", "memrt_ckpt"):
        r = med[k]
        print(f"| {k} | {r['step_s']:.3f} | {mb(int(r['kept']))} | {mb(int(r['activations_at_peak']))} "
              f"(estimate {mb(int(r['activations_estimate']))}) | {mb(int(r['peak']))} | "
              f"{r['rss'] / 2**20:.1f} |")
    for k in ("eager", "eager_ckpt"):
        r = med[k]
        print(f"| {k} | {r['step_s']:.3f} | {mb(int(r['kept']))} | {mb(int(r['peak_working']))} "
              f"(with the gradients made in backward) | — | {r['rss'] / 2**20:.1f} |")
    m, mc, e, ec = med["memrt"], med["memrt_ckpt"], med["eager"], med["eager_ckpt"]
    print(f"memrt: checkpointing keeps {1 - mc['activations_at_peak'] / m['activations_at_peak']:.1%} "
          f"less activation memory at the peak ({1 - mc['kept'] / m['kept']:.1%} less kept by forward) "
          f"for {mc['step_s'] / m['step_s'] - 1:+.1%} step time; allocator peak "
          f"{1 - mc['peak'] / m['peak']:.1%} lower")
    print(f"eager: torch.utils.checkpoint keeps {1 - ec['kept'] / e['kept']:.1%} less kept by forward, "
          f"{1 - ec['peak_working'] / e['peak_working']:.1%} less at the peak, for "
          f"{ec['step_s'] / e['step_s'] - 1:+.1%} step time")
    print(f"memrt / eager step time: plain {m['step_s'] / e['step_s']:.3f}, checkpointed "
          f"{mc['step_s'] / ec['step_s']:.3f}")


if __name__ == "__main__":
    main()
