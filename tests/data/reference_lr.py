"""Reference learning rates for tests/data/test_lr_schedule.cpp.

usage: reference_lr.py OUT N TYPE KEY=VALUE... [-- OUT N TYPE KEY=VALUE...]...
For each case (cases separated by `--`: one process pays torch's import once) writes to OUT N
float64: the lr each of the first N optimizer updates runs with, obtained by driving each scheduler through its library's protocol (construct, then for every update: read the lr, update,
scheduler.step()).
  DeepSpeed (WarmupLR, WarmupDecayLR, WarmupCosineLR): written here from the formulas of
    deepspeed/runtime/lr_schedules.py (DeepSpeed is not installed): the constructor sets
    last_batch_iteration = -1 and writes get_lr(), step() increments it and writes get_lr().
  Hugging Face (linear, cosine, constant, constant_with_warmup): torch.optim.lr_scheduler.LambdaLR
    with the lambdas of transformers/optimization.py.
"""
import math
import struct
import sys

import torch


class DeepSpeedLike:
    def __init__(self):
        self.t = -1
        self.lr = self.get_lr()

    def step(self):
        self.t += 1
        self.lr = self.get_lr()

    def warm(self, W, log):
        return math.log(self.t + 1) / math.log(W) if log else self.t / W


class WarmupLR(DeepSpeedLike):
    def __init__(self, lo, hi, W, log, total=None):
        self.lo, self.hi, self.W, self.log, self.total = lo, hi, max(2, W), log, total
        super().__init__()

    def get_lr(self):
        if self.t < 0:
            return self.lo
        if self.t < self.W:
            g = self.warm(self.W, self.log)
        elif self.total is None:
            g = 1.0
        else:
            g = max(0.0, (self.total - self.t) / max(1.0, self.total - self.W))
        return self.lo + (self.hi - self.lo) * g


class WarmupCosineLR(DeepSpeedLike):
    def __init__(self, base, wmin, W, cmin, log, total):
        self.base, self.wmin, self.W, self.cmin, self.log, self.total = base, wmin, max(2, W), cmin, log, total
        super().__init__()

    def get_lr(self):
        if self.t < 0:
            return 0.0
        if self.t < self.W:
            r = self.wmin + (1 - self.wmin) * self.warm(self.W, self.log)
        else:
            p = min(1.0, (self.t - self.W + 1) / max(1, self.total - self.W))
            r = max(0.0, self.cmin + (1 - self.cmin) * (1 + math.cos(math.pi * p)) / 2)
        return self.base * r


def case(out, n, kind, *pairs):
    n = int(n)
    hp = dict(a.split("=") for a in pairs)
    f = lambda k, d=0.0: float(hp.get(k, d))
    i = lambda k, d=0: int(hp.get(k, d))
    lrs = []
    log = hp.get("warmup_type", "log") == "log"
    if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        if kind == "WarmupCosineLR":
            s = WarmupCosineLR(f("lr"), f("warmup_min_ratio"), i("warmup_num_steps"), f("cos_min_ratio"), log,
                               i("total_num_steps"))
        else:
            s = WarmupLR(f("warmup_min_lr"), f("warmup_max_lr"), i("warmup_num_steps"), log,
                         i("total_num_steps") if kind == "WarmupDecayLR" else None)
        for _ in range(n):
            lrs.append(s.lr)
            s.step()
    else:
        W, T = i("warmup_num_steps"), i("total_num_steps")

        def linear(step):
            if step < W:
                return float(step) / float(max(1, W))
            return max(0.0, float(T - step) / float(max(1, T - W)))

        def cosine(step):
            if step < W:
                return float(step) / float(max(1, W))
            progress = float(step - W) / float(max(1, T - W))
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))

        def constant_with_warmup(step):
            return float(step) / float(max(1.0, W)) if step < W else 1.0

        fn = {"linear": linear, "cosine": cosine, "constant": lambda _: 1.0,
              "constant_with_warmup": constant_with_warmup}[kind]
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=f("lr"))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
        for _ in range(n):
            lrs.append(opt.param_groups[0]["lr"])
            p.grad = torch.zeros(1)
            opt.step()
            sched.step()

    with open(out, "wb") as fh:
        fh.write(struct.pack(f"<{n}d", *lrs))


args = sys.argv[1:]
while args:
    end = args.index("--") if "--" in args else len(args)
    case(*args[:end])
    args = args[end + 1:]
