"""What every benchmark shares: ranks in fresh processes, free ports, medians, the measuring loop a rank runs,
and the JSON record of a run.

A script imports this module and the library, nothing else of benchmarks/ (running `python benchmarks/X.py`
puts this folder on sys.path). The pipeline benchmarks' model, workers and driver (bench_pp.py, bench_vocab.py,
bench_offload.py, bench_inductor.py, bench_cuda_graphs.py) are part of the harness too, in `_bench_models.py`,
`_bench_workers.py`, `_bench_overhead.py` and `_bench_runner.py`; their public names are importable from here
(`from _harness import Runner, ours_worker`), loaded on first use.

Results: `write_results(script, data, path)` writes `data` with the commit (`git rev-parse HEAD`, or "unknown"),
the machine and the torch version to `path`, or by default to `benchmarks/results/<script>-<short commit>.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

# torch is imported where it is used: schedule_table.py and schedule_speed.py, like `zbcompile plan`, run without it.

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


# ---- numbers ----------------------------------------------------------------------------------------------
def med(xs) -> float:
    """The median, NaN for no data (a config that failed)."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


# ---- processes --------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args, nprocs: int, timeout: float) -> str | None:
    """Run fn(rank, *args) in nprocs spawned processes; returns an error string on timeout / crash."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    t_end = time.time() + timeout
    try:
        while not ctx.join(timeout=max(0.5, min(5.0, t_end - time.time()))):
            if time.time() > t_end:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                return f"timed out after {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001  (a rank died)
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


def proc(fn, args, timeout: float, env: dict | None = None) -> str | None:
    """Run fn(*args) in one spawned process with `env` overrides (OMP_NUM_THREADS must be set before start)."""
    import torch.multiprocessing as mp

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        p = mp.get_context("spawn").Process(target=fn, args=args)
        p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        return f"timed out after {timeout:.0f} s"
    return None if p.exitcode == 0 else f"exit code {p.exitcode}"


def load(path: str) -> dict | None:
    """A worker's record, None if it wrote none."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# ---- inside a rank ----------------------------------------------------------------------------------------
def init_pg(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    """gloo on 127.0.0.1:port."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def agree(flag: bool) -> bool:
    """Rank 0 decides (so every rank runs the same number of steps)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.broadcast(t, src=0)
    return bool(t.item())


def write_record(outdir: str, name: str, obj: dict) -> None:
    """A worker's record, written whole or not at all (the driver reads it with `load`)."""
    tmp = os.path.join(outdir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(outdir, name))


def finish(outdir: str, name: str, obj: dict) -> None:
    """A distributed worker's last act: write its record, then leave the process group (errors ignored)."""
    import torch.distributed as dist

    write_record(outdir, name, obj)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def rss_mib(key: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its peak since the last reset (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def grad_clearer(params: list):
    """The `zero` callable the measuring loops call between steps: set_to_none on exactly `params`."""
    def zero():
        for p in params:
            p.grad = None
    return zero


def measure_loop(cfg: dict, step_fn, zero_fn, distributed: bool, after_fn=None) -> dict:
    """Warm up for >= cfg['warmup'] steps AND >= cfg['warmup_s'] seconds, then measure up to cfg['steps']
    steps (at most cfg['max_measure_s'] s, at least 3). Returns step times, the first step's result and RSS."""
    import torch.distributed as dist

    rec: dict = dict(step_s=[], cpu_s=[], extra=[])
    it, measured, measuring = 0, 0, False
    t_start = t_meas = time.perf_counter()
    while True:
        zero_fn()
        if distributed:
            dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        out = step_fn()
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        if it == 0:
            rec["first"] = out
            rec["first_step_s"] = dt
            if after_fn is not None:
                after_fn(rec)
        if measuring:
            rec["step_s"].append(dt)
            rec["cpu_s"].append(cpu)
            rec["extra"].append(out)
            measured += 1
            more = measured < cfg["steps"] and (time.perf_counter() - t_meas < cfg["max_measure_s"] or measured < 3)
            if not (agree(more) if distributed else more):
                break
        else:
            done = it + 1 >= cfg["warmup"] and time.perf_counter() - t_start >= cfg["warmup_s"]
            if agree(done) if distributed else done:
                measuring = True
                rec["warmup_steps"] = it + 1
                rec["rss_before_measure_mib"] = rss_mib()
                reset_peak_rss()
                t_meas = time.perf_counter()
        it += 1
    rec["peak_rss_mib"] = rss_mib("VmHWM")
    return rec


# ---- the record of a run ----------------------------------------------------------------------------------
def commit() -> str:
    """The checked-out commit, "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def dirty() -> bool | None:
    """Whether the library differs from the commit (a run on uncommitted code); None outside git."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "zbcompile", "passes", "benchmarks"],
                             cwd=HERE.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def machine() -> dict:
    import torch

    info = dict(host=platform.node(), system=platform.platform(), cpu=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), python=sys.version.split()[0], torch=torch.__version__)
    with contextlib.suppress(OSError):
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name"))
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _plain(obj):
    """json.dump's fallback: dataclasses as dicts, anything else (dtypes, devices, paths) as its text."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)


def write_results(script: str, data: dict, path: str | None = None, *, default: bool = True) -> Path | None:
    """Write `data` with the run's provenance (commit, machine, torch, argv, time) to `path`, or, without one,
    to benchmarks/results/<script>-<short commit>.json; with neither a path nor `default` (a script's main()
    called from Python with an argv of its own), nothing. Returns the path written."""
    import torch

    if path is None and not default:
        return None
    sha = commit()
    record = dict(script=script, commit=sha, dirty=dirty(), machine=machine(), torch=torch.__version__,
                  argv=sys.argv[1:], finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    record.update(data)   # a script's own report may repeat some of these (bench_pp's torch, argv)
    out = Path(path) if path is not None else RESULTS / f"{script}-{sha[:7] if sha != 'unknown' else sha}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=_plain) + "\n")
    print(f"wrote {out}", flush=True)
    return out


# ---- the pipeline benchmarks' pieces, loaded on first use ---------------------------------------------------
_PARTS = {
    "_bench_models": ("build_model", "make_batch", "partition", "stage_to_rank", "describe", "split_points",
                      "unit_names", "TorchStage", "NullNet"),
    "_bench_workers": ("TORCH_SCHEDULES", "OUR_SCHEDULES", "single_worker", "probe_worker", "torch_worker",
                       "ours_worker", "build_torch", "build_ours", "our_action_counts", "torch_action_counts"),
    "_bench_overhead": ("overhead_worker",),
    "_bench_runner": ("Runner",),
}
_WHERE = {name: module for module, names in _PARTS.items() for name in names}


def __getattr__(name: str):
    if name in _WHERE:   # imported here on first use: those modules import this one's helpers
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["med", "free_port", "spawn", "proc", "load", "init_pg", "agree", "write_record", "finish", "rss_mib",
           "reset_peak_rss", "grad_clearer", "measure_loop", "commit", "machine", "write_results", *_WHERE]
