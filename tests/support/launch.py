"""Launch a worker script as the ranks of one pipeline (the torchrun environment, gloo on 127.0.0.1, one
thread per rank) and read what each rank wrote to `<out>/rank<r>.json`. Shared by the multi-process tests."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: str, pp: int, out, *args: str, timeout: float = 600) -> list[dict]:
    """Run `worker --out OUT *args` as ranks 0..pp-1; returns each rank's JSON. A rank that wrote nothing fails
    the test with the end of its output."""
    port = free_port()
    procs = []
    for r in range(pp):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(pp), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, worker, "--out", str(out), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    results = []
    for r in range(pp):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results:\n{logs[r][-3000:]}"
        results.append(json.loads(path.read_text()))
    return results


def worker_main(run) -> None:
    """A worker's entry point, the other end of `launch`: `run(rank, pp, out)` under the torchrun environment,
    its results written as `<out>/rank<r>.json`; the process then ends without tearing down process groups."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    rank, pp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = run(rank, pp, out)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    os._exit(0)


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
