"""An independent reference for memrt's data-parallel training: the same GPT-2, the same
micro-batches and initial weights, trained by PyTorch itself — Hugging Face's GPT2LMHeadModel,
torch.optim.AdamW, torch.nn.utils.clip_grad_norm_, and torch.distributed (Gloo, on loopback)
averaging the ranks' gradients as DDP does. It shares no code with memrt.

    torch_reference_train.py init DIR
        writes a small GPT-2 (2 blocks of width 64, vocabulary 256, context 32, no dropout) with
        transformers' own random initialisation to DIR (config.json, model.safetensors)
    torch_reference_train.py train DIR PREFIX RANKS STEPS ACCUM MICRO T LR WD CLIP OUT [TRAINABLE]
        replays PREFIX<rank r>.bin (memrt's fixture_recorder: per step and micro-step, the
        (MICRO, T) inputs then targets, int64) on RANKS processes with a constant learning rate,
        Hugging Face Trainer's weight-decay rule (no decay for biases and LayerNorm weights) and
        gradient clipping at CLIP; writes {"loss": [...], "grad_norm": [...]} per step to OUT
        (the loss averaged over ranks, each the sum over micro-steps of the mean loss / ACCUM;
        the gradient norm before clipping). With TRAINABLE (comma-separated name fragments, as
        LLaMA-Factory's freeze tuning matches them: ".1.,ln_f"), only the parameters whose name
        contains one of them train; the others get requires_grad False
"""
import json
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import GPT2Config, GPT2LMHeadModel


def init(directory):
    torch.manual_seed(1234)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, n_inner=256,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)


def decays(name):
    return not (name.endswith(".bias") or "ln_" in name or "norm" in name)


def worker(rank, args, port):
    directory, prefix, ranks, steps, accum, micro, t, lr, wd, clip, out, trainable = args
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    model = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32)
    model.train()
    if trainable:
        for n, p in model.named_parameters():
            p.requires_grad_(any(fragment in n for fragment in trainable))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": wd},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    tokens = np.fromfile(f"{prefix}rank{rank}.bin", dtype="<i8").reshape(steps, accum, 2, micro, t)
    params = [p for _, p in named]
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in range(accum):
            inputs = torch.from_numpy(tokens[step, m, 0].copy())
            targets = torch.from_numpy(tokens[step, m, 1].copy())
            logits = model(inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) / accum
            loss.backward()
            loss_sum += loss.item()
        for p in params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= ranks
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        losses.append(total.item() / ranks)
        norms.append(norm.item())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": losses, "grad_norm": norms}, f)
    dist.destroy_process_group()


def train(argv):
    directory, prefix, ranks, steps, accum, micro, t, lr, wd, clip, out = argv[:11]
    trainable = argv[11].split(",") if len(argv) > 11 else []
    args = (directory, prefix, int(ranks), int(steps), int(accum), int(micro), int(t), float(lr),
            float(wd), float(clip), out, trainable)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args[2], join=True)


if __name__ == "__main__":
    if sys.argv[1] == "init":
        init(sys.argv[2])
    elif sys.argv[1] == "train":
        train(sys.argv[2:])
    else:
        sys.exit(__doc__)
