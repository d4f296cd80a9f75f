"""Buffers a forward updates, against eager single-process runs of the same model (float64, every rank a thread
of this process: support.threaded.loopback_pipes):

- eval mode switches BatchNorm / InstanceNorm running statistics by their ops; any other buffer the traced (train
  mode) forward updates, an EMA, is refused with UsageError (the trace cannot tell whether eager eval mode skips
  or makes the update), and train mode, which that error points to, updates it as eager's no_grad forward does;
- a buffer the forward updates in one stage and reads in another (one BatchNorm called in the first and the last
  stage) is refused when the step is split, before any rank communicates; buffers only read in two stages work.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from support.loops import eager_step, rel
from support.threaded import loopback_pipes, run_pipes
from zbcompile.compiler import compile_programs
from zbcompile.errors import PartitionError, UsageError
from zbcompile.options import CompileOptions

pytestmark = pytest.mark.slow
PP, M, D = 2, 4, 8


class Stats(nn.Module):
    """BatchNorm and a tracking InstanceNorm in stage 0 and, with `ema`, an EMA buffer updated in forward (under
    `if self.training:` with `guard`, unconditionally without) and read in stage 1 (`b`)."""

    def __init__(self, ema: bool = True, guard: bool = True):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.inn = nn.InstanceNorm1d(D, track_running_stats=True, affine=True)
        self.register_buffer("ema", torch.zeros(D))
        self.use_ema, self.guard = ema, guard

    def forward(self, x):
        h = self.bn(torch.tanh(self.a(x)))
        h = self.inn(h.view(-1, 2, D).transpose(1, 2)).transpose(1, 2).reshape(h.shape)
        if self.use_ema:
            if self.training or not self.guard:
                with torch.no_grad():
                    self.ema.mul_(0.5).add_(h.mean(0), alpha=0.5)
            h = h + self.ema
        return self.b(h)


def _pipes(model, split_points, schedule="1f1b", batch=16):
    torch.manual_seed(1)
    x, y = torch.randn(batch, D, dtype=torch.float64), torch.randn(batch, D, dtype=torch.float64)
    opts = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=M, loss_fn=F.mse_loss,
                                      example=((x[:batch // M],), (y[:batch // M],)), split_points=split_points)
    return x, y, opts


def _eager_forward(model, x, y):
    """The mean loss and the outputs of a forward under no_grad, microbatch by microbatch (in the model's mode)."""
    with torch.no_grad():
        outs = [model(a) for a in x.chunk(M)]
    return sum(F.mse_loss(o, b).item() for o, b in zip(outs, y.chunk(M))) / M, torch.cat(outs)


def _buffers_equal(pipes, ref, what):
    buffers = dict(ref.named_buffers())
    for r, pipe in enumerate(pipes):
        for n, b in pipe.named_buffers():
            assert rel(b, buffers[n]) <= 1e-12 or (b == buffers[n]).all(), f"{what}: rank {r} buffer {n}"


@pytest.mark.parametrize("guard", [True, False], ids=["if_training", "unconditional"])
def test_eval_mode_refuses_a_buffer_update_it_cannot_switch_and_train_mode_matches_eager(guard):
    """An EMA buffer updated in forward: after eval(), evaluate() and pipe(x) raise UsageError naming it (eager
    eval skips the update behind `if self.training:` and makes it without the guard; the train-mode trace
    computes with the updated value either way), on every rank, before anything runs: no buffer moves. After
    train(), as the error says, evaluate() and pipe(x) equal eager's train-mode forward under no_grad
    microbatch by microbatch: the loss, the outputs, the EMA and the normalization statistics after."""
    model = Stats(guard=guard).double()
    x, y, opts = _pipes(model, ["b"])
    pipes = loopback_pipes(model, opts, PP)
    ref = copy.deepcopy(model)
    eager_step(ref, F.mse_loss, x, y, M)   # a training step first: statistics and EMA away from their initial values
    want_eval = _eager_forward(copy.deepcopy(ref).eval(), x, y)[0]
    want_loss, _ = _eager_forward(ref.train(), x, y)
    _, want_out = _eager_forward(ref, x, y)

    def run(r):
        pipe = pipes[r]
        pipe.step(x, y)
        before = {n: b.clone() for n, b in pipe.named_buffers()}
        pipe.eval()
        for call in (lambda: pipe.evaluate(x, y), lambda: pipe(x)):
            with pytest.raises(UsageError, match=r"(?s)updates buffer 'ema'.*traced in train mode.*pipe\.train\(\)"):
                call()
        assert all((b == before[n]).all() for n, b in pipe.named_buffers()), "a refused call moved a buffer"
        pipe.train()
        return pipe.evaluate(x, y), pipe(x)

    (loss, _), (_, out) = run_pipes(run, PP)   # the outputs on the last stage's rank, None on the other
    assert abs(loss - want_loss) <= 1e-12 * want_loss and loss != want_eval
    assert rel(out, want_out) <= 1e-12
    _buffers_equal(pipes, ref, "after train-mode evaluate() and pipe(x)")


def test_eval_mode_switches_batchnorm_and_instancenorm_statistics():
    """The check above refuses nothing the eval switch handles: BatchNorm (running_mean / running_var and
    num_batches_tracked) and InstanceNorm(track_running_stats=True) evaluate as eager's eval mode after a training
    step and keep their statistics. (Guards the refusal against over-reach; it passes without it too.)"""
    model = Stats(ema=False).double()
    x, y, opts = _pipes(model, ["b"])
    pipes = loopback_pipes(model, opts, PP)
    ref = copy.deepcopy(model)
    eager_step(ref, F.mse_loss, x, y, M)
    want_loss, want_out = _eager_forward(ref.eval(), x, y)

    def run(r):
        pipes[r].step(x, y)
        pipes[r].eval()
        return pipes[r].evaluate(x, y), pipes[r](x)

    (loss, _), (_, out) = run_pipes(run, PP)   # the outputs on the last stage's rank, None on the other
    assert abs(loss - want_loss) <= 1e-12 * want_loss and rel(out, want_out) <= 1e-12
    _buffers_equal(pipes, ref, "after eval-mode evaluate() and pipe(x)")


class Reuse(nn.Module):
    """One module with a buffer the forward updates, used in the first and in the last layer: a BatchNorm1d
    called twice, or an EMA read at the start and updated at the end."""

    def __init__(self, kind: str, n: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(n))
        self.norm = nn.BatchNorm1d(D)
        self.register_buffer("ema", torch.zeros(D))
        self.kind = kind

    def forward(self, x):
        x = self.norm(x) if self.kind == "batchnorm" else x + self.ema
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.kind == "batchnorm":
            return self.norm(x)
        with torch.no_grad():
            self.ema.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x


@pytest.mark.parametrize("kind,buffer", [("batchnorm", "norm.running_mean"), ("ema", "ema")])
@pytest.mark.parametrize("schedule,split_points,stages", [
    ("1f1b", ["layers.2"], "0 and 1"),                            # the stages on two ranks: a KeyError at placement
    ("zbv", ["layers.1", "layers.2", "layers.3"], "0 and 3"),     # both on rank 0: silently wrong statistics
])
def test_a_buffer_updated_in_one_stage_and_read_in_another_is_refused_when_split(kind, buffer, schedule,
                                                                                  split_points, stages):
    """Eager updates the buffer call by call, microbatch by microbatch; a pipeline runs stage 0's next
    microbatch before the last stage has updated the buffer for this one, so no schedule keeps that order: the
    compile refuses it (PartitionError naming the buffer and the stages, with the fix) before any rank is placed
    or communicates, whichever ranks run the two stages."""
    model = Reuse(kind).double()
    x, y, opts = _pipes(model, split_points, schedule)
    with pytest.raises(PartitionError, match=rf"(?s)buffer `{buffer}` is updated .* stages {stages} .*Fix: cut so"):
        compile_programs(model, opts, PP)


def test_buffers_read_in_two_stages_or_written_in_one_match_eager():
    """Not refused: a position buffer only read in the first and the last stage, a BatchNorm whose calls are all
    in one stage, and a buffer of the root module the last stage only writes (`self.last.copy_(...)`, never read:
    the rank of that stage holds it, where it was a KeyError while placing the pipeline); two training steps equal
    eager's (losses, gradients, buffers)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
            self.norm = nn.BatchNorm1d(D)
            self.register_buffer("pos", torch.linspace(-1, 1, D))
            self.register_buffer("last", torch.zeros(D))

        def forward(self, x):
            x = self.norm(x + self.pos)
            x = self.norm(torch.tanh(self.layers[0](x)))
            for layer in self.layers[1:]:
                x = torch.tanh(layer(x))
            with torch.no_grad():
                self.last.copy_(x.mean(0))
            return x * self.pos

    model = Model().double()
    x, y, opts = _pipes(model, ["layers.2"])
    pipes = loopback_pipes(model, opts, PP)
    ref = copy.deepcopy(model)
    want = []
    for _ in range(2):
        want.append(eager_step(ref, F.mse_loss, x, y, M))
    got = run_pipes(lambda r: [pipes[r].step(x, y) for _ in range(2)], PP)
    for a, b in zip(got[0], want):
        assert abs(a - b) <= 1e-12 * b
    params = dict(ref.named_parameters())
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            assert rel(p.grad, params[n].grad) <= 1e-10, n
    _buffers_equal(pipes, ref, "after two steps")
    assert any("last" in dict(pipe.named_buffers()) for pipe in pipes)
