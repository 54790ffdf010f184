"""memrt against DeepSpeed itself on 2 ranks: ZeRO stage 0, 1, 2, 2 + offload_optimizer, 3 and
3 + offload_optimizer + offload_param, fp32.

One command, on a fresh machine too (build/bin/launcher must exist: scripts/build.sh):

    python3 bench/bench_deepspeed.py                                  # full: 60 steps, 3 repeats
    python3 bench/bench_deepspeed.py --steps 20 --warmup 5 --repeats 1  # quick check that all runs

The DeepSpeed side runs in its own virtual environment, created on first use and reused after:
~/.cache/memrt/venv-deepspeed0.19.0-torch2.13.0 (or $MEMRT_DS_VENV), `pip install torch==2.13.0
deepspeed==0.19.0 numpy` from PyPI with DS_BUILD_OPS=0, so the test suite's venv
(~/.cache/memrt/venv-torch2.13.0, scripts/setup.sh) is never touched. DeepSpeed's CPU ops (CPU Adam,
FusedAdam's CPU build, the shared-memory comm op its CPU accelerator builds at init) are then
JIT-compiled once with g++ and ninja into ~/.cache/torch_extensions before anything is timed; they
need g++ and the Python headers (Debian: g++ python3-dev).

Each stage's ds_config is written to a temporary directory and given unchanged to both: memrt's
`launcher --num_procs 2 --deepspeed CFG configs/train.yaml --max_steps=N --logging_steps=1` and
bench/deepspeed_gpt2.py, started here as 2 rank processes with torch.distributed's variables
(MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), DS_ACCELERATOR=cpu
(gloo). The main job's model, data (the built-in corpus, memrt's sample order and sharding),
global batch (2 x 16 x 128 tokens), AdamW (lr 1e-3, wd 0.1), clipping 1.0, WarmupCosineLR, no
dropout, and OMP_NUM_THREADS=--threads (1) per rank.

Figures, each the median over `--repeats` runs, memrt and DeepSpeed alternated (the order flips
every repeat):
- tokens/s: the global batch's tokens over rank 0's step time, median of the steps after
  `--warmup` (memrt: metrics.jsonl's tokens_per_s; DeepSpeed: timed the same way, batch fetch to
  the optimizer step and the loss's all-reduce, in deepspeed_gpt2.py; op compilation is done
  before any timed run);
- peak RSS per rank: the rank process's ru_maxrss at the end of training (memrt:
  memory_report.json `measured.resident.peak_bytes` of each rank; DeepSpeed: getrusage in each
  rank), and the idle RSS before the model is built (memrt: `resident.idle_bytes`, the launcher
  with LibTorch loaded; DeepSpeed: Python with torch and deepspeed imported) and the growth
  peak - idle, of the rank with the highest peak.
A run that fails is reported with its error and left out of the medians. The last lines are JSON,
one per implementation and stage.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench_common import ROOT, cpu, fmt, ratio

DS_VERSION = "0.19.0"
TORCH_VERSION = "2.13.0"
STAGES = {"0": (0, False), "1": (1, False), "2": (2, False), "2+offload": (2, True), "3": (3, False),
          "3+offload": (3, True)}
IMPLS = ("memrt", "deepspeed")


def log(msg):
    print(f"[bench_deepspeed] {msg}", file=sys.stderr, flush=True)


# ---- the DeepSpeed environment --------------------------------------------------------------------

def ds_venv():
    """The venv's python, creating the venv on first use (pip from PyPI; minutes, once)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = Path(os.environ.get("MEMRT_DS_VENV") or
                cache / "memrt" / f"venv-deepspeed{DS_VERSION}-torch{TORCH_VERSION}")
    py = venv / "bin" / "python"
    stamp = venv / f".memrt-deepspeed{DS_VERSION}-torch{TORCH_VERSION}"
    if stamp.exists() and py.exists():
        return py
    missing = [t for t in ("g++",) if not shutil.which(t)]
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        missing.append("Python.h")
    if missing:
        sys.exit(f"DeepSpeed's CPU ops compile with g++ against the Python headers; missing: "
                 f"{', '.join(missing)} (Debian: apt-get install g++ python3-dev)")
    log(f"creating {venv}: torch=={TORCH_VERSION} deepspeed=={DS_VERSION} from PyPI "
        f"(a few GiB, once)")
    if subprocess.run([sys.executable, "-m", "venv", str(venv)], timeout=300).returncode:
        sys.exit(f"{sys.executable} -m venv {venv} failed (Debian: apt-get install python3-venv)")
    env = dict(os.environ, DS_BUILD_OPS="0")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"torch=={TORCH_VERSION}", f"deepspeed=={DS_VERSION}", "numpy"],
                   check=True, timeout=3600, env=env)
    check = ("import sys, torch, deepspeed; sys.exit(0 if torch.__version__.split('+')[0] == "
             f"'{TORCH_VERSION}' and deepspeed.__version__ == '{DS_VERSION}' else 1)")
    subprocess.run([str(py), "-c", check], check=True, timeout=300, env=ds_env(py, {}))
    stamp.touch()
    return py


def ds_env(py, extra):
    """The environment of DeepSpeed's processes: the CPU accelerator, the venv's ninja on PATH."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
               PATH=f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.update(extra)
    return env


def compile_ops(py, timeout):
    """JIT-compiles (or loads, when built before) the CPU ops DeepSpeed uses here; seconds taken."""
    code = ("from deepspeed.accelerator import get_accelerator as g\n"
            "for b in ('ShareMemCommBuilder', 'FusedAdamBuilder', 'CPUAdamBuilder'):\n"
            "    g().create_op_builder(b).load(verbose=False)\n")
    t0 = time.perf_counter()
    out = run_group([[str(py), "-c", code]], [ds_env(py, {"OMP_NUM_THREADS": "1"})], timeout)
    if out["error"]:
        sys.exit(f"compiling DeepSpeed's CPU ops failed:\n{out['error']}")
    return time.perf_counter() - t0


# ---- processes with a time limit ------------------------------------------------------------------

def run_group(cmds, envs, timeout, cwd=None):
    """Runs the commands together, each in its own session; the first to fail, or the time limit,
    ends the others (their whole process groups). Returns {"out": [stdout], "err": [stderr],
    "error": None or a message with the failing process's output}."""
    procs, files = [], []
    for cmd, env in zip(cmds, envs):
        o, e = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        files.append((o, e))
        procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=cwd,
                                      start_new_session=True))
    deadline = time.monotonic() + timeout
    error = None
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            error = f"process {failed[0]} exited with code {procs[failed[0]].returncode}"
            break
        if time.monotonic() > deadline:
            error = f"timed out after {timeout} s"
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    if error is None:
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            error = f"process {bad[0]} exited with code {procs[bad[0]].returncode}"
    outs, errs = [], []
    for o, e in files:
        o.seek(0)
        e.seek(0)
        outs.append(o.read().decode(errors="replace"))
        errs.append(e.read().decode(errors="replace"))
        o.close()
        e.close()
    if error:
        error += "".join(f"\n--- process {i} {cmd[0]}: stdout (last lines) ---\n{tail(outs[i])}"
                         f"\n--- stderr (last lines) ---\n{tail(errs[i])}"
                         for i, cmd in enumerate(cmds))
    return {"out": outs, "err": errs, "error": error}


def tail(text, n=25):
    return "\n".join(text.rstrip().splitlines()[-n:])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the two implementations ----------------------------------------------------------------------

def ds_config(stage, offload, a):
    """The ds_config both get: configs/ds_config.json's settings with the 2-rank batch triple,
    the stage and, for offload, offload_optimizer {"device": "cpu"} (and at stage 3 offload_param);
    DeepSpeed's defaults otherwise (stage 3: parameters of up to 1e5 elements stay whole); plain
    JSON."""
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": a.batch * a.ranks,
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": max(10, a.steps),
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_num_steps": 20, "warmup_type": "linear",
                                 "total_num_steps": a.steps, "warmup_min_ratio": 0.0,
                                 "cos_min_ratio": 0.1}},
        "zero_optimization": zero,
    }


def median_tps(rows, warmup, what):
    tps = [r for s, r in rows if s > warmup]
    if not tps:
        raise ValueError(f"{what}: no step after the {warmup} warm-up steps ({len(rows)} steps)")
    return statistics.median(tps)


def memrt(a, cfg):
    launcher = ROOT / a.build / "bin" / "launcher"
    for _ in range(5):  # another engineer's relink may leave it briefly missing
        if launcher.exists() and os.access(launcher, os.X_OK) and launcher.stat().st_size > 0:
            break
        log(f"{launcher} missing; waiting a minute")
        time.sleep(60)
    with tempfile.TemporaryDirectory() as out_dir:
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        r = run_group([[str(launcher), "--num_procs", str(a.ranks), "--master_port", "0",
                        "--deepspeed", str(cfg), str(ROOT / "configs/train.yaml"),
                        f"--max_steps={a.steps}", f"--output_dir={out_dir}",
                        "--logging_steps=1", "--save_strategy=no"]], [env], a.timeout, cwd=ROOT)
        if r["error"]:
            return {"error": r["error"]}
        out = Path(out_dir)
        try:
            rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            report = json.loads((out / "memory_report.json").read_text())
        except FileNotFoundError as e:
            return {"error": f"launcher wrote no {Path(e.filename).name}; its output:\n"
                             f"{tail(r['out'][0])}\n{tail(r['err'][0])}"}
    ranks = {x["rank"]: x["measured"]["resident"] for x in report["ranks"]}
    return {"tps": median_tps([(m["step"], m["tokens_per_s"]) for m in rows], a.warmup, "memrt"),
            "loss": [rows[0]["loss"], rows[-1]["loss"]],
            "peak": [ranks[i]["peak_bytes"] for i in sorted(ranks)],
            "idle": [ranks[i]["idle_bytes"] for i in sorted(ranks)],
            "warnings": sorted({l.split("] ", 1)[-1] for l in (r["out"][0] + r["err"][0]).splitlines()
                                if "warning" in l.lower() or "note" in l.lower()})}


def deepspeed(a, cfg, py):
    port = str(free_port())
    cmds, envs = [], []
    for rank in range(a.ranks):
        cmds.append([str(py), str(ROOT / "bench/deepspeed_gpt2.py"), "--config", str(cfg),
                     f"--steps={a.steps}", f"--batch={a.batch}"])
        envs.append(ds_env(py, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                "RANK": str(rank), "LOCAL_RANK": str(rank),
                                "WORLD_SIZE": str(a.ranks), "LOCAL_SIZE": str(a.ranks),
                                "OMP_NUM_THREADS": str(a.threads)}))
    r = run_group(cmds, envs, a.timeout, cwd=ROOT)
    if r["error"]:
        return {"error": r["error"]}
    lines = [json.loads(l) for out in r["out"] for l in out.splitlines() if l.startswith("{")]
    steps = [(l["step"], l["tokens"] / l["seconds"]) for l in lines if "step" in l]
    ranks = {l["rank"]: l for l in lines if "rank" in l}
    if sorted(ranks) != list(range(a.ranks)):
        return {"error": f"deepspeed ranks reported {sorted(ranks)}:\n" + "\n".join(r["out"])}
    losses = [l["loss"] for l in lines if "step" in l]
    return {"tps": median_tps(steps, a.warmup, "deepspeed"), "loss": [losses[0], losses[-1]],
            "peak": [ranks[i]["peak_rss_bytes"] for i in sorted(ranks)],
            "idle": [ranks[i]["idle_rss_bytes"] for i in sorted(ranks)],
            "optimizer": ranks[0]["optimizer"], "basic_optimizer": ranks[0]["basic_optimizer"],
            "zero_stage": ranks[0]["zero_stage"], "offload_seen": ranks[0]["offload_optimizer"]}


# ---- the bench ------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="micro batch per rank (train.yaml's)")
    ap.add_argument("--build", default="build")
    ap.add_argument("--stages", default=";".join(STAGES), help="a subset, separated by ';'")
    ap.add_argument("--impls", default=";".join(IMPLS), help="a subset, separated by ';'")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    a = ap.parse_args()
    stages = [s for s in STAGES if s in a.stages.split(";")]
    impls = [i for i in IMPLS if i in a.impls.split(";")]
    if a.steps <= a.warmup:
        sys.exit(f"--steps {a.steps} leaves nothing after --warmup {a.warmup}")

    py = None
    if "deepspeed" in impls:
        py = ds_venv()
        log(f"DeepSpeed's CPU ops ready in {compile_ops(py, 1800):.1f} s (compiled once, then "
            f"loaded from ~/.cache/torch_extensions)")

    load_start = os.getloadavg()
    runs = {(i, s): [] for i in impls for s in stages}
    errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfgs = {}
        for s in stages:
            cfgs[s] = Path(tmp) / f"ds_zero{s.replace('+', '_')}.json"
            cfgs[s].write_text(json.dumps(ds_config(*STAGES[s], a), indent=1))
        for rep in range(a.repeats):
            for s in stages:
                for impl in (impls if rep % 2 == 0 else impls[::-1]):
                    t0 = time.perf_counter()
                    r = memrt(a, cfgs[s]) if impl == "memrt" else deepspeed(a, cfgs[s], py)
                    if "error" in r:
                        errors.setdefault((impl, s), r["error"])
                        log(f"repeat {rep + 1}: {impl} stage {s}: FAILED")
                    else:
                        runs[impl, s].append(r)
                        log(f"repeat {rep + 1}: {impl} stage {s}: {r['tps']:.0f} tokens/s, peak RSS "
                            f"{[round(p / 1e6, 1) for p in r['peak']]} MB "
                            f"({time.perf_counter() - t0:.0f} s)")

    def med(impl, s):
        rs = runs[impl, s]
        if not rs:
            return None
        top = [max(range(len(r["peak"])), key=lambda k: r["peak"][k]) for r in rs]
        m = {"tps": statistics.median(r["tps"] for r in rs),
             "peak_max": int(statistics.median(max(r["peak"]) for r in rs)),
             "peak": [int(statistics.median(r["peak"][k] for r in rs)) for k in range(a.ranks)],
             "idle": int(statistics.median(r["idle"][k] for r, k in zip(rs, top))),
             "growth": int(statistics.median(r["peak"][k] - r["idle"][k] for r, k in zip(rs, top))),
             "runs": len(rs), "each_tps": [round(r["tps"]) for r in rs],
             "loss": [statistics.median(r["loss"][k] for r in rs) for k in (0, 1)]}
        for k in ("optimizer", "basic_optimizer"):
            if k in rs[0]:
                m[k] = rs[0][k]
        return m

    meds = {k: med(*k) for k in runs}
    model, flags = cpu()
    print(f"machine: {model} ({flags}), {os.cpu_count()} cores; {a.ranks} ranks x "
          f"OMP_NUM_THREADS={a.threads}; DeepSpeed {DS_VERSION}, torch {TORCH_VERSION} (CPU "
          f"accelerator, gloo); fp32, global batch {a.ranks} x {a.batch} x 128 tokens; {a.steps} "
          f"steps, tokens/s = median of steps > {a.warmup}; medians of {a.repeats} alternating "
          f"runs; bytes exact, MB = 10^6 bytes")
    print(f"load average (1 min) before the runs {load_start[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"(the runs themselves keep {a.ranks * a.threads} threads busy; more means another load)")
    print()
    print("| ZeRO stage | impl | tokens/s (global batch) | peak RSS, rank 0 / rank 1 ... | "
          "peak RSS, max rank | idle RSS (that rank) | growth (peak - idle) | loss, step 1 -> last |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for s in stages:
        for impl in impls:
            m = meds[impl, s]
            if m is None:
                print(f"| {s} | {impl} | failed | — | — | — | — | — |")
                continue
            print(f"| {s} | {impl} | {m['tps']:.0f} | "
                  f"{' / '.join(f'{p / 1e6:.3f} MB' for p in m['peak'])} | {fmt(m['peak_max'])} | "
                  f"{fmt(m['idle'])} | {fmt(m['growth'])} | {m['loss'][0]:.3f} -> {m['loss'][1]:.3f} |")
    if set(impls) == set(IMPLS):
        print()
        print("| ZeRO stage | memrt / DeepSpeed tokens/s | memrt / DeepSpeed peak RSS (max rank) | "
              "memrt / DeepSpeed growth |")
        print("|---|---:|---:|---:|")
        for s in stages:
            m, d = meds["memrt", s], meds["deepspeed", s]
            if m and d:
                print(f"| {s} | {ratio(m['tps'], d['tps'])} | {ratio(m['peak_max'], d['peak_max'])} "
                      f"| {ratio(m['growth'], d['growth'])} |")
            else:
                print(f"| {s} | — | — | — |")
    print()
    for s in stages:
        d = meds.get(("deepspeed", s))
        if d:
            print(f"DeepSpeed stage {s}: engine.optimizer {d['optimizer']}, basic optimizer "
                  f"{d['basic_optimizer']}")
    for k in runs:
        if meds[k]:
            print(f"{k[0]} stage {k[1]}, tokens/s of each run: {meds[k]['each_tps']}")
    for s in stages:
        for w in sorted({w for r in runs.get(("memrt", s), []) for w in r["warnings"]}):
            print(f"memrt stage {s} said: {w}")
    for (impl, s), e in errors.items():
        print(f"\n{impl} stage {s} FAILED: {e}")
    print()
    for s in stages:
        stage, offload = STAGES[s]
        for impl in impls:
            m = meds[impl, s]
            row = {"bench": "zero", "impl": impl, "stage": stage, "offload": offload,
                   "tokens_per_s": None if m is None else round(m["tps"], 1),
                   "peak_rss_bytes_max_rank": None if m is None else m["peak_max"],
                   "peak_rss_bytes_per_rank": None if m is None else m["peak"],
                   "idle_rss_bytes": None if m is None else m["idle"],
                   "rss_growth_bytes": None if m is None else m["growth"],
                   "runs": 0 if m is None else m["runs"]}
            if m and "optimizer" in m:
                row["optimizer"] = m["optimizer"]
            if (impl, s) in errors:
                row["error"] = errors[impl, s].splitlines()[0]
            print(json.dumps(row))
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
