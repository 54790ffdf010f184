"""One rank of the main job trained by DeepSpeed itself (the `deepspeed` PyPI package, CPU
accelerator, gloo) — what bench/bench_deepspeed.py compares memrt's ZeRO stages with.

The model, its initialisation and the optimizer settings are bench/torch_eager_gpt2.py's (imported,
not copied): pre-LayerNorm GPT-2 blocks, fused qkv, tanh GELU, learned positions, tied embeddings,
no dropout (the main job's configs/train.yaml sets none). The data is memrt's: the built-in corpus
(runtime/src/data/corpus/kjv.txt, every byte a token) cut into windows of block + 1 tokens, visited
in memrt's epoch order (DataLoader's splitmix64 Fisher-Yates, seed 42 as train.yaml) and sharded
across ranks as memrt shards them (docs/data-and-optim.md), so each rank trains on the same samples
as memrt's rank of the same number.

Started by bench_deepspeed.py as one process per rank with torch.distributed's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and DS_ACCELERATOR=cpu; the ds_config is the JSON
memrt gets. Rank 0 prints one JSON line per step, {"step", "seconds", "tokens" (the global batch's
tokens), "loss" (the mean over ranks, as memrt logs it), "lr" (the one this step applied)}; every
rank prints a last line {"rank", "idle_rss_bytes", "peak_rss_bytes", "optimizer",
"basic_optimizer", "zero_stage", "offload_optimizer"}: RSS before the model
is built (torch and deepspeed imported, the process group not yet up), the process's ru_maxrss at
the end (memrt's memory_report.json `measured.resident.peak_bytes` is the same getrusage figure)
and the optimizer classes DeepSpeed chose.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 DS_ACCELERATOR=cpu \
        <deepspeed venv python> bench/deepspeed_gpt2.py --config ds.json --steps 20
"""
import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_eager_gpt2 import GPT, add_model_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "runtime/src/data/corpus/kjv.txt"
M64 = (1 << 64) - 1


def rss_now():
    """The resident set now, in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _splitmix64(state):
    """(new state, output): runtime/src/data/dataset.cpp's splitmix64."""
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def epoch_permutation(n, seed, epoch):
    """memrt's epoch order (dataset.cpp epoch_permutation): Fisher-Yates on splitmix64 draws."""
    order = list(range(n))
    state, z = _splitmix64(seed & M64)
    state = z ^ ((epoch * 0xD1B54A32D192ED03) & M64)
    for i in range(n - 1, 0, -1):
        b = i + 1
        threshold = (1 << 64) % b
        while True:
            state, r = _splitmix64(state)
            if r >= threshold:
                break
        j = r % b
        order[i], order[j] = order[j], order[i]
    return order


class Loader:
    """memrt's DataLoader without accumulation: step s's global batch is epoch-order positions
    [jG, (j+1)G), rank r takes the B samples at jG + rB."""

    def __init__(self, path, block, batch, rank, world, seed):
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        self.T, self.B, self.rank, self.seed = block, batch, rank, seed
        self.samples = data.numel() // (block + 1)
        self.windows = data[: self.samples * (block + 1)].view(self.samples, block + 1).long()
        self.G = batch * world
        self.steps_per_epoch = self.samples // self.G
        if self.steps_per_epoch < 1:
            sys.exit(f"{path}: {self.samples} samples, fewer than one global batch of {self.G}")
        self.epoch, self.order = None, None

    def get(self, step):
        """(B, T + 1) int64 tokens: inputs are [:, :-1], targets [:, 1:]."""
        epoch, j = divmod(step, self.steps_per_epoch)
        if epoch != self.epoch:
            self.order = torch.tensor(epoch_permutation(self.samples, self.seed, epoch))
            self.epoch = epoch
        first = j * self.G + self.rank * self.B
        return self.windows[self.order[first:first + self.B]]


def qualname(obj):
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__name__}"


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap, steps=60, seed=42)
    ap.add_argument("--config", required=True, help="the ds_config JSON (plain JSON)")
    ap.add_argument("--corpus", default=str(CORPUS))
    a = ap.parse_args()
    if a.precision != "fp32":
        sys.exit("deepspeed_gpt2.py trains fp32 only (the ds_config would need fp16/bf16)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import deepspeed  # noqa: E402  (after the thread count: it imports much of torch)
    import torch.distributed as dist

    idle = rss_now()
    torch.manual_seed(0)
    model = GPT(a)
    config = json.loads(Path(a.config).read_text())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config, dist_init_required=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    if config.get("train_micro_batch_size_per_gpu") != a.batch:
        sys.exit(f"ds_config micro batch {config.get('train_micro_batch_size_per_gpu')} != --batch {a.batch}")
    loader = Loader(a.corpus, a.block, a.batch, rank, world, a.seed)
    tokens = a.batch * a.block * world
    for step in range(a.steps):
        t0 = time.perf_counter()
        w = loader.get(step)
        loss = engine(w[:, :-1], w[:, 1:])
        engine.backward(loss)
        lr = engine.get_lr()[0]  # what this step applies (the scheduler steps after it)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # memrt logs the mean loss over ranks; so does this
        value = mean.item() / world
        dt = time.perf_counter() - t0
        if rank == 0:
            print(json.dumps({"step": step + 1, "seconds": dt, "tokens": tokens, "loss": value,
                              "lr": lr}), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"rank": rank, "idle_rss_bytes": idle, "peak_rss_bytes": peak,
                      "optimizer": qualname(engine.optimizer),
                      "basic_optimizer": qualname(getattr(engine, "basic_optimizer", None)),
                      "zero_stage": engine.zero_optimization_stage(),
                      "offload_optimizer": bool(engine.zero_use_cpu_optimizer())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
