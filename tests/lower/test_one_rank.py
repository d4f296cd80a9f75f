"""The one-rank schedule (passes.schedules.one_rank: every stage on one rank, F's then B's per microbatch, the
W's last), as the GPU tests run it (support.one_rank) but on the CPU: 1 to 3 stages, with and without offload,
train as eager microbatch accumulation does (float64 losses and every gradient, 3 SGD steps); bad sizes are
refused."""

from __future__ import annotations

import copy

import pytest
import torch

from support.models import eager_accumulated, gpt, train_sgd
from support.one_rank import one_rank_runtime, train_one_rank
from zbcompile.errors import ScheduleError
from zbcompile.passes.lower import OffloadChoice
from zbcompile.passes.schedules import one_rank

torch.set_num_threads(1)
M, STEPS = 4, 3


def test_the_schedule_runs_each_microbatch_through_every_stage_and_the_ws_last():
    sched = one_rank(2, 2)
    assert sched.num_ranks == 1 and sched.num_model_stages == 2
    assert " ".join(map(str, sched.ranks[0])) == "0F0 1F0 1B0 0B0 0F1 1F1 1B1 0B1 1W0 0W0 1W1 0W1"


@pytest.mark.parametrize("stages,microbatches", [(0, 2), (2, 0)])
def test_bad_sizes_are_refused(stages, microbatches):
    with pytest.raises(ScheduleError, match="one_rank"):
        one_rank(stages, microbatches)


@pytest.mark.parametrize("stages,offload", [(1, False), (3, False), (2, True)])
def test_trains_as_eager_accumulation(stages, offload):
    case = gpt(layers=4, batch=2 * M)
    case.model.double()
    kw = {"offload": OffloadChoice(prefetch=1, min_bytes=0)} if offload else {}
    rt, model, x, y = one_rank_runtime(case, stages, M, graphs=False, device=torch.device("cpu"), **kw)
    got = train_one_rank(rt, model, x, y, STEPS)
    ref = copy.deepcopy(case.model)
    torch.manual_seed(1)   # train_one_rank's batches: rolled copies of the example
    batches = [(torch.roll(x, k, dims=1).contiguous(), y) for k in range(STEPS)]
    want = train_sgd(ref, lambda xb, yb: eager_accumulated(ref, case.loss_fn, xb, yb, M), batches)
    for k in range(STEPS):
        assert abs(got[0][k] - want[0][k]) <= 1e-12 * abs(want[0][k]), (k, got[0], want[0])
        assert got[1][k].keys() == want[1][k].keys()
        for n, g in want[1][k].items():
            torch.testing.assert_close(got[1][k][n], g, rtol=1e-10, atol=1e-13, msg=lambda m: f"step {k}, {n}: {m}")
