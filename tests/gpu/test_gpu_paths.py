"""The device-only paths of a captured step on a real GPU (marked gpu; skipped without CUDA, never faked).

Each test trains the same one-rank program (every stage on this rank, pg=None: a pipeline across ranks needs one
GPU per rank) two ways and compares step for step:
- dropout: CUDA graph replays against eager steps from the same seed. The CPU stand-in draws its masks in host
  code; on a GPU they come from the device generator, which capture must register so that every replay draws
  new masks (a frozen mask would train a different model, silently);
- activation offload: the copy stream forked from and rejoined to the capture stream, the pinned host pool;
- inductor's Triton stage graphs, eager and captured, against the aten stage graphs;
- a bfloat16 model captured against the same model eager.
And two ranks as threads on the one GPU: vocabulary parallelism's collectives on device tensors against eager.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from support.models import eager_accumulated, gpt  # noqa: E402
from support.one_rank import one_rank_runtime, train_one_rank  # noqa: E402
from support.threaded import run_threaded, vocab_rank_grads  # noqa: E402
from zbcompile.compiler import split_for  # noqa: E402
from zbcompile.passes.lower import OffloadChoice  # noqa: E402
from zbcompile.passes.schedules import generate  # noqa: E402

STEPS, M = 6, 4


def _both(case, stages, got: dict, ref: dict, *, graphs: bool):
    """Training with one_rank_runtime's keyword arguments `got` (captured where `graphs`) and `ref` (eager)."""
    a = train_one_rank(*one_rank_runtime(case, stages, M, graphs=graphs, **got), STEPS)
    b = train_one_rank(*one_rank_runtime(case, stages, M, graphs=False, **ref), STEPS)
    return a, b


def _assert_same_training(got, ref, rtol: float, atol: float):
    for k in range(STEPS):
        assert abs(got[0][k] - ref[0][k]) <= rtol * abs(ref[0][k]) + atol, (k, got[0], ref[0])
        assert got[1][k].keys() == ref[1][k].keys(), (k, set(got[1][k]) ^ set(ref[1][k]))
        for n, g in ref[1][k].items():
            torch.testing.assert_close(got[1][k][n], g, rtol=rtol, atol=atol, msg=lambda m: f"step {k}, {n}: {m}")


@pytest.mark.parametrize("stages", [1, 2])
def test_dropout_replays_draw_what_eager_steps_draw(stages):
    case = gpt(layers=4, dropout=0.2, batch=2 * M, device="cuda")
    got, ref = _both(case, stages, {}, {}, graphs=True)
    _assert_same_training(got, ref, 1e-5, 1e-6)
    # and the masks do change between replays: the same batch twice gives two losses
    rt, model, x, y = one_rank_runtime(case, stages, M, graphs=True)
    losses = [rt.step_batch((x, y)) for _ in range(5)]   # 2 eager, capture, 2 replays; no optimizer step
    assert losses[3] != losses[4], losses


def test_offload_under_capture_equals_eager_offload_and_no_offload():
    case = gpt(layers=4, batch=2 * M, device="cuda")
    got, ref = _both(case, 2, {"offload": OffloadChoice(prefetch=1, min_bytes=0)}, {}, graphs=True)
    _assert_same_training(got, ref, 1e-5, 1e-6)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
def test_triton_stage_graphs_train_like_the_aten_graphs(graphs):
    case = gpt(layers=2, batch=2 * M, device="cuda")
    got, ref = _both(case, 2, {"backend": "inductor"}, {}, graphs=graphs)
    _assert_same_training(got, ref, 1e-4, 1e-5)   # Triton's reductions add in another order


def test_a_bfloat16_model_captured_trains_like_eager():
    case = gpt(layers=2, batch=2 * M, device="cuda")
    case.model.to(torch.bfloat16)
    got, ref = _both(case, 2, {}, {}, graphs=True)
    assert all(g.dtype == torch.bfloat16 for g in got[1][0].values())
    _assert_same_training(got, ref, 0.0, 0.0)   # the same kernels in the same order: bitwise


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_vocabulary_collectives_on_cuda_tensors_give_eagers_gradients(schedule):
    """Two ranks as threads on the one GPU (loopback messages; NCCL between them needs two GPUs): the vocabulary
    shards' all-gathers, reductions and broadcasts on device tensors give eager's loss, and each rank's rows of
    the tied embedding / head the rows of eager's gradient."""
    case = gpt(layers=2, batch=M, device="cuda")
    sched = generate(schedule, 2, M, vocab=True)
    x, y = (t.cuda() for t in case.example)
    staged = split_for(case.model, case.loss_fn, (x[:1], y[:1]), sched)   # one microbatch
    ref = copy.deepcopy(case.model)
    want = eager_accumulated(ref, case.loss_fn, x, y, M)
    losses, ranks, _ = run_threaded(case.model, staged, sched, (x, y), device="cuda")
    assert all(abs(v - want) <= 1e-5 * abs(want) for v in losses), (losses, want)
    for r, name, p, g in vocab_rank_grads(ranks, staged, sched, ref):
        assert p.grad is not None and p.grad.is_cuda, (r, name)
        torch.testing.assert_close(p.grad[:g.shape[0]], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{r} {name}: {m}")
