"""The compile fingerprint every rank compares before its first message (zbcompile/agreement.py): what ranks that
built different things differ in, named; ranks that built the same thing agree."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zbcompile.agreement import fingerprint, first_difference
from zbcompile.compiler import compile_programs
from zbcompile.options import CompileOptions


def _print(class_weight: torch.Tensor):
    """The fingerprint of a two-stage MLP whose loss holds `class_weight` (cross-entropy's weight): a constant
    tensor of the loss stage's graph, no parameter or buffer of the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    options = CompileOptions.from_kwargs(None, schedule="1f1b", microbatches=2, example=((x,), (y,)),
                                         loss_fn=lambda out, t: F.cross_entropy(out, t, weight=class_weight),
                                         split_points=("2",))
    return fingerprint(model, compile_programs(model, options, 2))


def test_a_constant_tensor_of_a_stage_graph_is_in_its_digest():
    """Ranks launched with other class weights in the loss would train another model: the loss stage's digest
    covers its constant tensors, so the fingerprints differ there (and only there); equal weights agree."""
    a, b = _print(torch.tensor([1.0, 2.0, 3.0])), _print(torch.tensor([1.0, 2.0, 5.0]))
    assert first_difference([a, _print(torch.tensor([1.0, 2.0, 3.0]))]) is None
    found = first_difference([a, b])
    assert found is not None and found.startswith("stages, stage 1: "), found
