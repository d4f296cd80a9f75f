"""CUDA-graph execution on a real GPU (marked gpu; skipped where torch sees no CUDA device, never faked).

One rank on one GPU (pg=None): a one-stage program (pp=1) and a two-stage program (both stages on the rank, the
hand-over local), each trained 6 steps with torch.cuda's capture API (2 eager warm-up steps, capture, replays)
next to the same program run eagerly: losses and gradients equal step for step. Plus: the captured step's
timings come from device events; parameters moved after capture are refused; the null model's benchmark
trains alike with and without graphs (its host time per action is benchmarks/bench_cuda_graphs.py's to measure,
not asserted here). With 2+ GPUs, pp=2 over NCCL through zb.compile(cuda_graphs=True)
(tests/gpu/graphs_gpu_worker.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from support.models import gpt  # noqa: E402
from support.one_rank import one_rank_runtime, train_one_rank  # noqa: E402
from zbcompile.errors import CaptureError  # noqa: E402
from zbcompile.runtime.graphs import CaptureAPI  # noqa: E402

STEPS, M = 6, 4
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class CountingAPI(CaptureAPI):
    def __init__(self, device):
        super().__init__(device)
        self.captures = self.replays = 0

    def capture(self, fn, *, pool, stream):
        self.captures += 1
        return super().capture(fn, pool=pool, stream=stream)

    def replay(self, graph):
        self.replays += 1
        super().replay(graph)


def _runtime(stages: int, graphs: bool, api=None):
    # both ways run the program lowered for capture
    return one_rank_runtime(gpt(layers=4, batch=2 * M, device="cuda"), stages, M, graphs=graphs, graph_api=api)


def _train(rt, model, x, y):
    return train_one_rank(rt, model, x, y, STEPS)


@pytest.mark.parametrize("stages", [1, 2])
def test_captured_step_equals_eager_on_the_gpu(stages):
    api = []
    rt, model, x, y = _runtime(stages, True, lambda d: api.append(CountingAPI(d)) or api[0])
    got = _train(rt, model, x, y)
    ref = _train(*_runtime(stages, False))
    assert api[0].captures == 1 and api[0].replays == STEPS - 2
    for k in range(STEPS):
        assert abs(got[0][k] - ref[0][k]) <= 1e-5 * abs(ref[0][k]), (k, got[0][k], ref[0][k])
        assert got[1][k].keys() == ref[1][k].keys(), (k, set(got[1][k]) ^ set(ref[1][k]))   # one rank holds all
        for n, g in ref[1][k].items():
            torch.testing.assert_close(got[1][k][n], g, rtol=1e-5, atol=1e-6)
    timings = rt.last_step   # from the replayed events
    assert all(s <= e for row in timings.actions for _, s, e in row) and timings.span > 0


def test_a_parameter_moved_after_capture_is_refused_on_the_gpu():
    rt, model, x, y = _runtime(1, True)
    for _ in range(3):
        rt.step_batch((x, y))
    w = next(model.parameters())
    w.data = w.data.clone()
    with pytest.raises(CaptureError, match="moved since the step was captured"):
        rt.step_batch((x, y))


def test_the_null_model_benchmark_trains_alike_with_and_without_graphs(monkeypatch):
    """The benchmark's null model (next to no device work) run eagerly and with CUDA graphs: the same loss. The
    host time per action is printed, not asserted: how much graphs save is the benchmark's to measure
    (benchmarks/bench_cuda_graphs.py), a timing has no place among the tests' pass / fail checks."""
    monkeypatch.syspath_prepend(BENCHMARKS)   # the benchmark scripts import their siblings (_harness)
    from bench_cuda_graphs import run

    cfg = {"model": "null", "d": 4, "layers": 8, "heads": 4, "seq": 1, "vocab": 16, "mbs": 2, "n_mb": 8,
           "seed": 0, "warmup": 4, "steps": 10}
    device = torch.device("cuda", torch.cuda.current_device())
    eager, graph = run(cfg, 2, False, device), run(cfg, 2, True, device)
    print(f"null model, 2 stages: {eager['us_per_action']:.1f} us/action eager, "
          f"{graph['us_per_action']:.1f} with CUDA graphs")
    assert abs(eager["loss"] - graph["loss"]) <= 1e-4 * abs(eager["loss"])


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_over_nccl_captured_equals_eager(tmp_path):
    from support.launch import launch
    from support.threaded import assert_graded_where_eager_is

    results = launch(os.path.join(os.path.dirname(__file__), "graphs_gpu_worker.py"), 2, tmp_path)
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res["loss_err"] < 1e-5 and res["grad_err"] < 1e-5, (rank, res)
    for k, eager in enumerate(results[0]["eager_graded"]):   # each step, a gradient exactly where eager has one
        assert_graded_where_eager_is(eager, results[0]["holders"], [res["graded"][k] for res in results],
                                     f"step {k}: ")
