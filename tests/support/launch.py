"""Launch a worker script as the ranks of one pipeline (the torchrun environment, gloo on 127.0.0.1, one
process per rank) and read what each rank wrote to `<out>/rank<r>.json`. Shared by the multi-process tests.

Every rank starts in a process group of its own (a new session), with `tests/` on its PYTHONPATH so that a
worker imports the same helpers as the tests (`from support.models import gpt`). Its stdout and stderr go to
`<out>/rank<r>.log` (a file, never a pipe nobody reads). As soon as one rank exits with an error, or the
launch runs past its timeout, every rank's whole process group is killed: no rank outlives its launch. Ranks
are forked from the test process's warm interpreter (support/forked.py), which imported torch and zbcompile
once, rather than started cold (ZB_TEST_COLD_RANKS=1); `run_python` runs a CLI the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from support import forked

TESTS = Path(__file__).resolve().parents[1]   # the folder holding `support`: the children's PYTHONPATH
POLL = 0.1   # seconds between looks at the ranks
PORT_TAKEN = "EADDRINUSE"   # in the error of a TCPStore that cannot listen on its port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """os.environ with `tests/` first on PYTHONPATH (the helpers' package `support`), the session's split
    directory (support/split_memo.py: the child shares this process's splits), plus `extra`."""
    from support import split_memo

    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *([path] if path else [])]), **extra)
    env.pop(split_memo.DIRECTORY, None)
    if split_memo.shared_directory():
        env[split_memo.DIRECTORY] = split_memo.shared_directory()
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (it and whatever it started), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - chars))
            return fh.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"


def launch(worker: str, pp: int, out, *args: str, timeout: float = 1200) -> list[dict]:
    """Run `worker --out OUT *args` as ranks 0..pp-1; returns each rank's JSON. A rank that wrote nothing fails
    the test with the end of its output. The first rank to exit with an error, or the timeout (seconds, for the
    whole launch), ends every rank. A launch whose master port was taken between `free_port` and rank 0's
    listen (another launch running beside it, under pytest -n) is run again on a new port, at most twice."""
    out = Path(out)
    for attempt in range(3):
        procs, logs, failed, timed_out = _run_ranks(worker, pp, out, args, timeout)
        if failed is None or attempt == 2 or not any(_port_taken(log) for log in logs):
            break
        for r in range(pp):   # the attempt's files, so that the next one's are read, never these
            (out / f"rank{r}.json").unlink(missing_ok=True)
    codes = ", ".join(f"rank {r}: {p.returncode}" for r, p in enumerate(procs))
    if timed_out:
        pytest.fail(f"{worker}: the launch ran past {timeout} s; every rank killed (exit codes {codes})\n"
                    + "\n".join(f"---- rank {r}:\n{_tail(logs[r])}" for r in range(pp)), pytrace=False)
    first = "" if failed is None else f"rank {failed} failed first (exit codes {codes}):\n{_tail(logs[failed])}\n"
    results = []
    for r in range(pp):
        path = out / f"rank{r}.json"
        assert path.exists(), f"{first}rank {r} wrote no results:\n{_tail(logs[r])}"
        try:
            results.append(json.loads(path.read_text()))
        except ValueError as e:
            raise AssertionError(f"{first}rank {r} wrote no whole results ({e}):\n{_tail(logs[r])}") from None
    return results


def _run_ranks(worker: str, pp: int, out: Path, args, timeout: float):
    """One attempt of `launch`: (the rank processes, their log files, the first rank that failed or None, whether
    the launch ran past `timeout`); every rank's process group is killed before it returns."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [out / f"rank{r}.log" for r in range(pp)]
    failed, timed_out = None, False
    try:
        for r in range(pp):
            env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                            WORLD_SIZE=str(pp), OMP_NUM_THREADS="1")
            procs.append(_start_rank([str(worker), "--out", str(out), *args], env, logs[r]))
        deadline = time.monotonic() + timeout
        while True:
            running = [p.poll() is None for p in procs]
            failed = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
            if failed is not None or not any(running):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(POLL)
    finally:
        for p in procs:   # the ranks still running, and whatever any rank started
            _kill_group(p)
    return procs, logs, failed, timed_out


def _start_rank(argv: list[str], env: dict[str, str], log: Path):
    """`python *argv` as one rank, in a session of its own, output into `log`: forked from the test process's
    warm interpreter (support/forked.py: no 3.5 s of imports per rank), or started cold with ZB_TEST_COLD_RANKS=1."""
    rank = forked.start(argv, env, log)
    if rank is not None:
        return rank
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, *argv], env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _port_taken(log: Path) -> bool:
    """Did this rank's TCPStore fail to listen on the master port (EADDRINUSE)?"""
    return PORT_TAKEN in _tail(log, 20000)


def run_command(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd=None) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)` for a command that
    starts processes of its own (torchrun and its ranks): it runs in a process group of its own, its output goes
    to files, and on timeout the whole group is killed before subprocess.TimeoutExpired is raised."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc)   # whatever it left behind in its group
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, _text(stdout.read()), _text(stderr.read()))


def run_python(args: list[str], *, timeout: float, cwd=None, **extra: str) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, env=child_env(**extra), ...)` with
    OMP_NUM_THREADS=1 unless `extra` says otherwise, forked from the test process's warm interpreter
    (support/forked.py): `-m MODULE ARGS` or `SCRIPT ARGS` run as a fresh interpreter runs them, less what only a
    cold start shows (a warning printed at import is not in its stderr); cold with ZB_TEST_COLD_RANKS=1. On
    timeout its process group is killed and subprocess.TimeoutExpired raised."""
    cmd, env = [sys.executable, *args], child_env(**{"OMP_NUM_THREADS": "1", **extra})
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = forked.start(list(args), env, out, stderr=err, cwd=cwd)
        if proc is None:
            return run_command(cmd, timeout=timeout, env=env, cwd=cwd)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        with open(out, "rb") as o, open(err, "rb") as e:
            return subprocess.CompletedProcess(cmd, proc.returncode, _text(o.read()), _text(e.read()))


def torchrun(args, *, nproc: int = 2, timeout: float, env: dict[str, str] | None = None,
             cwd=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC --master-addr 127.0.0.1 --master-port <a free port> *args` through
    `run_command`. A run whose master port was taken before torchrun listened on it (another launch beside it,
    under pytest -n) fails at start-up, before any rank did anything, and is run again on a new port, twice at
    most."""
    for _ in range(3):
        out = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args],
                          timeout=timeout, env=env, cwd=cwd)
        if out.returncode == 0 or PORT_TAKEN not in out.stdout + out.stderr:
            return out
    return out


def _text(data: bytes) -> str:
    """Bytes as subprocess.run(text=True) gives them: decoded, universal newlines."""
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def run_cases(cases) -> dict:
    """A worker's cases ({tag: no-argument callable}) run in order: each one's result, or its traceback as
    {"error": ...}, so that one failing case neither hides the others nor leaves the launch's peers waiting."""
    import traceback

    results = {}
    for tag, case in cases.items():
        try:
            results[tag] = case()
        except Exception:
            results[tag] = dict(error=traceback.format_exc())
    return results


def worker_main(run) -> None:
    """A worker's entry point, the other end of `launch`: `run(rank, pp, out)` under the torchrun environment,
    its results written as `<out>/rank<r>.json`; the process then ends without tearing down process groups."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    rank, pp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    write_results(out, rank, run(rank, pp, out))
    os._exit(0)


def write_results(out, rank: int, results: dict) -> None:
    """`<out>/rank<r>.json`, written whole or not at all: `launch` kills every rank once one fails, and a rank
    killed in the middle of its dump must not leave half a file (read as "wrote no whole results", not as the
    "no results" of a rank that never got there)."""
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".part", "w") as fh:
        json.dump(results, fh, indent=1)
    os.replace(path + ".part", path)


class Launches:
    """A module's launches of `worker`, one per pipeline size, shared by its fixtures (processes start in
    seconds and each launch runs many cases). `args(pp)` gives the worker's arguments besides --out."""

    def __init__(self, worker: str, args=lambda pp: ()):
        self.worker, self.args, self.done = worker, args, {}

    def __call__(self, pp: int, tmp_path_factory) -> tuple[int, list[dict]]:
        if pp not in self.done:
            out = tmp_path_factory.mktemp(f"{os.path.basename(self.worker).removesuffix('.py')}_pp{pp}")
            self.done[pp] = pp, launch(self.worker, pp, out, *self.args(pp))
        return self.done[pp]


def pipeline_fixtures(launches: Launches):
    """The module-scoped fixtures of a multi-process test module: `run` (pp=2, then pp=4) and `run_pp2` (the
    pp=2 launch alone, for what runs only there); assign them to module names: `run, run_pp2 = ...`."""
    @pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
    def run(request, tmp_path_factory):
        return launches(request.param, tmp_path_factory)

    @pytest.fixture(scope="module")
    def run_pp2(tmp_path_factory):
        return launches(2, tmp_path_factory)

    return run, run_pp2
