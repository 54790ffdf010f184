"""The main job's model trained by PyTorch eager in Python — what a user would run instead of memrt.

Same architecture as memrt's GPT-2 (pre-LayerNorm blocks, fused qkv, tanh GELU, learned
positions, tied embeddings), same shapes, batch, optimizer (AdamW) and threads. Prints one JSON
line per step: {"step", "seconds", "tokens", "loss"} (and "loss_scale" in fp16).

`--precision bf16|fp16` trains as autocast users do: fp32 weights, gradients and AdamW, forward
under `torch.autocast("cpu", dtype=...)` (backward follows the dtypes forward chose); fp16 adds
`torch.amp.GradScaler("cpu")` (it works on the CPU in torch 2.13) with DeepSpeed's dynamic scale as
configs/ds_fp16_dp.json sets it: 2^16 to start, halved on an overflow (the step is skipped),
doubled after 1000 clean steps.

    python bench/torch_eager_gpt2.py --n_layer 4 --n_head 4 --d_model 256 --d_ff 1024 \
        --vocab 256 --block 128 --batch 16 --steps 60 --threads 2 [--precision fp32]
"""
import argparse
import contextlib
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, n_head, d_ff):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, d_ff)
        self.mlp_proj = nn.Linear(d_ff, d)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.d_model)
        self.wpe = nn.Embedding(a.block, a.d_model)
        self.h = nn.ModuleList(Block(a.d_model, a.n_head, a.d_ff) for _ in range(a.n_layer))
        self.ln_f = nn.LayerNorm(a.d_model)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V), tied
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# --precision: the autocast dtype (fp32: no autocast).
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_model_args(ap, **defaults):
    """The main job's shapes, batch and optimizer settings as options (shared with
    bench/torch_eager_memory.py); keyword arguments add integer options."""
    for k, v in dict(n_layer=4, n_head=4, d_model=256, d_ff=1024, vocab=256, block=128, batch=16,
                     **defaults).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--precision", choices=sorted(AUTOCAST_DTYPES), default="fp32")


def make_optimizer(model, a):
    """AdamW as configs/ds_config.json sets it (betas 0.9/0.999 and eps 1e-8 are the defaults)."""
    return torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)


def make_scaler(a):
    """fp16: GradScaler with configs/ds_fp16_dp.json's dynamic loss scale; otherwise None."""
    if a.precision != "fp16":
        return None
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                                growth_interval=1000)


# One training step in phases, shared with bench/torch_eager_memory.py (which files each phase's
# allocations in memrt's cells): forward_loss, backward, clip, optimizer_step, then
# opt.zero_grad(set_to_none=True).
def forward_loss(model, idx, a):
    dtype = AUTOCAST_DTYPES[a.precision]
    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
        return model(idx[:, :-1], idx[:, 1:])


def backward(loss, scaler):
    (scaler.scale(loss) if scaler else loss).backward()


def clip(params, opt, scaler):
    if scaler:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1.0)


def optimizer_step(opt, scaler):
    if scaler:
        scaler.step(opt)  # skipped when unscale_ found an inf/NaN
        scaler.update()
    else:
        opt.step()


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap, steps=60, threads=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(a)
    opt = make_optimizer(model, a)
    scaler = make_scaler(a)
    for step in range(a.steps):
        idx = torch.randint(0, a.vocab, (a.batch, a.block + 1))
        t0 = time.perf_counter()
        loss = forward_loss(model, idx, a)
        backward(loss, scaler)
        clip(model.parameters(), opt, scaler)
        optimizer_step(opt, scaler)
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        row = {"step": step + 1, "seconds": dt, "tokens": a.batch * a.block, "loss": loss.item()}
        if scaler:
            row["loss_scale"] = scaler.get_scale()
        print(json.dumps(row), flush=True)
    assert math.isfinite(loss.item())


if __name__ == "__main__":
    main()
