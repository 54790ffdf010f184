"""The training step's anatomy: how close memrt's step is to the time of its matrix products, where
the rest goes, and memrt against PyTorch eager and torch.compile on the same model, batch and
threads — measured in one run (issue 28).

For each model and dtype:

- **memrt's step**: the launcher trains `--steps` steps with DeepSpeed's `flops_profiler` on the
  last one (docs/profiling.md); step_s is the median step time of the steps after `--warmup`, the
  profiled one left out. The profile's table (each operator's own time in that step) says where the
  time goes; its GEMM row sums the step's matrix products as they ran inside it.
- **The limit, gemm_s**: the same matrix products alone — forward and both backward products of
  every linear layer and of the head, at the step's shapes, every weight trained — timed in a child
  process with the same LibTorch (the venv's torch: memrt links it), in the dtype memrt's products
  take (bf16 through oneDNN, or fp32 where memrt's start-up line says bf16 runs as fp32 GEMM on
  bf16 storage). Attention's batched products are not in it: they are part of what the step adds.
- **The peers**: the same model in PyTorch eager (bench/torch_eager_gpt2.py's GPT-2; transformers'
  LlamaForCausalLM with SDPA attention) and compiled by `torch.compile` (inductor, the loss
  included), AdamW with clipping 1.0, bf16 through `torch.autocast` as their users train it; their
  first `--warmup` steps (compilation) are left out.

The models: the main job (configs/train.yaml: GPT-2, 4 blocks of 256, context 128, batch 16), the
12-block context-512 GPT-2 of bench/bench_checkpoint.py (batch 4), and configs/train_llama100m.yaml
(8 blocks of 768, vocabulary 32000, batch 4 x 256). bf16 runs where the CPU has bf16 instructions
(AVX512-BF16 or AMX). Ends with one JSON line per model and dtype:
{"bench": "step", "model", "dtype", "step_s", "gemm_s", "gemm_fraction", "vs_eager", "vs_compile"}
(the ratios are of tokens/s, memrt over the peer).

    build/bin/launcher must exist (scripts/build.sh), then:
    <venv python> bench/bench_step.py [--models main,gpt2_12x512,llama100m] [--dtypes fp32,bf16]
                                      [--no-compile] [--threads 2]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ROOT, cpu, launcher, run

MODELS = {
    "main": dict(arch="gpt2", n_layer=4, n_head=4, d_model=256, d_ff=1024, vocab=256, block=128, batch=16,
                 yaml="configs/train.yaml", steps=24, warmup=6),
    "gpt2_12x512": dict(arch="gpt2", n_layer=12, n_head=4, d_model=256, d_ff=1024, vocab=256, block=512,
                        batch=4, yaml=None, steps=8, warmup=3),
    "llama100m": dict(arch="llama", n_layer=8, n_head=12, d_model=768, d_ff=2048, vocab=32000, block=256,
                      batch=4, yaml="configs/train_llama100m.yaml", steps=7, warmup=3),
}
# Every setting from train.yaml (the batch, AdamW's, clipping, bf16 by --bf16): only the profiler here.
DS = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}


def linears(m):
    """(rows, out, in) of every matrix product's weight in one step: the blocks' projections and the head."""
    M, d, ff = m["batch"] * m["block"], m["d_model"], m["d_ff"]
    if m["arch"] == "gpt2":
        block = [(M, 3 * d, d), (M, d, d), (M, ff, d), (M, d, ff)]
    else:
        block = [(M, d, d)] * 4 + [(M, ff, d), (M, ff, d), (M, d, ff)]
    return block * m["n_layer"] + [(M, m["vocab"], d)]


# ---- memrt ------------------------------------------------------------------------------------------
def memrt(a, name, dtype, env):
    m = MODELS[name]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "ds.json").write_text(json.dumps(dict(DS, flops_profiler={"enabled": True, "profile_step": m["steps"]})))
        yaml = ROOT / m["yaml"] if m["yaml"] else d / "train.yaml"
        if not m["yaml"]:  # bench/bench_checkpoint.py's model and optimizer
            yaml.write_text(
                f"model: {{arch: gpt2, n_layer: {m['n_layer']}, n_head: {m['n_head']}, d_model: {m['d_model']}, "
                f"d_ff: {m['d_ff']}, vocab_size: {m['vocab']}, n_ctx: {m['block']}}}\nblock_size: {m['block']}\n"
                f"per_device_train_batch_size: {m['batch']}\nlearning_rate: 1.0e-3\nweight_decay: 0.1\n"
                "max_grad_norm: 1.0\nseed: 0\n")
        r = launcher(a.build, d / "ds.json", m["steps"], env, ["--logging_steps=1"] + (["--bf16"] if dtype == "bf16" else []),
                     train_yaml=yaml)
    tokens = m["batch"] * m["block"]
    step_s = statistics.median(tokens / row["tokens_per_s"] for row in r["metrics"]
                               if m["warmup"] < row["step"] < m["steps"])
    fp32_gemm = dtype == "bf16" and "bf16: fp32 GEMM" in r["console"]
    return {"step_s": step_s, "profile": r["profile"], "gemm_dtype": "fp32" if fp32_gemm or dtype == "fp32" else "bf16",
            "tokens": tokens}


# ---- the products alone: this file as a child with --gemm_child ------------------------------------
def gemm_child(a):
    import torch
    torch.set_num_threads(a.threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.gemm_dtype]
    shapes = {}
    for s in linears(MODELS[a.model]):
        shapes[s] = shapes.get(s, 0) + 1
    total = 0.0
    for (M, N, K), count in shapes.items():
        x, w, dy = (torch.randn(r, c).to(dt) for r, c in ((M, K), (N, K), (M, N)))
        products = (lambda: torch.mm(x, w.t()), lambda: torch.mm(dy, w), lambda: torch.mm(dy.t(), x))
        for f in products:
            f()  # warm: the library's first call per shape packs and allocates
            times = []
            for _ in range(a.gemm_repeats):
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            total += count * statistics.median(times)
    print(json.dumps({"gemm_s": total}))


def gemm(a, name, gemm_dtype, env):
    text, _ = run([sys.executable, os.path.abspath(__file__), "--gemm_child", f"--model={name}",
                   f"--gemm_dtype={gemm_dtype}", f"--threads={a.threads}", f"--gemm_repeats={a.gemm_repeats}"], env)
    return json.loads(text.strip().splitlines()[-1])["gemm_s"]


# ---- the peers: this file as a child with --peer eager|compile -------------------------------------
def peer_child(a):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    m = MODELS[a.model]
    if m["arch"] == "gpt2":
        sys.path.insert(0, str(ROOT / "bench"))
        from torch_eager_gpt2 import GPT
        model = GPT(argparse.Namespace(**m))

        def loss_fn(inp, tgt):
            return model(inp, tgt)
        weight_decay = 0.1
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
                             num_hidden_layers=m["n_layer"], num_attention_heads=m["n_head"],
                             num_key_value_heads=m["n_head"], max_position_embeddings=m["block"],
                             rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
        model = LlamaForCausalLM(config)

        def loss_fn(inp, tgt):
            logits = model(input_ids=inp).logits
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.reshape(-1))
        weight_decay = 0.0
    step_loss = torch.compile(loss_fn) if a.peer == "compile" else loss_fn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=weight_decay)
    times = []
    for step in range(m["steps"]):
        idx = torch.randint(0, m["vocab"], (m["batch"], m["block"] + 1))
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = step_loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": statistics.median(times[m["warmup"]:])}))


def peer(a, name, dtype, kind, env):
    text, _ = run([sys.executable, os.path.abspath(__file__), f"--peer={kind}", f"--model={name}",
                   f"--dtype={dtype}", f"--threads={a.threads}"], env)
    return json.loads(text.strip().splitlines()[-1])["step_s"]


# ---- the report -------------------------------------------------------------------------------------
def report(name, dtype, r, top):
    p = r["profile"]
    print(f"\n### {name}, {dtype} ({r['tokens']} tokens a step)\n")
    print("| | seconds | tokens/s | memrt / it |")
    print("|---|---:|---:|---:|")
    print(f"| memrt step | {r['step_s']:.4f} | {r['tokens'] / r['step_s']:.0f} | |")
    print(f"| its products alone ({r['gemm_dtype']} GEMM) | {r['gemm_s']:.4f} | | "
          f"{r['gemm_s'] / r['step_s']:.3f} of the step |")
    for kind in ("eager", "compile"):
        if r.get(kind):
            print(f"| PyTorch {kind} step | {r[kind]:.4f} | {r['tokens'] / r[kind]:.0f} | {r[kind] / r['step_s']:.3f} |")
    print(f"\nThe profiled step ({p['step_s'] * 1e3:.1f} ms, profiler on): its products "
          f"{p['gemm_s'] * 1e3:.1f} ms ({100 * p['gemm_s'] / p['step_s']:.1f}%), "
          f"{p['gemm_flops'] / 1e9:.1f} GFLOP at {p['gemm_flops'] / 1e9 / max(p['gemm_s'], 1e-12):.0f} GFLOP/s; "
          f"the rest by own time:\n")
    print("| operator | calls | ms | % of the step |")
    print("|---|---:|---:|---:|")
    rest = [o for o in p["ops"] if not o["gemm"]]
    for o in rest[:top]:
        print(f"| {o['name']} | {o['calls']} | {o['self_s'] * 1e3:.2f} | {100 * o['self_s'] / p['step_s']:.1f} |")
    other = sum(o["self_s"] for o in rest[top:])
    print(f"| ({len(rest) - top} others) | | {other * 1e3:.2f} | {100 * other / p['step_s']:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default=None, help="default: fp32, and bf16 where the CPU has bf16 instructions")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--build", default="build")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--top", type=int, default=12, help="rows of the per-operator table")
    ap.add_argument("--gemm_repeats", type=int, default=5)
    # child modes
    ap.add_argument("--gemm_child", action="store_true")
    ap.add_argument("--peer", choices=["eager", "compile"])
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--gemm_dtype", default="fp32")
    a = ap.parse_args()
    if a.gemm_child:
        return gemm_child(a)
    if a.peer:
        return peer_child(a)

    name, flags = cpu()
    has_bf16 = "no avx512_bf16" not in flags or "no amx_bf16" not in flags
    dtypes = a.dtypes.split(",") if a.dtypes else (["fp32", "bf16"] if has_bf16 else ["fp32"])
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    print(f"machine: {name} ({flags}), {os.cpu_count()} cores, threads {a.threads}")
    lines = []
    for model in a.models.split(","):
        for dtype in dtypes:
            r = memrt(a, model, dtype, env)
            r["gemm_s"] = gemm(a, model, r["gemm_dtype"], env)
            r["eager"] = peer(a, model, dtype, "eager", env)
            r["compile"] = peer(a, model, dtype, "compile", env) if a.compile else None
            report(model, dtype, r, a.top)
            lines.append({"bench": "step", "model": model, "dtype": dtype, "step_s": round(r["step_s"], 5),
                          "gemm_s": round(r["gemm_s"], 5), "gemm_fraction": round(r["gemm_s"] / r["step_s"], 4),
                          "vs_eager": round(r["eager"] / r["step_s"], 4),
                          "vs_compile": round(r["compile"] / r["step_s"], 4) if r["compile"] else None})
            sys.stdout.flush()
    print()
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
