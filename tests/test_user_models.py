"""Models users bring that the split used to reject: each class reproduced by a small model, split, and
checked against eager autograd (loss, every gradient, updated buffers) stage graph by stage graph
(test_split.check_against_eager), and for the first classes also as a threaded pipeline step."""

from __future__ import annotations

import copy

import pytest
import torch

import models
from test_split import check_against_eager
from threaded import max_grad_error, param_holders, run_threaded
from zbcompile.api import model_stage_placement
from zbcompile.errors import PartitionError
from zbcompile.passes.schedules import generate
from zbcompile.passes.trace import trace
from zbcompile.split import split_model

torch.set_num_threads(1)


def threaded_step_matches_eager(case, schedule: str, pp: int, *, split_points=None) -> None:
    """One pipelined step over 2*pp microbatches (ranks as threads) against eager on the whole batch: losses
    and every gradient within 1e-5 relative."""
    sched = generate(schedule, pp, 2 * pp)
    inputs, targets = [(x,) if isinstance(x, torch.Tensor) else tuple(x) for x in case.example]
    staged = split_model(case.model, case.loss_fn, (inputs, targets), num_stages=sched.num_model_stages,
                         split_points=split_points, placement=model_stage_placement(sched))
    batch = tuple(x.repeat(2 * pp, *([1] * (x.dim() - 1))) for x in inputs + targets)
    ref = copy.deepcopy(case.model)
    n = len(inputs)
    loss = case.loss_fn(ref(*batch[:n]), *batch[n:])
    loss.backward()
    losses, ranks, _ = run_threaded(case.model, staged, sched, batch)
    assert all(abs(v - loss.item()) <= 1e-5 * abs(loss.item()) for v in losses), (losses, loss.item())
    holders = param_holders(sched, staged)
    err, where = max_grad_error(ref, ranks, [[f for f, rs in holders.items() if r in rs] for r in range(pp)])
    assert err <= 1e-5, where


# (1) blocks in an nn.ModuleDict: the repeated units come from the traced graph, whatever holds them

def test_module_dict_blocks_are_the_cuttable_units():
    case = models.dict_lm(layers=6)
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=4)
    points = staged.meta["split_points"]
    assert len(points) == 3 and all(p.startswith("layers.") for p in points), points
    check_against_eager(staged, case)


def test_module_dict_model_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.dict_lm(layers=4), "1f1b", 4)


# (2) split points users already wrote: pipe_split() markers, torch's split_spec of SplitPoints

def test_pipe_split_markers_are_the_automatic_split_points():
    case = models.marked_mlp(marks=(0, 2))
    staged = split_model(case.model, case.loss_fn, case.example)
    assert staged.meta["split_points"] == ("pipe_split:0", "pipe_split:1")
    assert [st.modules for st in staged.stages] == [("inp",), ("mid", "deep"), ("out",)]
    check_against_eager(staged, case)


def test_pipe_split_model_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.marked_mlp(marks=(1,)), "1f1b", 2)


def test_split_spec_of_split_points_cuts_like_the_markers():
    from torch.distributed.pipelining import SplitPoint

    case = models.marked_mlp(marks=())
    spec = {"out": SplitPoint.BEGINNING, "inp": SplitPoint.END}   # any order, as torch's pipeline() takes it
    staged = split_model(case.model, case.loss_fn, case.example, split_points=spec)
    assert staged.meta["split_points"] == ("after:inp", "out")
    assert [st.modules for st in staged.stages] == [("inp",), ("mid", "deep"), ("out",)]
    check_against_eager(staged, case)


def test_explicit_split_points_win_over_markers():
    case = models.marked_mlp(marks=(0, 2))
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["out"])
    assert [st.modules for st in staged.stages] == [("inp", "mid", "deep"), ("out",)]
    check_against_eager(staged, case)


def test_markers_disagreeing_with_the_stage_count_say_so():
    case = models.marked_mlp(marks=(0, 2))
    with pytest.raises(PartitionError, match=r"calls pipe_split\(\) 2 times \(3 stages\) but 2 stages"):
        split_model(case.model, case.loss_fn, case.example, num_stages=2)
