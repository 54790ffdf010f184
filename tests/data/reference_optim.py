"""Reference optimizer updates for tests/data/test_optim.cpp, computed with torch.optim (and, for
what torch.optim cannot express, numpy written from DeepSpeed's CPU Adam formula).

usage: reference_optim.py DIR KIND SIZES STEPS HYPER...
  DIR   holds params.f32 (the initial parameters, concatenated) and grads.f32 (STEPS times the
        concatenated gradients) and lrs.f64 (STEPS learning rates); writes out_params.f32 and the
        state tensors out_<state>.f32, all little-endian, concatenated in parameter order.
  KIND  adamw | adam | adam_nobc | sgd | clip (grads.f32 holds one step; writes out_norm.f64
        and out_grads.f32 from torch.nn.utils.clip_grad_norm_ with max_norm=...)
  SIZES comma-separated element counts of the parameters
"""
import sys

import numpy as np
import torch

d, kind, sizes, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4])
hp = dict(a.split("=") for a in sys.argv[5:])
n = sum(sizes)
p0 = np.fromfile(f"{d}/params.f32", dtype="<f4")
grads = np.fromfile(f"{d}/grads.f32", dtype="<f4").reshape(steps, n)
lrs = np.fromfile(f"{d}/lrs.f64", dtype="<f8")
assert p0.size == n and lrs.size == steps
offsets = np.cumsum([0] + sizes)
# A parameter whose gradient is all NaN in a step is "no gradient" in that step (skipped).
params = [torch.nn.Parameter(torch.from_numpy(p0[offsets[i]:offsets[i + 1]].copy())) for i in range(len(sizes))]
wd = float(hp.get("wd", 0))
states = {}

if kind in ("adamw", "adam"):
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls(params, lr=lrs[0], betas=(float(hp["b1"]), float(hp["b2"])), eps=float(hp["eps"]),
              weight_decay=wd, foreach=False)
elif kind == "sgd":
    opt = torch.optim.SGD(params, lr=lrs[0], momentum=float(hp["momentum"]), dampening=float(hp["dampening"]),
                          nesterov=hp["nesterov"] == "1", weight_decay=wd, foreach=False)

if kind == "clip":
    g = [torch.from_numpy(grads[0, offsets[i]:offsets[i + 1]].copy()) for i in range(len(sizes))]
    for x, gi in zip(params, g):
        x.grad = gi
    norm = torch.nn.utils.clip_grad_norm_(params, float(hp["max_norm"]))
    np.array([float(norm)], dtype="<f8").tofile(f"{d}/out_norm.f64")
    torch.cat([x.grad for x in params]).numpy().astype("<f4").tofile(f"{d}/out_grads.f32")
    sys.exit(0)

if kind == "adam_nobc":
    # torch.optim has no bias_correction switch; DeepSpeed's CPU Adam with bias_correction=False
    # (csrc/adam/cpu_adam_impl.cpp) in float32: bc1 = bc2 = 1, decoupled decay before the update.
    b1, b2, eps = np.float32(hp["b1"]), np.float32(hp["b2"]), np.float32(hp["eps"])
    p = [x.detach().numpy().copy() for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for s in range(steps):
        lr = np.float32(lrs[s])
        for i in range(len(p)):
            g = grads[s, offsets[i]:offsets[i + 1]]
            if np.isnan(g).all():
                continue
            m[i] = b1 * m[i] + (np.float32(1) - b1) * g
            v[i] = b2 * v[i] + (np.float32(1) - b2) * g * g
            denom = np.sqrt(v[i]) + eps
            p[i] = p[i] - np.float32(lr * np.float32(wd)) * p[i]
            p[i] = p[i] - lr * (m[i] / denom)
    out = np.concatenate(p)
    states = {"exp_avg": np.concatenate(m), "exp_avg_sq": np.concatenate(v)}
else:
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = float(lrs[s])
        for i, x in enumerate(params):
            g = grads[s, offsets[i]:offsets[i + 1]]
            x.grad = None if np.isnan(g).all() else torch.from_numpy(g.copy())
        opt.step()
    out = torch.cat([x.detach() for x in params]).numpy()
    names = ["exp_avg", "exp_avg_sq"] if kind != "sgd" else (["momentum_buffer"] if float(hp["momentum"]) else [])
    for name in names:
        states[name] = torch.cat([opt.state[x][name].reshape(-1) for x in params]).numpy()

out.astype("<f4").tofile(f"{d}/out_params.f32")
for name, arr in states.items():
    np.asarray(arr, dtype="<f4").tofile(f"{d}/out_{name}.f32")
