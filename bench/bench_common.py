"""What the bench/ drivers share: running a process for its peak RSS, running memrt's launcher on a
main-job config, memrt's memory categories and the byte formatting of the tables. It does not
import torch: the PyTorch side runs in the torch_eager_*.py processes the drivers start.
"""
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CATEGORIES = ["weights", "master_weights", "gradients", "optimizer_state", "quant_state",
              "adapters", "activations", "comm_buffers", "other", "unattributed"]


def run(cmd, env):
    """Runs cmd; returns (stdout, peak RSS in bytes of that process: ru_maxrss from wait4)."""
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, env=env)
        stderr = p.stderr.read().decode()  # before wait4: a full stderr pipe would block the child
        _, status, usage = os.wait4(p.pid, 0)
        out.seek(0)
        text = out.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{cmd[0]} failed:\n{text}\n{stderr}")
    return text, usage.ru_maxrss * 1024


def launcher(build, ds_config, steps, env, extra=(), train_yaml="configs/train.yaml"):
    """Runs memrt's launcher on ds_config + train_yaml (the main job's by default) for `steps`
    steps in a temporary output_dir, saving no checkpoint (the peers save none); returns {"console", "rss", "metrics" (metrics.jsonl rows),
    "report" (rank 0 of memory_report.json), "profile" (step_profile.json when flops_profiler wrote one, else None)}.
    Paths are relative to the checkout or absolute."""
    with tempfile.TemporaryDirectory() as out_dir:
        console, rss = run([str(ROOT / build / "bin" / "launcher"), "--deepspeed",
                            str(ROOT / ds_config), str(ROOT / train_yaml),
                            f"--max_steps={steps}", f"--output_dir={out_dir}", "--save_strategy=no", *extra], env)
        out = Path(out_dir)
        if not (out / "memory_report.json").exists():
            sys.exit(f"launcher wrote no memory_report.json; its output:\n{console}")
        metrics = out / "metrics.jsonl"
        rows = ([json.loads(l) for l in metrics.read_text().splitlines()]
                if metrics.exists() else [])
        report = json.loads((out / "memory_report.json").read_text())
        profile = json.loads((out / "step_profile.json").read_text()) if (out / "step_profile.json").exists() else None
    rank0 = next(r for r in report["ranks"] if r["rank"] == 0)
    return {"console": console, "rss": rss, "metrics": rows, "report": rank0, "profile": profile}


def cells(table):
    """{category: device + host bytes} of a report's categories."""
    return {c: sum(table.get(c, {}).values()) for c in CATEGORIES}


def fmt(v):
    """Exact bytes and MB = 10^6 bytes."""
    return "—" if v is None else f"{v:,} B ({v / 1e6:.3f} MB)"


def ratio(a, b):
    return "—" if a is None or not b else f"{a / b:.3f}"


def cpu():
    """The CPU's model name and its 16-bit instruction sets (from /proc/cpuinfo)."""
    info = {k.strip(): v.strip() for k, v in
            (l.split(":", 1) for l in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
             if ":" in l)}
    flags = set(info.get("flags", "").split())
    want = ["avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile"]
    return (info.get("model name", platform.machine()),
            " ".join(f if f in flags else f"no {f}" for f in want))
