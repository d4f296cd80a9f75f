"""The automatic split cuts between ops where modules are too few for the stages a schedule needs: a model of
three Linears, a few ops in one forward, a CNN whose layers sit in one Sequential; each split's stages run equal
to eager (the reference runner), and the programs train equal to eager under zbv at 4 and 8 model stages. A
`node:<op>` split point cuts before that op; a name the trace does not have is refused with close names."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from support.loops import CUT_CASES, three_linears
from support.reference import check_against_eager
from support.models import Case, eager_accumulated
from support.threaded import run_threaded, threaded_step_matches_eager
from zbcompile.errors import PartitionError
from zbcompile.passes.schedules import generate
from zbcompile.split import report, split_model

CASES = CUT_CASES


@pytest.mark.parametrize("stages", [4, 5])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuts_between_ops_match_eager(name, stages):
    case = CASES[name]()
    x, y = case.example
    staged = split_model(case.model, case.loss_fn, ((x[:2],), (y[:2],)), num_stages=stages)
    assert len(staged.stages) == stages
    assert all(any(n.op == "call_function" for n in st.f.gm.graph.nodes) for st in staged.stages)
    check_against_eager(staged, case._replace(example=((x[:2],), (y[:2],))))
    cuts = staged.meta["cuts"]
    assert len(cuts["points"]) == stages - 1 and cuts["why"], cuts
    if name != "cnn_sequential":   # fewer modules than stages: some cut falls between ops, and says so
        assert any(p.startswith("node:") for p in cuts["points"]) and "between ops" in cuts["why"]
        assert "between ops" in report(staged)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", ["three_linears", "few_ops"])
def test_cut_between_ops_trains_equal_to_eager_under_zbv(name, pp):
    case = CASES[name]()
    if pp == 4 and name == "three_linears":   # 5 ops a cut can go before, 8 stages: refused instead
        with pytest.raises(PartitionError, match="only 5 ops"):
            split_model(case.model, case.loss_fn, case.example, num_stages=8)
        return
    m = 4
    x, y = case.example
    schedule = generate("zbv", pp, m)
    staged = split_model(case.model, case.loss_fn, ((x[:2],), (y[:2],)), num_stages=schedule.num_model_stages,
                         placement=schedule.stage_groups())
    losses, models, _ = run_threaded(case.model, staged, schedule, (x, y))
    ref = copy.deepcopy(case.model)
    want = eager_accumulated(ref, case.loss_fn, x, y, m)
    assert all(abs(loss - want) <= 1e-5 * abs(want) for loss in losses)
    refp = dict(ref.named_parameters())
    for mdl in models:
        for n, p in mdl.named_parameters():
            if p.grad is not None:
                assert (p.grad - refp[n].grad).abs().max() <= 1e-5 * refp[n].grad.abs().max(), n


def test_node_split_points_cut_before_that_op():
    case = three_linears()
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["node:tanh", "b"])
    assert [st.modules for st in staged.stages] == [("a",), (), ("b", "c")]
    check_against_eager(staged, case)
    with pytest.raises(PartitionError, match="no op `tanhh`; close names: tanh"):
        split_model(case.model, case.loss_fn, case.example, split_points=["node:tanhh"])


class _RunningMean(torch.nn.Module):
    """Six Linears and a running mean the forward updates in place between two of them and reads right after:
    `mean.mul_(0.9).add_(...)` is two ops, and a cut between ops could fall between them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(6)])
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                with torch.no_grad():
                    self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
                x = x - self.mean
        return x


def test_cuts_between_ops_keep_a_buffer_update_in_one_stage():
    """The automatic split cut between the update's mul_ and add_ (at 7 stages, and at 8, what zbv on 4 ranks
    needs) and then refused its own cut: the buffer updated in one stage and read in another. Positions inside
    a buffer's reads and update are no cut candidates now; the zbv step trains equal to eager, buffer included."""
    torch.manual_seed(0)
    case = Case(_RunningMean(), F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), 8)
    for stages in (7, 8):
        staged = split_model(copy.deepcopy(case.model), case.loss_fn, ((case.example[0],), (case.example[1],)),
                             num_stages=stages)
        holders = [st.index for st in staged.stages if "mean" in st.buffers]
        assert len(holders) == 1, (stages, holders)
    threaded_step_matches_eager(case, "zbv", 4)
