"""Where the main job's memory goes in PyTorch eager, in memrt's categories (docs/memory.md).

Trains bench/torch_eager_gpt2.py's model (the main job's shapes, batch, AdamW, clipping 1.0; fp32,
or `--precision bf16|fp16` under autocast with fp32 weights, gradients and AdamW, fp16 with
GradScaler) for `--steps` steps on the CPU and prints one JSON line.

`--profile` runs everything, the model build included, under
`torch.profiler.profile(activities=[CPU], profile_memory=True, record_shapes=False)` and rebuilds
the CPU allocator's timeline from the profiler's raw allocation events (the kineto event tree:
one event per allocation and per free with its pointer, its size and the allocator's running
total of live bytes; `prof.events()` folds an op's allocations into one figure per op and loses
what happens inside it). Every byte goes into the cell memrt's scopes would give it: the phase
that allocated it (model build: weights; AdamW construction and `step()`: optimizer_state; the
batch: other; forward and backward: activations; clipping (GradScaler's unscale_ included),
`zero_grad` and anything outside a phase: unattributed), except the storages that end up as
`.grad` after backward, which are gradients from the moment they were allocated (memrt claims
each gradient as autograd hands it over). The live bytes are checked against the allocator's own running total after every event,
and the cells against the tensors' `nbytes` sums (parameters, gradients, AdamW state).

Without `--profile` the run is plain eager (no profiler in the process) and the JSON has only the
`nbytes` sums and the process's peak RSS (`ru_maxrss`, after `import torch` and at the end of
training); that is the RSS to compare, since the profiler's own event buffers inflate the resident
set.

    python bench/torch_eager_memory.py [--steps 5] [--threads 2] [--precision fp32] [--profile]
"""
import argparse
import contextlib
import json
import resource
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import CATEGORIES  # noqa: E402
from torch_eager_gpt2 import (GPT, add_model_args, backward, clip, forward_loss,  # noqa: E402
                              make_optimizer, make_scaler, optimizer_step)

# The interpreter with torch imported, before any tensor: the floor under the run's peak RSS.
RSS_AFTER_IMPORT = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

PHASE_CATEGORY = {"build": "weights", "optimizer_init": "optimizer_state", "batch": "other",
                  "forward": "activations", "backward": "activations", "clip": "unattributed",
                  "step": "optimizer_state", "zero_grad": "unattributed"}
MARK = "bench:"


def storages_nbytes(tensors):
    """Bytes of the distinct storages behind tensors (a tied weight counts once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def train(a, mark):
    """The eager training loop, each phase inside mark(phase, step); returns what the replay needs."""
    facts = {"grad_storages": {}, "optimizer_state_nbytes_by_step": {}, "loss_scales": []}
    with mark("build", 0):
        torch.manual_seed(0)
        model = GPT(a)
    params = list(model.parameters())
    with mark("optimizer_init", 0):
        opt = make_optimizer(model, a)
        scaler = make_scaler(a)
    for step in range(1, a.steps + 1):
        with mark("batch", step):
            idx = torch.randint(0, a.vocab, (a.batch, a.block + 1))
        with mark("forward", step):
            loss = forward_loss(model, idx, a)
        with mark("backward", step):
            backward(loss, scaler)
        grads = [p.grad for p in params if p.grad is not None]
        facts["grad_storages"][step] = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                                        for g in grads}
        facts.setdefault("gradients_nbytes", storages_nbytes(grads))
        del grads
        with mark("clip", step):
            clip(params, opt, scaler)
        with mark("step", step):
            optimizer_step(opt, scaler)
        if scaler:
            facts["loss_scales"].append(scaler.get_scale())
        # AdamW's state (an fp16 step skipped on overflow allocates none yet).
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        facts["optimizer_state_nbytes_by_step"][step] = storages_nbytes(state)
        facts["optimizer_state_nbytes"] = storages_nbytes(state)
        facts["optimizer_state_tensors"] = len(state)
        del state
        with mark("zero_grad", step):
            opt.zero_grad(set_to_none=True)
        facts["last_loss"] = loss.item()
        del loss, idx
    facts["parameters"] = sum(p.numel() for p in params)
    facts["parameter_tensors"] = len(params)
    facts["weights_nbytes"] = storages_nbytes(params)
    return facts


def allocation_events(prof):
    """[[time ns, ptr, signed bytes, allocator's live total, phase, step, op]] in time order;
    phase and step come from the enclosing bench: marker (None outside every phase), op is the
    outermost op under it (None for a Python-level free)."""
    from torch._C._profiler import _EventType
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag != _EventType.Allocation:
            continue
        f = e.extra_fields
        if f.device.type != "cpu":
            continue
        phase, step, op, p = None, None, None, e.parent
        while p is not None:
            if p.name.startswith(MARK):
                phase, step = p.name[len(MARK):].split("/")
                step = int(step)
                break
            op, p = p.name, p.parent
        out.append([e.start_time_ns, f.ptr, f.alloc_size, f.total_allocated, phase, step, op])
    out.sort(key=lambda r: r[0])
    return out


def replay(events, facts):
    """Replays the allocation events, live bytes per cell; returns the timeline's figures: the
    peak and the cells at that instant (the first time live bytes exceed the previous peak, as
    memrt's tracker copies them), and per step the live bytes around forward, what forward keeps
    (by op), the largest activations cell during forward and backward, and the step's peak."""
    # Pass 1: every allocation's record; the ones that are .grad after backward are gradients.
    live, records = {}, []
    for i, (_, ptr, size, _, phase, step, op) in enumerate(events):
        if size > 0:
            rec = {"ptr": ptr, "size": size, "phase": phase, "step": step, "op": op,
                   "freed_in": None, "free_i": len(events),
                   "category": PHASE_CATEGORY.get(phase, "unattributed")}
            live[ptr] = rec
            records.append(rec)
            events[i].append(rec)
        else:
            rec = live.pop(ptr)
            assert rec["size"] == -size, (rec, size)
            rec["freed_in"], rec["free_i"] = (phase, step), i
            events[i].append(rec)
    unmatched = []
    for step, storages in facts["grad_storages"].items():
        for ptr, nbytes in storages.items():
            cands = [r for r in records if r["ptr"] == ptr and r["phase"] == "backward"
                     and r["step"] == step and r["freed_in"] != ("backward", step)]
            if len(cands) == 1 and cands[0]["size"] == nbytes:
                cands[0]["category"] = "gradients"
            else:
                unmatched.append((step, ptr, nbytes, len(cands)))

    # Pass 2: the timeline, in memrt's cells.
    cells = dict.fromkeys(CATEGORIES, 0)
    total = 0
    base = None  # the allocator's running total counts from the profiler's start
    mismatches = 0
    peak, at_peak, peak_where = 0, dict(cells), None
    steps = {}
    for i, (_, _, size, alloc_total, phase, step, op, rec) in enumerate(events):
        if phase in ("forward", "backward") and step not in steps:
            steps[step] = {"live_before_forward": total,
                           "activations_before_forward": cells["activations"],
                           "activations_peak_bytes": 0, "peak_bytes": 0}
        total += size
        cells[rec["category"]] += size
        if base is None:
            base = alloc_total - total
        if alloc_total - base != total:
            mismatches += 1
        if total > peak:
            peak, at_peak, peak_where = total, dict(cells), f"{phase} of step {step} ({op})"
        if step in steps:
            s = steps[step]
            s["peak_bytes"] = max(s["peak_bytes"], total)
            if phase in ("forward", "backward"):
                s["activations_peak_bytes"] = max(s["activations_peak_bytes"], cells["activations"])
            if phase == "forward":
                s["live_after_forward"] = total
                s["last_forward_event"] = i
                s["activations_after_forward"] = cells["activations"]
            if phase == "backward":
                s["gradients_after_backward"] = cells["gradients"]
            if phase == "step":
                s["optimizer_state_after_step"] = cells["optimizer_state"]
            s["live_end_of_step"] = total
            s["cells_end_of_step"] = dict(cells)
    for step, s in steps.items():
        s["activations_kept_bytes"] = s["live_after_forward"] - s["live_before_forward"]
        # What forward keeps, by the outermost op that allocated it.
        by_op = {}
        for r in records:
            if (r["phase"], r["step"]) == ("forward", step) and r["free_i"] > s["last_forward_event"]:
                by_op.setdefault(r["op"] or "(python)", [0, 0])
                by_op[r["op"] or "(python)"][0] += r["size"]
                by_op[r["op"] or "(python)"][1] += 1
        s["kept_by_op"] = {k: {"bytes": v[0], "tensors": v[1]}
                           for k, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])}
        assert sum(v[0] for v in by_op.values()) == s["activations_kept_bytes"]
        del s["last_forward_event"]
        assert s["activations_kept_bytes"] == (s["activations_after_forward"]
                                               - s["activations_before_forward"])
    return {"peak_bytes": peak, "peak_at": peak_where,
            "categories_at_peak": at_peak, "events": len(events),
            "allocations": len(records), "allocator_total_mismatches": mismatches,
            "allocator_total_offset": base, "unmatched_gradients": unmatched,
            "per_step": {str(k): v for k, v in sorted(steps.items())}}


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap, steps=5, threads=2)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    if not a.profile:
        facts = train(a, lambda phase, step: contextlib.nullcontext())
        result = {"mode": "plain"}
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     record_shapes=False) as prof:
            facts = train(a, lambda phase, step: record_function(f"{MARK}{phase}/{step}"))
        result = {"mode": "profile", **replay(allocation_events(prof), facts)}
        # Hand checks: the cells against the tensors' nbytes (4 bytes per fp32 parameter).
        checks = {"weights == 4 x parameters": facts["weights_nbytes"] == 4 * facts["parameters"]}
        for k, s in result["per_step"].items():
            checks[f"step {k}: weights cell == parameters' nbytes"] = (
                s["cells_end_of_step"]["weights"] == facts["weights_nbytes"])
            checks[f"step {k}: gradients cell after backward == .grad nbytes"] = (
                s["gradients_after_backward"] == facts["gradients_nbytes"])
            checks[f"step {k}: optimizer_state cell after step == AdamW state nbytes"] = (
                s["optimizer_state_after_step"] == facts["optimizer_state_nbytes_by_step"][int(k)])
        checks["live bytes == allocator's running total after every event"] = (
            result["allocator_total_mismatches"] == 0)
        checks["every .grad storage found among backward's allocations"] = (
            not result["unmatched_gradients"])
        result["checks"] = checks
    facts["grad_storages"] = {k: len(v) for k, v in facts["grad_storages"].items()}
    del facts["optimizer_state_nbytes_by_step"]
    result.update(facts)
    result.update(threads=torch.get_num_threads(), steps=a.steps, batch=a.batch, block=a.block,
                  precision=a.precision, torch=torch.__version__,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  peak_rss_after_import_bytes=RSS_AFTER_IMPORT)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
