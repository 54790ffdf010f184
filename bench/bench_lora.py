"""Fine-tuning a ~100M-parameter Llama three ways: memrt against PyTorch eager with PEFT (and
bitsandbytes for QLoRA), measured in one run on the same weights, batch and threads.

The model is configs/train_llama100m.yaml's (8 blocks of 768, SwiGLU 2048, 12 heads, vocabulary
32000, untied head: 105,788,160 parameters). A child process builds it once with transformers
(seed 0) and saves it; every run below loads that directory (memrt through model_name_or_path),
trains `--steps` steps of 4 x 256 tokens with AdamW (lr 2e-4, no weight decay, clipping 1.0) and
reports its per-step tokens/s and its peak RSS (wait4). The variants:

    full        every parameter trained, fp32
    lora        LoRA r=16, alpha 32, all linear layers of the blocks, on a bf16 base (adapters and
                their AdamW state fp32: PEFT's autocast_adapter_dtype default; memrt's bf16 masters)
    qlora       the same adapters on an NF4 base (double quantization, bf16 compute): memrt's
                load_in_4bit, bitsandbytes' BitsAndBytesConfig for PEFT
    qlora_ckpt  qlora with activation checkpointing (gradient_checkpointing; use_reentrant=False)

memrt runs configs/ds_qlora.json (everything from train.yaml) + configs/train_llama100m.yaml with
the variant's keys as command-line overrides (with `--chunked`, also chunked_cross_entropy: the
head's loss in chunks, the logits never whole; PEFT's side has no CPU counterpart, Liger's fused
kernel being Triton); its measured peak by category comes from its memory_report.json. memrt trains on its built-in corpus, PEFT on random byte tokens (0..255): the
token values do not change the work. Runs alternate (memrt, PEFT) per variant and repeat; the
figures are medians. Ends with one JSON line per variant.

    build/bin/launcher must exist (scripts/build.sh), then:
    <venv python> bench/bench_lora.py [--steps 8] [--warmup 3] [--repeats 2] [--variants full,lora,...] [--chunked]
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile

from bench_common import CATEGORIES, ROOT, cells, cpu, launcher, run

LORA = ["--use_peft", "--lora_r=16", "--lora_alpha=32", "--lora_target_modules=all-linear"]
NF4 = ["--load_in_4bit", "--bnb_4bit_quant_type=nf4", "--bnb_4bit_use_double_quant",
       "--bnb_4bit_compute_dtype=bfloat16"]
VARIANTS = {
    "full": [],
    "lora": LORA + ["--bf16"],
    "qlora": LORA + NF4 + ["--bf16"],
    "qlora_ckpt": LORA + NF4 + ["--bf16", "--gradient_checkpointing"],
}
BATCH, BLOCK = 4, 256


def child_make(directory):
    """Saves configs/train_llama100m.yaml's model, as transformers initialises it, to directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)


def child_train(directory, variant, steps, threads):
    """PyTorch eager + PEFT (+ bitsandbytes), as their users write it; one JSON line per step."""
    import logging
    import time
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kwargs = {"dtype": torch.float32 if variant == "full" else torch.bfloat16}
    if variant.startswith("qlora"):
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    if variant == "qlora_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant != "full":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    print(json.dumps({"trainable": sum(p.numel() for p in params)}), flush=True)
    opt = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0)
    for step in range(steps):
        idx = torch.randint(0, 256, (BATCH, BLOCK))
        t0 = time.perf_counter()
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(json.dumps({"step": step + 1, "seconds": time.perf_counter() - t0, "loss": loss.item()}),
              flush=True)


def memrt(a, directory, variant, env):
    r = launcher(a.build, "configs/ds_qlora.json", a.steps, env,
                 [f"--model_name_or_path={directory}", *VARIANTS[variant],
                  *(["--chunked_cross_entropy"] if a.chunked else [])],
                 train_yaml="configs/train_llama100m.yaml")
    trainable = int(re.search(r"trainable params: ([\d,]+)", r["console"]).group(1).replace(",", ""))
    tps = statistics.median(m["tokens_per_s"] for m in r["metrics"] if m["step"] > a.warmup)
    return {"tokens_per_s": tps, "rss": r["rss"], "trainable": trainable,
            "peak": r["report"]["measured"]["peak_bytes"], "categories": cells(r["report"]["measured"]["categories"])}


def peft(a, directory, variant, env):
    text, rss = run([sys.executable, __file__, "--child", "train", directory, variant, str(a.steps),
                     str(a.threads)], env)
    rows = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
    tps = statistics.median(BATCH * BLOCK / r["seconds"] for r in rows if r.get("step", 0) > a.warmup)
    return {"tokens_per_s": tps, "rss": rss, "trainable": rows[0]["trainable"]}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        if sys.argv[2] == "make":
            return child_make(sys.argv[3])
        return child_train(sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--build", default="build")
    ap.add_argument("--chunked", action="store_true", help="memrt with chunked_cross_entropy")
    a = ap.parse_args()
    variants = a.variants.split(",")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))

    with tempfile.TemporaryDirectory() as directory:
        run([sys.executable, __file__, "--child", "make", directory], env)
        runs = {(v, who): [] for v in variants for who in ("memrt", "peft")}
        for _ in range(a.repeats):
            for v in variants:
                runs[v, "memrt"].append(memrt(a, directory, v, env))
                runs[v, "peft"].append(peft(a, directory, v, env))

    def med(v, who, key):
        return statistics.median(r[key] for r in runs[v, who])

    model, flags = cpu()
    mib = 1024 * 1024
    print(f"machine: {model} ({flags}), {os.cpu_count()} cores, threads {a.threads}; "
          f"configs/train_llama100m.yaml, batch {BATCH} x {BLOCK} tokens, {a.steps} steps, tokens/s = "
          f"median of steps > {a.warmup}, peak RSS by wait4; medians of {a.repeats} alternating runs"
          + ("; memrt with chunked_cross_entropy" if a.chunked else ""))
    print()
    print("| variant | trainable memrt | trainable PEFT | tokens/s memrt | tokens/s PEFT | memrt / PEFT "
          "| peak RSS memrt (MiB) | peak RSS PEFT (MiB) | memrt / PEFT |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        t = (med(v, "memrt", "tokens_per_s"), med(v, "peft", "tokens_per_s"))
        m = (med(v, "memrt", "rss"), med(v, "peft", "rss"))
        print(f"| {v} | {runs[v, 'memrt'][0]['trainable']:,} | {runs[v, 'peft'][0]['trainable']:,} | "
              f"{t[0]:.0f} | {t[1]:.0f} | {t[0] / t[1]:.2f} | {m[0] / mib:.1f} | {m[1] / mib:.1f} | "
              f"{m[0] / m[1]:.2f} |")
    print()
    print("memrt's allocator peak by category (memory_report.json, measured, MB = 10^6 bytes):")
    shown = [c for c in CATEGORIES if any(runs[v, "memrt"][0]["categories"][c] for v in variants)]
    print("| variant | " + " | ".join(shown) + " | peak |")
    print("|---|" + "---:|" * (len(shown) + 1))
    for v in variants:
        r = runs[v, "memrt"][0]
        print(f"| {v} | " + " | ".join(f"{r['categories'][c] / 1e6:.3f}" for c in shown) +
              f" | {r['peak'] / 1e6:.3f} |")
    print()
    for (v, who), rs in runs.items():
        print(f"{v}, {who}: tokens/s {[round(r['tokens_per_s']) for r in rs]}, "
              f"RSS MiB {[round(r['rss'] / mib, 1) for r in rs]}")
    for v in variants:
        print(json.dumps({"bench": "lora", "variant": v, "threads": a.threads, "chunked": a.chunked,
                          "tokens_per_s_memrt": round(med(v, "memrt", "tokens_per_s"), 1),
                          "tokens_per_s_peft": round(med(v, "peft", "tokens_per_s"), 1),
                          "rss_memrt": int(med(v, "memrt", "rss")), "rss_peft": int(med(v, "peft", "rss")),
                          "peak_memrt": runs[v, "memrt"][0]["peak"]}))


if __name__ == "__main__":
    main()
