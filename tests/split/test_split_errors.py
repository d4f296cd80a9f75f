"""SplitError shows the picture: the stage, the module and node at fault with a window of the stage graph,
torch's whole message (chained) and how to fix it; and the split passes' boundary checks say which pass broke
which graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from zbcompile.errors import SplitError
from zbcompile.passes.split_fbw import _explain_joint_failure
from zbcompile.passes.trace import trace
from zbcompile.split import run_split_passes, split_model, split_passes
from zbcompile.ir.stages import Graph

torch.set_num_threads(1)


@torch.library.custom_op("zbtest::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


class Doubling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return double(self.fc(x))   # a custom op without a backward: aot's joint trace rejects it


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), Doubling(), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_an_op_without_backward_names_stage_module_node_and_fix():
    with pytest.raises(SplitError) as info:
        split_model(Net(), F.mse_loss, (torch.randn(4, 8), torch.randn(4, 8)), split_points=["layers.1"])
    text = str(info.value)
    assert text.startswith("stage 1 (layers.1, layers.2) could not be differentiated")
    assert "at node `double` (zbtest.double.default) in module `layers.1`" in text
    assert ">> %double" in text and "%linear" in text            # the window around the node
    assert "no autograd formula was registered" in text           # torch's own text, in full
    assert "register_autograd" in text.splitlines()[-1]           # the fix comes last
    assert isinstance(info.value.__cause__, RuntimeError)        # and the original error is chained


def test_an_output_aliasing_an_input_is_pointed_at():
    gm = make_fx(lambda w, x: (w.view(-1), (x @ w).sum()))(torch.randn(3, 3), torch.randn(2, 3))
    stage = Graph(gm, ("param:w", "data:0"), ("act:v", "loss"), index=2, modules=("head",))
    error = RuntimeError("aot_export_joint_simple does not support outputs that alias inputs.\nsecond line")
    text = _explain_joint_failure(stage, gm, error)
    assert text.startswith("stage 2 (head) could not be differentiated")
    assert "at node `view`" in text and ">> %view" in text
    assert "    second line" in text
    assert ".clone()" in text.splitlines()[-1]


def test_a_pass_that_breaks_a_graph_is_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    traced = trace(model, F.mse_loss, (torch.randn(2, 4), torch.randn(2, 4)))

    def misname(cut):
        first = cut.stages[0]
        return dataclasses.replace(cut, stages=(dataclasses.replace(first, inputs=first.inputs[:-1]),) + cut.stages[1:])

    partition_pass, *rest = split_passes(["2"])
    with pytest.raises(SplitError, match=r"^misname, stage 0 forward: \d+ inputs named for \d+ in the graph"):
        run_split_passes(traced, (partition_pass, misname, *rest))
