"""The automatic split cuts between ops where modules are too few for the stages a schedule needs: a model of
three Linears, a few ops in one forward, a CNN whose layers sit in one Sequential; each split's stages run equal
to eager (the reference runner), and the programs train equal to eager under zbv at 4 and 8 model stages. A
`node:<op>` split point cuts before that op; a name the trace does not have is refused with close names."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.reference import check_against_eager
from support.models import Case, eager_accumulated
from support.threaded import run_threaded
from zbcompile.errors import PartitionError
from zbcompile.passes.schedules import generate
from zbcompile.split import report, split_model


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class FewOps(nn.Module):
    """Four matmuls and their activations in one forward: no submodule at all."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = torch.tanh(x @ self.w1)
        h = torch.relu(h @ self.w2)
        h = torch.sin(h @ self.w1.t())
        return torch.tanh(h @ self.w2) * 2.0 + h


def _three():
    torch.manual_seed(0)
    return Case(Three(), F.mse_loss, (torch.randn(8, 16), torch.randn(8, 4)), 7)


def _few_ops():
    torch.manual_seed(0)
    return Case(FewOps(), F.mse_loss, (torch.randn(8, 16), torch.randn(8, 16)), 8)


def _cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    return Case(model, F.cross_entropy, (torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))), 8)


CASES = {"three_linears": _three, "few_ops": _few_ops, "cnn_sequential": _cnn}


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
    case = _three()
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["node:tanh", "b"])
    assert [st.modules for st in staged.stages] == [("a",), (), ("b", "c")]
    check_against_eager(staged, case)
    with pytest.raises(PartitionError, match="no op `tanhh`; close names: tanh"):
        split_model(case.model, case.loss_fn, case.example, split_points=["node:tanhh"])
