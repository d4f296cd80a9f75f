"""Memory layouts the trace sees and the runtime does not: an example that is a slice or channels_last (the
runtime stages every microbatch contiguous), and an activation that is a permuted view when traced but arrives
contiguous. Float64 against eager, every rank a thread of this process (support.threaded)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from support.models import Case
from support.threaded import loopback_pipes, run_pipes, threaded_step_matches_eager
from zbcompile.options import CompileOptions


class Framer(nn.Module):
    """Two frames of 4 samples, hop 2, cut by as_strided from the input's own strides (audio framing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        frames = x.as_strided((x.shape[0], 2, 4), (x.stride(0), 2 * x.stride(1), x.stride(1)))
        return self.b(torch.tanh(self.a(frames))).squeeze(-1)


def test_an_example_sliced_from_a_bigger_tensor_traces_the_layout_the_step_runs_on():
    """`example=(batch[:, :-1], ...)` has row stride 13: the trace fixed it into as_strided while the runtime
    stages rows of 12, so the frames read other samples: a wrong loss and gradients, silently."""
    torch.manual_seed(0)
    signal = torch.randn(2, 13, dtype=torch.float64)
    case = Case(Framer().double(), F.mse_loss, (signal[:, :-1], torch.randn(2, 2, dtype=torch.float64)), 4)
    threaded_step_matches_eager(case, "1f1b", 2, split_points=["b"])


class NHWCHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c0, self.c1 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        h = self.c1(self.c0(x))
        return self.head(h.permute(0, 2, 3, 1).reshape(h.shape[0], -1))


def test_a_channels_last_example_traces_the_layout_the_step_runs_on():
    """On a channels_last example the NHWC flatten's reshape was traced as a view, which failed with torch's
    "view size is not compatible" on the contiguous microbatches the runtime stages."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    threaded_step_matches_eager(Case(NHWCHead().double(), F.mse_loss, (x, torch.randn(2, 2, dtype=torch.float64)), 4),
                                "1f1b", 2, split_points=["head"])


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):   # (B, T, C) in and out: out is a transposed view
        return torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4 * 6, 3)

    def forward(self, h):   # the last stage: `h` arrives contiguous
        return self.lin(h.transpose(1, 2).contiguous().view(h.shape[0], -1))


class TransposedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1, self.head = ConvBlock(), ConvBlock(), Head()

    def forward(self, x):
        return self.head(self.b1(self.b0(x)))


def test_model_outputs_from_an_activation_traced_as_a_permuted_view():
    """Export dropped the `.contiguous()` (redundant on the traced layout): pipe(x)'s last stage ran the view on
    the contiguous activation it received and failed with torch's "view size is not compatible"; step() and
    evaluate() worked."""
    torch.manual_seed(0)
    model = TransposedNet().double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 6, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    options = CompileOptions(schedule="1f1b", microbatches=4, loss_fn=F.mse_loss, example=((x[:2],), (y[:2],)),
                             split_points=["head"])
    pipes = loopback_pipes(model, options, 2)
    outs = run_pipes(lambda r: pipes[r](x), 2)
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(outs[-1], want, rtol=1e-12, atol=1e-12)


class ChannelNorm(nn.Module):
    """BatchNorm1d over the channels of a (batch, time, channels) activation, then a Linear: the norm's output
    layout on a transposed input is another on fake tensors than on the CPU kernel."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb, self.bn = nn.Embedding(20, d), nn.BatchNorm1d(d)
        self.lin, self.head = nn.Linear(d, d), nn.Linear(d, 4, bias=False)

    def forward(self, ids):
        h = self.bn(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(self.lin(h))


def test_a_view_the_fake_layout_allowed_runs_on_the_real_one():
    """aot traced `linear`'s flattening view on the fake BatchNorm output's strides, which the CPU kernel does
    not return: the first step failed with torch's raw "view size is not compatible" (fuzzing, probe 24). Every
    view of the stage graphs is a reshape now; loss, gradients and running statistics equal eager's, with the norm
    and the linear in one stage and with a cut between them, on 1f1b and zbv."""
    torch.manual_seed(0)
    x, y = torch.randint(0, 20, (3, 6)), torch.randn(3, 6, 4, dtype=torch.float64)
    for schedule, pp, cuts in (("1f1b", 2, ["head"]), ("1f1b", 2, ["lin"]), ("zbv", 2, ["bn", "lin", "head"])):
        case = Case(ChannelNorm().double(), F.mse_loss, (x, y), 4)
        threaded_step_matches_eager(case, schedule, pp, split_points=cuts)
