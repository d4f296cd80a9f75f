"""The training loops people write, on the pipeline's own PipelineModules (one compile, every rank a thread of
this process: support.threaded.loopback_pipes), each against eager single-process training of the same model:
train / eval / train with BatchNorm and dropout, every floating dtype and autocast, clip_grad_norm_ over the
whole pipeline (tied weights, mirrored stages, vocabulary shards), an inf / NaN skipped on every rank, and
GradScaler. tests/distributed/test_training_loop_dist.py runs the same user calls across processes (gloo).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from support.loops import MoE, eager_step, moe_loss, rel, shard_of, titan_loss
from support.models import convnet, gpt, mlp
from support.threaded import loopback_pipes, run_pipes
from zbcompile.errors import UsageError
from zbcompile.options import CompileOptions

pytestmark = pytest.mark.slow
PP, M = 2, 4


def _pipes(case, schedule="1f1b", dtype=None, **options):
    model, loss_fn, (x, y), _ = case
    if dtype is not None:
        model = model.to(dtype)
        x = x.to(dtype) if x.is_floating_point() else x
        y = y.to(dtype) if y.is_floating_point() else y
    opts = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=M, loss_fn=loss_fn,
                                      example=((x[:x.shape[0] // M],), (y[:y.shape[0] // M],)), **options)
    return model, loss_fn, x, y, loopback_pipes(model, opts, PP)


def _assert_state_equal(pipes, ref, tol: float, what: str) -> None:
    """Every rank's parameters (and their grads) and buffers equal eager's, rows of a shard against its rows."""
    params, buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
    for r, pipe in enumerate(pipes):
        for n, p in pipe.named_parameters():
            assert rel(p.detach(), shard_of(params[n].detach(), p, r)) <= tol, f"{what}: rank {r} {n}"
            if params[n].grad is not None:
                assert p.grad is not None and rel(p.grad, shard_of(params[n].grad, p, r)) <= tol, \
                    f"{what}: rank {r} grad of {n}"
        for n, b in pipe.named_buffers():
            assert rel(b.double(), buffers[n].double()) <= tol, f"{what}: rank {r} buffer {n}"


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_train_eval_train_with_batchnorm_matches_eager(schedule):
    """SGD steps, an eval pass, more steps, another eval: losses, parameters and BatchNorm's running statistics
    equal eager's (which trains on the same microbatches). evaluate() writes no gradient and, in eval mode, leaves
    the running statistics alone; in train mode it updates them as eager's no_grad forward does."""
    model, loss_fn, x, y, pipes = _pipes(convnet(blocks=4, batch=8), schedule, dtype=torch.float64)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [(x, y), (x.flip(0), y), (x, y.flip(0))]
    want = []
    for k, (xb, yb) in enumerate(batches):
        ref.train()
        opt_ref.zero_grad()
        want.append(("train", eager_step(ref, loss_fn, xb, yb, M)))
        opt_ref.step()
        ref.eval() if k != 1 else None   # the second eval pass runs in train mode: running stats move
        with torch.no_grad():
            want.append(("eval" if k != 1 else "train-mode eval", sum(
                loss_fn(ref(a), b).item() for a, b in zip(xb.chunk(M), yb.chunk(M))) / M))
        opt_ref.zero_grad()

    def loop(r):
        pipe = pipes[r]
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        got = []
        for k, (xb, yb) in enumerate(batches):
            pipe.train()
            opt.zero_grad()
            got.append(("train", pipe.step(xb, yb)))
            opt.step()
            opt.zero_grad()
            pipe.eval() if k != 1 else None
            got.append(("eval" if k != 1 else "train-mode eval", pipe.evaluate(xb, yb)))
            assert all(p.grad is None for p in pipe.parameters()), "evaluate() wrote a gradient"
        return got

    for got in run_pipes(loop, PP):
        assert [k for k, _ in got] == [k for k, _ in want]
        for (kind, a), (_, b) in zip(got, want):
            assert abs(a - b) <= 1e-10 * abs(b), (kind, a, b)
    _assert_state_equal(pipes, ref, 1e-10, schedule)


def test_eval_turns_dropout_off_and_train_mode_keeps_it():
    """A GPT with dropout 0.3: evaluate() after eval() equals eager's eval loss; in train mode the forward drops
    (another loss, different between calls); step() in eval mode and under no_grad / inference_mode is refused,
    and the next step after a refusal trains normally (nothing wedged)."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, dropout=0.3, batch=8), "zbv")
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M

    def run(r):
        pipe = pipes[r]
        out = {"eval": pipe.eval().evaluate(x, y)}
        with pytest.raises(UsageError, match="eval mode"):
            pipe.step(x, y)
        pipe.train()
        out["train1"], out["train2"] = pipe.evaluate(x, y), pipe.evaluate(x, y)
        with pytest.raises(UsageError, match="no_grad"):
            with torch.no_grad():
                pipe.step(x, y)
        with pytest.raises(UsageError, match="inference_mode"):
            with torch.inference_mode():
                pipe.step(x, y)
        with torch.inference_mode():
            out["inference"] = pipe.eval().evaluate(x, y)
        out["step"] = pipe.train().step(x, y)
        out["graded"] = all(p.grad is not None for p in pipe.parameters())
        return out

    for out in run_pipes(run, PP):
        assert abs(out["eval"] - want) <= 1e-6 * want and abs(out["inference"] - want) <= 1e-6 * want
        assert out["train1"] != out["eval"] and out["train1"] != out["train2"]
        assert math.isfinite(out["step"]) and out["graded"]


class _HalvedInTraining(torch.nn.Module):
    """A train-only rescale behind `if self.training:` (no random op: nothing for the eval switch to find)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        if self.training:
            h = h * 0.5
        return self.c(h)


class _HalvedWithAConstant(_HalvedInTraining):
    """The same branch, in a forward that also makes a tensor without `device=` (fine in eager on the CPU): the
    eval check's trace on meta weights fails there, and the check was skipped with a log line."""

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x))) + torch.arange(x.shape[-1], dtype=x.dtype) * 0.1
        if self.training:
            h = h * 0.5
        return self.c(h)


class _HalvedWithADeviceConstant(_HalvedInTraining):
    """The same branch beside a constant made on the input's device (HF Falcon's attention): on the meta trace
    it is a meta constant with no values to move, and the check failed with a TraceError about meta models."""

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x))) * torch.tensor([0.5], device=x.device, dtype=x.dtype)
        if self.training:
            h = h * 0.5
        return self.c(h)


class _HalvedWithADeviceBranch(_HalvedInTraining):
    """The same branch beside code that picks a dtype by device (HF's MoE router loss: `histc` on float32 on the
    CPU, int32 elsewhere, which the CPU's histc does not take): the meta trace took the int32 path, its graphs
    failed on the stand-ins, and the check was skipped with a log line."""

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        kind = torch.float32 if h.device.type == "cpu" else torch.int32
        counts = torch.histc(h.argmax(-1).to(kind), bins=8, min=0, max=8)
        if self.training:
            h = h * 0.5
        return self.c(h) + counts.sum().to(h.dtype) * 0


class _ModeAware(torch.nn.Module):
    """What eval() does switch: F.dropout(training=self.training), as HF models write it, and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.nn.functional.dropout(self.bn(self.a(x)), p=0.3, training=self.training)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("model", [_HalvedInTraining, _HalvedWithAConstant, _HalvedWithADeviceConstant,
                                   _HalvedWithADeviceBranch, _ModeAware])
def test_a_branch_on_self_training_is_refused_in_eval_mode_not_run_as_trained(model):
    """A Python branch on `self.training` was fixed in its train-mode path by the trace: evaluate() and pipe(x)
    after eval() returned the train-mode loss and outputs, silently. The first eval-mode call traces the model
    in eval mode and compares; a branch is refused on every rank, naming the module. Where eval() switches
    everything (dropout written as HF writes it, a BatchNorm) evaluation matches eager's eval mode."""
    torch.manual_seed(0)
    net = model().double()
    x, y = torch.randn(4 * M, 8, dtype=torch.float64), torch.randn(4 * M, 8, dtype=torch.float64)
    _, loss_fn, _, _, pipes = _pipes((net, torch.nn.functional.mse_loss, (x, y), None), split_points=["b"])
    ref = copy.deepcopy(net).eval()
    with torch.no_grad():
        want = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M

    def run(r):
        pipe = pipes[r].eval()
        if model is _ModeAware:
            return pipe.evaluate(x, y)
        for call in (lambda: pipe.evaluate(x, y), lambda: pipe(x)):
            with pytest.raises(UsageError, match=rf"branch on `self.training` in \(the model\) \({model.__name__}\)"):
                call()
        return pipe.train().evaluate(x, y)   # train mode: the traced branch is the right one

    got = run_pipes(run, PP)
    if model is _ModeAware:
        assert all(abs(v - want) <= 1e-12 * want for v in got), (got, want)
    else:
        with torch.no_grad():
            trained = sum(loss_fn(ref.train()(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
        assert all(abs(v - trained) <= 1e-12 * trained for v in got), (got, trained)


class _Logits(torch.nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x):
        return self.hf(x).logits


def test_bigbirds_random_attention_in_training_is_refused_in_eval_mode():
    """HF BigBird's block-sparse attention attends random blocks in training only (a branch on
    `self.training`). On all-positive stand-in weights every hidden vector points one way, so which blocks are
    mixed moved the check's loss by less than its tolerance: evaluate() and pipe(x) returned the train-mode
    result, silently (outputs 4.8 off eager's eval mode at a larger init). The check runs on signed stand-ins
    too now."""
    import transformers

    from zbcompile.eval_check import check_eval_branches

    torch.manual_seed(0)
    cfg = transformers.BigBirdConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, attention_type="block_sparse", block_size=2, num_random_blocks=1,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _Logits(transformers.BigBirdForMaskedLM(cfg)).double()
    torch.manual_seed(1)
    x, y = torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16))

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    with pytest.raises(UsageError, match=r"branch on `self.training` in .*BigBirdBlockSparseAttention"):
        check_eval_branches(model, loss_fn, ((x,), (y,)))


class _StochasticDepth(torch.nn.Module):
    """torchvision's stochastic depth (ConvNeXt, Swin, EfficientNet): the identity in eval mode, else rows kept
    with probability 1 - p and scaled by 1 / (1 - p); `scaled=False` keeps the mask unscaled, so that eval mode's
    identity is not its expectation."""

    def __init__(self, p: float = 0.3, scaled: bool = True) -> None:
        super().__init__()
        self.p, self.scaled = p, scaled

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        noise = x.new_empty([x.shape[0], 1]).bernoulli_(keep)
        return x * (noise.div_(keep) if self.scaled else noise)


class _DeepBlocks(_HalvedInTraining):
    def __init__(self, scaled: bool = True) -> None:
        super().__init__()
        self.drop = _StochasticDepth(scaled=scaled)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h + self.drop(self.b(h)))


@pytest.mark.parametrize("scaled", [True, False], ids=["inverted", "unscaled"])
def test_stochastic_depth_evaluates_as_eager_in_eval_mode_where_the_check_finds_it_the_mean(scaled):
    """torchvision's stochastic depth draws with `bernoulli_` behind `if not self.training: return x`, which
    eval() cannot switch by an op: evaluate() and pipe(x) refused the model (ConvNeXt, Swin, EfficientNet). Its
    draws are now taken at their expectation where the eval-mode check finds that equal to the eval-mode trace
    (the inverted mask: equal to eager's eval mode, loss and outputs); an unscaled mask, whose expectation eval
    mode does not compute, is still refused."""
    torch.manual_seed(0)
    net = _DeepBlocks(scaled).double()
    x, y = torch.randn(4 * M, 8, dtype=torch.float64), torch.randn(4 * M, 8, dtype=torch.float64)
    _, loss_fn, _, _, pipes = _pipes((net, torch.nn.functional.mse_loss, (x, y), None), split_points=["b"])
    ref = copy.deepcopy(net).eval()
    with torch.no_grad():
        want, want_out = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M, ref(x)

    def run(r):
        pipe = pipes[r].eval()
        if not scaled:
            with pytest.raises(UsageError, match="computes another loss in eval mode"):
                pipe.evaluate(x, y)
            return None
        return pipe.evaluate(x, y), pipe(x)

    got = run_pipes(run, PP)
    if scaled:
        assert all(abs(loss - want) <= 1e-12 * want for loss, _ in got), (got, want)
        assert rel(got[-1][1], want_out) <= 1e-12 and got[0][1] is None


class _EvalExtras(_HalvedInTraining):
    """Returns one more output in eval mode (HF XLNet's `mems`, with its default use_mems_eval=True)."""

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        out = {"logits": self.c(h)}
        if not self.training:
            out["hidden"] = h
        return out


def test_pipe_x_refuses_outputs_only_eval_mode_returns_and_evaluate_runs():
    """pipe(x) after eval() returned the train-mode trace's outputs, without `hidden`, silently (the check compared
    the loss alone, which `hidden` does not change). It is refused, naming both modes' outputs; evaluate() equals
    eager's eval loss, and pipe(x) in train mode returns the logits."""
    torch.manual_seed(0)
    net = _EvalExtras().double()
    x, y = torch.randn(4 * M, 8, dtype=torch.float64), torch.randn(4 * M, 8, dtype=torch.float64)
    loss_fn = lambda out, y: torch.nn.functional.mse_loss(out["logits"], y)   # noqa: E731
    _, _, _, _, pipes = _pipes((net, loss_fn, (x, y), None), split_points=["b"])
    ref = copy.deepcopy(net)
    with torch.no_grad():
        want = sum(loss_fn(ref.eval()(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
        logits = ref.train()(x)["logits"]

    def run(r):
        pipe = pipes[r].eval()
        with pytest.raises(UsageError, match=r"other outputs in eval mode \(logits, hidden\) than in the training "
                                             r"step traced at compile \(logits\)"):
            pipe(x)
        return pipe.evaluate(x, y), pipe.train()(x)

    got = run_pipes(run, PP)
    assert all(abs(loss - want) <= 1e-12 * want for loss, _ in got), (got, want)
    torch.testing.assert_close(got[-1][1]["logits"], logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_batch_norm_evaluates_in_eval_mode(dtype):
    """A bfloat16 / float16 BatchNorm casts its float32 running statistics back to the buffers' dtype; eval
    mode refused that cast as "an update of another buffer". evaluate() equals eager's eval loss, and leaves
    the statistics as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(dtype)
    x, y = torch.randn(4 * M, 8, dtype=dtype), torch.randn(4 * M, 8, dtype=dtype)
    _, loss_fn, _, _, pipes = _pipes((model, torch.nn.functional.mse_loss, (x, y), None), split_points=["3"])
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
    for got in run_pipes(lambda r: pipes[r].eval().evaluate(x, y), PP):
        assert abs(got - want) <= 1e-2 * want, (got, want)
    _assert_state_equal(pipes, ref, 0.0, "after evaluate")


@pytest.mark.parametrize("dropout", [torch.nn.Dropout1d(0.4), torch.nn.Dropout2d(0.3), torch.nn.Dropout3d(0.5),
                                     torch.nn.AlphaDropout(0.3), torch.nn.FeatureAlphaDropout(0.25),
                                     torch.nn.Dropout2d(0.3, inplace=True)],
                         ids=lambda d: type(d).__name__ + ("_inplace" if d.inplace else ""))
def test_torchs_other_dropout_modules_train_as_eager_and_switch_off_in_eval(dropout):
    """Dropout1d/2d/3d and the alpha dropouts: their composites draw with `bernoulli_`, which the eval switch
    could not turn off (evaluate() refused them as a hand-written dropout). A train step equals eager's draw for
    draw (the threads share eager's generator), and evaluate() in eval mode equals eager's eval loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), dropout, torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 8)).double()
    shape = (8 * M, 4, 2, 3, 8) if isinstance(dropout, torch.nn.Dropout3d) else (8 * M, 4, 8)
    x, y = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)
    _, loss_fn, _, _, pipes = _pipes((model, torch.nn.functional.mse_loss, (x, y), None), split_points=["3"])
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    want = eager_step(ref, loss_fn, x, y, M)
    with torch.no_grad():
        want_eval = sum(loss_fn(ref.eval()(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
    torch.manual_seed(7)
    losses = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(v - want) <= 1e-12 * want for v in losses), (losses, want)
    assert want != want_eval   # the step dropped something
    _assert_state_equal(pipes, ref, 1e-12, "after the step")
    for got in run_pipes(lambda r: pipes[r].eval().evaluate(x, y), PP):
        assert abs(got - want_eval) <= 1e-12 * want_eval, (got, want_eval)


class _Recurrent(torch.nn.Module):
    """A recurrent layer of three with dropout between its layers, between two linears."""

    def __init__(self, rnn, batch_first: bool, **kwargs):
        super().__init__()
        self.rnn = rnn(8, 8, num_layers=3, dropout=0.5, batch_first=batch_first, **kwargs)
        width = kwargs.get("proj_size") or 8
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(width * (1 + kwargs.get("bidirectional", 0)), 8)

    def forward(self, x):   # x: (batch, sequence, 8), the batch first as the step splits it
        if self.rnn.batch_first:
            return self.b(self.rnn(self.a(x))[0])
        return self.b(self.rnn(self.a(x).transpose(0, 1))[0].transpose(0, 1))


@pytest.mark.slow   # 15-35 s each: the recurrent layers' joint traces
@pytest.mark.parametrize("rnn, batch_first, kwargs", [
    (torch.nn.LSTM, True, {}), (torch.nn.GRU, False, {"bidirectional": True}),
    (torch.nn.LSTM, True, {"proj_size": 4, "bidirectional": True}), (torch.nn.RNN, False, {"nonlinearity": "relu"}),
], ids=["lstm", "gru-bidirectional", "lstm-projections", "rnn-relu"])
def test_a_recurrent_layers_dropout_trains_as_eager_and_switches_off_in_eval(rnn, batch_first, kwargs):
    """LSTM/GRU/RNN(num_layers=3, dropout=p): torch's decomposition of these ops, which the joint trace used,
    never drops (the training step trained without the dropout, silently); the forward returning the outputs
    kept the layer whole with its `train` argument, so pipe(x) in eval mode dropped; evaluate() in eval mode was
    refused as a `self.training` branch. A train step equals eager's draw for draw; evaluate() and pipe(x) in
    eval mode equal eager's eval mode."""
    torch.manual_seed(0)
    model = _Recurrent(rnn, batch_first, **kwargs).double()
    x, y = (torch.randn(4 * M, 5, 8, dtype=torch.float64) for _ in range(2))
    _, loss_fn, _, _, pipes = _pipes((model, F.mse_loss, (x, y), None), split_points=["b"])
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    want = eager_step(ref, loss_fn, x, y, M)
    torch.manual_seed(7)
    assert all(abs(v - want) <= 1e-12 * want for v in run_pipes(lambda r: pipes[r].step(x, y), PP))
    _assert_state_equal(pipes, ref, 1e-12, "after the step")
    ref.eval()
    with torch.no_grad():
        want_out = ref(x)
        want_eval = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
    for got in run_pipes(lambda r: pipes[r].eval().evaluate(x, y), PP):
        assert abs(got - want_eval) <= 1e-12 * want_eval, (got, want_eval)
    _, out = _outputs(run_pipes(lambda r: pipes[r](x), PP))
    assert rel(out, want_out) <= 1e-12


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "dualpipe"])
def test_evaluate_with_vocabulary_parallelism_between_steps_matches_eager(schedule):
    """vocab_parallel=True: evaluate() runs the sharded output layer forward only (IF, F, S, and T for the loss
    alone). Between SGD steps its losses, and the steps' own, equal eager's; it writes no gradient and leaves
    the next step exact (its collectives are numbered apart from the training step's)."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8), schedule, dtype=torch.float64,
                                         vocab_parallel=True)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for xb, yb in [(x, y), (x.flip(0), y.flip(0)), (x, y.flip(0))]:
        with torch.no_grad():
            want.append(sum(loss_fn(ref(a), b).item() for a, b in zip(xb.chunk(M), yb.chunk(M))) / M)
        opt_ref.zero_grad()
        want.append(eager_step(ref, loss_fn, xb, yb, M))
        opt_ref.step()

    def run(r):
        pipe, got = pipes[r], []
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for xb, yb in [(x, y), (x.flip(0), y.flip(0)), (x, y.flip(0))]:
            opt.zero_grad(set_to_none=True)
            got.append(pipe.eval().evaluate(xb, yb))
            assert all(p.grad is None for p in pipe.parameters()), "evaluate() wrote a gradient"
            got.append(pipe.train().step(xb, yb))
            opt.step()
        return got

    for got in run_pipes(run, PP):
        assert got == pytest.approx(want, rel=1e-12), (got, want)
    _assert_state_equal(pipes, ref, 1e-12, "after steps and evaluations")


def test_evaluate_with_vocabulary_parallelism_switches_dropout():
    """A vocabulary-parallel GPT with dropout 0.3 and ignored targets (-100): after eval() evaluate() equals
    eager's eval loss on every rank; in train mode it is the forward of a training step (dropout draws: another
    loss on each call)."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, dropout=0.3, batch=8), "zbv", vocab_parallel=True)
    y = y.clone()
    y[:, :3] = -100
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
    for out in run_pipes(lambda r: (pipes[r].eval().evaluate(x, y), pipes[r].train().evaluate(x, y),
                                    pipes[r].evaluate(x, y)), PP):
        assert abs(out[0] - want) <= 1e-6 * want, (out, want)
        assert len(set(out)) == 3 and all(math.isfinite(v) for v in out), out


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_every_floating_dtype_trains_equal_to_eager(dtype, tol):
    """A float64, bfloat16 or float16 GPT: the loss and every gradient equal eager's in the same dtype, within
    what the dtype's rounding allows (the pipeline sums microbatch gradients in another order); the total norm
    too, in the dtype torch's get_total_norm returns (the model's)."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8), "zbv", dtype=dtype)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, M)
    losses = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(loss - want) <= tol * abs(want) for loss in losses), (losses, want)
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    for norm in run_pipes(lambda r: pipes[r].get_total_norm(), PP):
        assert norm.dtype == want_norm.dtype == dtype and rel(norm, want_norm) <= tol, (norm, want_norm)
    for r, pipe in enumerate(pipes):
        for n, p in pipe.named_parameters():
            assert p.grad.dtype == dtype and rel(p.grad, dict(ref.named_parameters())[n].grad) <= 10 * tol, n


def test_a_float16_loss_sum_that_overflows_gives_the_finite_mean():
    """A float16 model with the user's loss scale (x16384 in loss_fn): every microbatch loss is finite, their sum
    is not (65504 at most). step() and evaluate() return the finite mean, as eager's mean of the microbatch
    losses; the loss sum was taken in float16 and came back inf."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)).half()
    x, y = torch.randn(8 * M, 8).half(), torch.randn(8 * M, 8).half()

    def loss_fn(out, tgt):
        return torch.nn.functional.mse_loss(out, tgt) * 16384.0

    _, _, _, _, pipes = _pipes((model, loss_fn, (x, y), None))
    ref = copy.deepcopy(model)
    parts = [loss_fn(ref(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))]
    assert sum(parts) > 65504 and all(abs(p) < 65504 for p in parts), parts   # the case is the overflow
    want = sum(parts) / M
    for got in run_pipes(lambda r: (pipes[r].step(x, y), pipes[r].evaluate(x, y)), PP):
        assert all(abs(v - want) <= 1e-3 * want for v in got), (got, want)


def test_autocast_around_compile_and_step():
    """Compiled under torch.autocast(bfloat16), stepped in the same region: equal to eager under autocast.
    A step outside the region it was compiled in (or inside one it was not) is refused with our error, and so
    are evaluate() and pipe(x) under another region (they returned a loss cast neither way)."""
    case = gpt(layers=4, batch=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model, loss_fn, x, y, pipes = _pipes(case, "1f1b")
    plain = _pipes(gpt(layers=4, batch=8), "1f1b")[-1]
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = eager_step(ref, loss_fn, x, y, M)

    def run(r):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipes[r].step(x, y)
        with pytest.raises(UsageError, match="compiled under cpu: bfloat16"):
            pipes[r].step(x, y)
        with pytest.raises(UsageError, match="compiled under no autocast"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                plain[r].step(x, y)
        for call in (lambda: pipes[r].evaluate(x, y), lambda: pipes[r](x)):   # the same graphs' casts
            with pytest.raises(UsageError, match=r"\(\) runs under cpu: float16 but .* under cpu: bfloat16"):
                with torch.autocast("cpu", dtype=torch.float16):
                    call()
        return loss

    assert all(abs(loss - want) <= 1e-6 * abs(want) for loss in run_pipes(run, PP))
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            assert rel(p.grad, dict(ref.named_parameters())[n].grad) <= 1e-5, n


ORDERS = (2.0, 1.0, 3.0, 0.5, 0.0, math.inf, -math.inf, -1.0)
SHIFT = 1e-4   # added to every gradient element, as eager's


def _assert_norms_are_torchs(got: dict, grads: list, what: str) -> None:
    """get_total_norm of every order against torch.nn.utils.get_total_norm over eager's `grads`: the same dtype, and
    the same value up to the pipeline's other summation order. A negative order's norm is at most the smallest
    |g| (the -inf norm is the min |g|): it moves by at most as much as the gradients do, so it is held to that,
    not to a relative bound, which a tiny min |g| would not meet; the 0-"norm" counts nonzero tensors: exactly."""
    scale = float(torch.nn.utils.get_total_norm(grads, math.inf)) if grads else 0.0
    for p, norm in got.items():
        want = torch.nn.utils.get_total_norm(grads, p)
        assert norm.dtype == want.dtype, (what, p, norm, want)
        bound = 0.0 if p == 0 else 1e-12 * (scale if p < 0 else abs(want.item()))
        assert abs(norm.item() - want.item()) <= bound, (what, p, norm, want)


def test_the_minimum_norm_skips_the_padding_rows_of_the_last_vocabulary_shard():
    """V=63 over 2 ranks: the last shard has a padding row, whose gradient is always 0 and is no gradient of the
    model; get_total_norm(-inf) (torch's min |g|) and (-1) must not count it."""
    from support.models import Case
    from zbcompile.examples.gpt import GPT, GPTConfig, loss_fn

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=63, seq=16, d=32, heads=2, layers=4)).double()
    x, y = torch.randint(0, 63, (8, 8)), torch.randint(0, 63, (8, 8))
    model, loss_fn, x, y, pipes = _pipes(Case(model, loss_fn, (x, y), 4), "zbv", vocab_parallel=True)
    ref = copy.deepcopy(model)
    eager_step(ref, loss_fn, x, y, M)
    for p in ref.parameters():
        p.grad.add_(SHIFT)
    rows = pipes[0].staged.vocab.rows
    assert rows * PP > 63, "no padding row to check"

    def run(r):
        pipes[r].step(x, y)
        for n, p in pipes[r].named_parameters():
            p.grad.add_(SHIFT)
            if n in pipes[r].staged.vocab.params and r == PP - 1:
                p.grad[63 - r * rows:] = 0.0   # the padding rows, as the runtime leaves them
        return {p: pipes[r].get_total_norm(p) for p in (-math.inf, -1.0, 2.0)}

    for r, norms in enumerate(run_pipes(run, PP)):
        _assert_norms_are_torchs(norms, [p.grad for p in ref.parameters()], f"rank {r}")


@pytest.mark.parametrize("schedule,vocab", [("1f1b", False), ("zbv", False), ("dualpipe", False), ("zbv", True)])
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), -float("inf")])
def test_clip_grad_norm_over_the_pipeline_matches_eager(schedule, vocab, norm_type):
    """pipe.clip_grad_norm_ returns eager's total norm on every rank and leaves eager's clipped gradients, with a
    tied embedding / head (one parameter on two ranks), DualPipe's mirrored stages (every parameter on both
    ranks) and vocabulary row shards; AdamW after the clip then agrees as well. get_total_norm of every order
    (0, negative, -inf: torch's min |g|) is torch's, and stays so where rank 0's gradients are gone (a rank that
    counts none; with DualPipe, which counts every parameter on rank 0, no gradient at all: torch's 0.0)."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8), schedule, dtype=torch.float64,
                                         vocab_parallel=vocab)
    ref = copy.deepcopy(model)
    eager_step(ref, loss_fn, x, y, M)
    for p in ref.parameters():   # no element exactly 0 (unused embedding rows are): else min |g| is 0 everywhere
        p.grad.add_(SHIFT)
    unclipped = [p.grad.clone() for p in ref.parameters()]
    max_norm = 0.5 if norm_type > 0 else 0.5 * float(torch.nn.utils.get_total_norm(unclipped, norm_type))
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3).step()

    orders = ORDERS   # the 0-"norm" (nonzero tensors) too: a vocabulary parameter is one tensor over its shards

    def run(r):
        pipes[r].step(x, y)
        for p in pipes[r].parameters():   # every copy of a tied or mirrored gradient, every row of a shard
            p.grad.add_(SHIFT)
        norms = {p: pipes[r].get_total_norm(p) for p in orders}
        norm = pipes[r].clip_grad_norm_(max_norm, norm_type)
        grads = {n: p.grad.clone() for n, p in pipes[r].named_parameters()}
        torch.optim.AdamW(pipes[r].parameters(), lr=1e-2, eps=1e-3).step()
        if r == 0 and not vocab:   # its vocabulary rows aside, eager could not drop them as well
            for p in pipes[r].parameters():
                p.grad = None
        without = {p: pipes[r].get_total_norm(p) for p in orders}
        return norm, grads, norms, without, [n for n, _ in pipes[r].named_parameters()]

    refp = dict(ref.named_parameters())
    out = run_pipes(run, PP)
    gone = {id(refp[n]) for n in out[0][4]}
    for r, (norm, grads, norms, without, _) in enumerate(out):
        assert norm.dtype == torch.float64 and abs(norm.item() - want.item()) <= 1e-12 * want.item(), (norm, want)
        _assert_norms_are_torchs(norms, unclipped, f"rank {r}")
        if not vocab:
            kept = [p.grad for p in ref.parameters() if id(p) not in gone]
            _assert_norms_are_torchs(without, kept, f"rank {r}, rank 0 without gradients")
        for n, g in grads.items():
            assert rel(g, shard_of(refp[n].grad, g, r)) <= 1e-10, f"rank {r} {n}"
    for r, pipe in enumerate(pipes):
        for n, p in pipe.named_parameters():
            assert rel(p.detach(), shard_of(refp[n].detach(), p, r)) <= 1e-9, f"rank {r} {n}"


def test_the_step_clips_by_the_zero_norm_counting_a_vocabulary_parameter_once():
    """step(optimizer=, max_norm=, norm_type=0) with vocab_parallel: the 0-"norm" counts nonzero tensors, and the
    tied embedding / head is one tensor though both ranks hold rows of it; counted per rank it would be one too
    many, and every gradient would be clipped by the wrong coefficient. The post-validated step cannot count it
    once along its prefix chain, so it refuses the order."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8), "zbv", dtype=torch.float64, vocab_parallel=True)
    ref = copy.deepcopy(model)
    eager_step(ref, loss_fn, x, y, M)
    count = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], 0))
    max_norm = count / 2   # clipped by about one half: one tensor more would change every gradient by 1/count
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, 0)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()

    def run(r):
        opt = torch.optim.SGD(pipes[r].parameters(), lr=0.5)
        with pytest.raises(UsageError, match="norm_type=0"):
            pipes[r].step(x, y, optimizer=opt, max_norm=max_norm, norm_type=0, post_validate=True)
        pipes[r].step(x, y, optimizer=opt, max_norm=max_norm, norm_type=0)

    run_pipes(run, PP)
    refp = dict(ref.named_parameters())
    for r, pipe in enumerate(pipes):
        for n, p in pipe.named_parameters():
            assert rel(p.detach(), shard_of(refp[n].detach(), p, r)) <= 1e-12, f"rank {r} {n}"


class _EMAAcross(torch.nn.Module):
    """An EMA buffer updated under no_grad after the first layer, read at the end: its new value crosses the
    cuts as an activation that carries no gradient (eager's EMA has none)."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x + self.ema


class _CounterAcross(_EMAAcross):
    """A step counter (`self.t += 1`, reading no activation) updated first, read at the end: a constant to the
    split, so the later stage recomputed it from its own copy of the buffer, and the split refused the model."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("t", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.t += 1
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * (1 + 0.01 * self.t)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("buffer", [_EMAAcross, _CounterAcross], ids=["ema", "counter"])
def test_a_buffer_updated_in_one_stage_and_read_in_a_later_one_trains_as_eager(schedule, buffer):
    """The update's value was both the buffer's new value and a sent activation: aot refused the stage (an output
    aliasing another), with a fix that did not apply; and its sender waited for a gradient no receiver makes.
    Now three SGD steps match eager: losses, gradients, parameters and the buffer."""
    torch.manual_seed(0)
    model = buffer().double()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    case = type(gpt())(model, F.mse_loss, (x, y), 4)
    model, loss_fn, x, y, pipes = _pipes(case, schedule)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for k in range(3):
        opt.zero_grad()
        want.append(eager_step(ref, loss_fn, x * (k + 1), y, M))
        opt.step()

    def run(r):
        sgd = torch.optim.SGD(pipes[r].parameters(), lr=0.1)
        losses = []
        for k in range(3):
            sgd.zero_grad()
            losses.append(pipes[r].step(x * (k + 1), y))
            sgd.step()
        return losses

    for losses in run_pipes(run, PP):
        assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(losses, want)), (losses, want)
    _assert_state_equal(pipes, ref, 1e-10, schedule)


class _To(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def test_the_norm_of_mixed_dtypes_is_torchs_on_every_rank():
    """float32 layers on rank 0, float64 ones on rank 1: torch's get_total_norm stacks the per-tensor norms, so
    the total is float64, on rank 0 too, whose own gradients are all float32. get_total_norm of every order and
    the post-validated step's norm (the same dtype, known on every rank without an exchange) are eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())],
                                _To(torch.float64), torch.nn.Linear(16, 16).double(), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16).double())
    x, y = torch.randn(8, 16), torch.randn(8, 16, dtype=torch.float64)
    _, loss_fn, x, y, pipes = _pipes((model, F.mse_loss, (x, y), None), "1f1b")
    ref = copy.deepcopy(model)
    eager_step(ref, loss_fn, x, y, M)
    grads = [p.grad for p in ref.parameters()]

    def run(r):
        pipes[r].step(x, y)
        norms = {p: pipes[r].get_total_norm(p) for p in ORDERS}
        opt = torch.optim.SGD(pipes[r].parameters(), lr=0.1)
        opt.zero_grad()
        result = pipes[r].step(x, y, optimizer=opt, max_norm=1e-3, post_validate=True)
        pipes[r].settle()
        return {p.dtype for p in pipes[r].parameters()}, norms, result.norm

    out = run_pipes(run, PP)
    assert out[0][0] == {torch.float32} and torch.float64 in out[1][0], "the split is not the one meant"
    for r, (_, norms, post_norm) in enumerate(out):
        _assert_norms_are_torchs(norms, grads, f"rank {r}")
        want = torch.nn.utils.get_total_norm(grads)
        assert abs(post_norm - want.item()) <= 1e-12 * want.item(), (r, post_norm, want)


@pytest.mark.parametrize("nan_rank", [0, 1])
def test_a_nan_gradient_on_one_rank_makes_every_order_of_norm_nan_as_torchs(nan_rank):
    """A NaN in one gradient on one rank: torch.nn.utils.get_total_norm is NaN for every order, the max and min
    orders too (where Python's max(1.0, nan) would drop a NaN met second). Every rank's get_total_norm of every
    order is NaN, and clipping with the optimizer skips the update on every rank."""
    case = mlp(batch=8)
    model, loss_fn, x, y, pipes = _pipes(case, "1f1b", dtype=torch.float64)
    before = [{n: p.detach().clone() for n, p in pipe.named_parameters()} for pipe in pipes]

    def run(r):
        pipes[r].step(x, y)
        if r == nan_rank:
            next(iter(pipes[r].parameters())).grad.view(-1)[0] = math.nan
        norms = [pipes[r].get_total_norm(p).item() for p in ORDERS if p != 0]
        opt = torch.optim.SGD(pipes[r].parameters(), lr=0.1)
        return norms, pipes[r].step(x, y, optimizer=opt, max_norm=1.0).skipped

    for r, (norms, skipped) in enumerate(run_pipes(run, PP)):
        assert all(math.isnan(v) for v in norms) and skipped, (r, norms, skipped)
    assert all(torch.equal(p, before[r][n]) for r, pipe in enumerate(pipes) for n, p in pipe.named_parameters())


class _SpectralFilter(torch.nn.Module):
    """A learned complex filter over the sequence's spectrum (FNO / global-filter style), then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.filt = torch.nn.Parameter(torch.randn(3, 8, dtype=torch.complex128) * 3)
        self.lin = torch.nn.Linear(8, 8).double()

    def forward(self, x):
        y = torch.fft.irfft(torch.fft.rfft(x, dim=1) * self.filt, n=x.shape[1], dim=1)
        return x + self.lin(torch.tanh(y))


def test_the_norm_and_clipping_of_complex_parameters_are_torchs():
    """A complex parameter's gradient norm is real (vector_norm of complex128 is float64): the total's dtype was
    promoted to complex, and clip_grad_norm_ / step(max_norm=) failed in torch's clamp. get_total_norm of every
    order, clip_grad_norm_ and the post-validated step's norm are eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SpectralFilter(), _SpectralFilter(), _SpectralFilter())
    x, y = torch.randn(4 * M, 5, 8, dtype=torch.float64), 5 * torch.randn(4 * M, 5, 8, dtype=torch.float64)
    _, loss_fn, _, _, pipes = _pipes((model, F.mse_loss, (x, y), None), split_points=["1"])
    ref = copy.deepcopy(model)
    eager_step(ref, loss_fn, x, y, M)
    grads = [p.grad.clone() for p in ref.parameters()]
    want = torch.nn.utils.get_total_norm(grads)

    def run(r):
        pipes[r].step(x, y)
        norms = {p: pipes[r].get_total_norm(p) for p in ORDERS}
        clipped = pipes[r].clip_grad_norm_(0.5)
        after = {n: p.grad.clone() for n, p in pipes[r].named_parameters()}
        opt = torch.optim.SGD(pipes[r].parameters(), lr=0.1)
        opt.zero_grad()
        result = pipes[r].step(x, y, optimizer=opt, max_norm=0.5, post_validate=True)
        pipes[r].settle()
        return norms, clipped, after, result.norm

    out = run_pipes(run, PP)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    refp = dict(ref.named_parameters())
    for r, (norms, clipped, after, post_norm) in enumerate(out):
        _assert_norms_are_torchs(norms, grads, f"rank {r}")
        assert clipped.dtype == torch.float64 and abs(clipped.item() - want.item()) <= 1e-12 * want.item()
        assert all(rel(g, refp[n].grad) <= 1e-12 for n, g in after.items()), r
        assert abs(post_norm - want.item()) <= 1e-12 * want.item(), (r, post_norm, want)


def test_a_step_with_bad_clipping_arguments_is_refused_before_it_runs():
    """max_norm without optimizer= was refused after the step had run (gradients written, BatchNorm statistics
    moved); a norm_type torch does not take, and a max_norm that is no number (a string from a config file), were
    refused inside the optimizer step, which marked the pipeline failed for good; max_norm=nan stepped unclipped
    where torch's clipping makes every gradient NaN. All are refused before anything runs, and the pipeline
    trains on."""
    model, loss_fn, x, y, pipes = _pipes(convnet(batch=8), dtype=torch.float64)
    ref = copy.deepcopy(model)

    def run(r):
        pipe = pipes[r]
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        before = {n: b.clone() for n, b in pipe.named_buffers()}
        with pytest.raises(UsageError, match="pass optimizer= too"):
            pipe.step(x, y, max_norm=1.0)
        with pytest.raises(UsageError, match="norm_type must be a number .* got 'fro'"):
            pipe.step(x, y, optimizer=opt, max_norm=1.0, norm_type="fro")
        for bad, said in (("1.0", r"got '1\.0': convert it, float\('1\.0'\)"), ([1.0], r"got \[1\.0\]"),
                          (float("nan"), "max_norm=nan, which would scale every gradient to NaN")):
            for post_validate in (False, True):   # (a string failed in the clipping, after the ranks' exchange)
                with pytest.raises(UsageError, match=said):
                    pipe.step(x, y, optimizer=opt, max_norm=bad, post_validate=post_validate)
        with pytest.raises(UsageError, match=r"clip_grad_norm_\(\) takes max_norm as a number"):
            pipe.clip_grad_norm_("0.5")
        untouched = all(torch.equal(b, before[n]) for n, b in pipe.named_buffers())
        graded = [n for n, p in pipe.named_parameters() if p.grad is not None]
        return untouched, graded, pipe.step(x, y, optimizer=opt, max_norm=1.0)

    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = eager_step(ref, loss_fn, x, y, M)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt_ref.step()
    opt_ref.zero_grad()
    for untouched, graded, loss in run_pipes(run, PP):
        assert untouched and not graded and abs(loss - want) <= 1e-12 * abs(want)
    _assert_state_equal(pipes, ref, 1e-12, "after the step")


def test_compiling_a_model_compiled_before_is_refused_saying_why():
    """compile keeps each rank's own stages and moves the rest of the model to meta: a second compile of that
    model (or of a deepcopy of pipe.model, after training) failed deep in the trace with torch's device
    mismatch ("meta and cpu"). It is refused before anything runs, saying how to compile again."""
    from zbcompile.api import compile_with

    model, loss_fn, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    opts = CompileOptions.from_kwargs(None, schedule="1f1b", microbatches=M, loss_fn=loss_fn,
                                      example=((x[:2],), (y[:2],)))
    for placed in (pipes[0].model, copy.deepcopy(pipes[1].model)):
        assert any(p.is_meta for p in placed.parameters())
        with pytest.raises(UsageError, match="this model was compiled before: .* build the model again"):
            compile_with(placed, opts)


def test_a_nan_on_one_rank_skips_the_step_on_every_rank():
    """A NaN in one rank's gradient makes grads_finite() False on every rank, and clip_grad_norm_ returns a NaN
    norm everywhere (error_if_nonfinite=True raises everywhere): the loop skips the step and nothing changes.
    A NaN in the batch does the same end to end."""
    model, loss_fn, x, y, pipes = _pipes(mlp(layers=4, batch=8), "zbv")
    before = [{n: p.detach().clone() for n, p in pipe.named_parameters()} for pipe in pipes]

    def run(r):
        pipe = pipes[r]
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.step(x, y)
        clean = pipe.grads_finite()
        if r == PP - 1:
            next(iter(pipe.parameters())).grad.view(-1)[0] = float("nan")
        finite, norm = pipe.grads_finite(), pipe.clip_grad_norm_(1.0)
        with pytest.raises(RuntimeError, match="non-finite"):
            pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
        if finite:
            opt.step()
        opt.zero_grad()
        bad = x.clone()
        bad[0, 0] = float("nan")
        pipe.step(bad, y)
        if pipe.grads_finite():
            opt.step()
        return clean, finite, norm.item()

    for clean, finite, norm in run_pipes(run, PP):
        assert clean and not finite and math.isnan(norm)
    for pipe, was in zip(pipes, before):
        assert all(torch.equal(p.detach(), was[n]) for n, p in pipe.named_parameters())


def test_grad_scaler_skips_an_overflow_on_every_rank_and_matches_eager():
    """float16 autocast with pipe.grad_scaler(): the backward is seeded with the scale, losses and parameters
    follow eager's torch.amp.GradScaler; a step whose gradients overflow on one rank is skipped on every rank and
    lowers the scale everywhere. A plain GradScaler is refused (it would see one rank's gradients)."""
    case = mlp(layers=4, batch=8)
    with torch.autocast("cpu", dtype=torch.float16):
        model, loss_fn, x, y, pipes = _pipes(case, "1f1b")
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    huge = x * 6e4   # overflows float16 in the first layer's backward

    want = []
    for xb in (x, huge, x):
        with torch.autocast("cpu", dtype=torch.float16):
            want.append(eager_step(ref, loss_fn, xb, y, M, scaler_ref))
        scaler_ref.step(opt_ref)
        scaler_ref.update()
        opt_ref.zero_grad()
        want.append(scaler_ref.get_scale())

    def run(r):
        pipe = pipes[r]
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        scaler = pipe.grad_scaler(init_scale=2.0 ** 10)
        with pytest.raises(UsageError, match="grad_scaler"), torch.autocast("cpu", dtype=torch.float16):
            pipe.step(x, y, scaler=torch.amp.GradScaler("cpu"))
        got = []
        for xb in (x, huge, x):
            with torch.autocast("cpu", dtype=torch.float16):
                got.append(pipe.step(xb, y, scaler=scaler))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            got.append(scaler.get_scale())
        # an inf in one rank's gradients only: every rank skips and halves its scale
        with torch.autocast("cpu", dtype=torch.float16):
            pipe.step(x, y, scaler=scaler)
        if r == PP - 1:
            next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
        kept = [p.detach().clone() for p in pipe.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert all(torch.equal(a, p) for a, p in zip(kept, pipe.parameters())), f"rank {r} stepped"
        assert scaler.get_scale() == got[-1] / 2, (r, scaler.get_scale(), got[-1])
        return got

    for got in run_pipes(run, PP):
        assert got[3] == want[3] == 2.0 ** 9, (got, want)   # the overflow halved the scale on every rank
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-3 * abs(b) or (math.isnan(a) and math.isnan(b)), (got, want)
    _assert_state_equal(pipes, ref, 1e-3, "after GradScaler steps")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.bfloat16, 2e-2)])
def test_vocab_parallel_takes_a_loss_that_casts_the_logits(dtype, tol):
    """vocab_parallel=True with `cross_entropy(pred.flatten(0, 1).float(), ...)`: the cast (and the metadata check
    export puts beside it) between the logits and the loss is accepted, the sharded loss runs in float32 as the
    user's does, and loss and gradients equal eager's."""
    model, _, (x, y), _ = gpt(layers=4, batch=8)
    model = model.to(dtype)
    opts = CompileOptions.from_kwargs(None, schedule="zbv", microbatches=M, loss_fn=titan_loss,
                                      example=((x[:2],), (y[:2],)), vocab_parallel=True)
    pipes = loopback_pipes(model, opts, PP)
    ref = copy.deepcopy(model)
    want = eager_step(ref, titan_loss, x, y, M)
    losses = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(loss - want) <= tol * abs(want) for loss in losses), (losses, want)
    refp = dict(ref.named_parameters())
    for r, pipe in enumerate(pipes):
        for n, p in pipe.named_parameters():
            assert rel(p.grad, shard_of(refp[n].grad, p, r)) <= 5 * tol, f"rank {r} {n}"


def _vocab_step_matches_eager(model, loss_fn, x, y, pp: int, m: int, schedule: str = "1f1b", tol: float = 1e-12):
    """One vocabulary-parallel step against eager's: the loss on every rank and every gradient (a shard's rows
    against eager's rows); returns the pipes."""
    opts = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=m, loss_fn=loss_fn,
                                      example=((x[:x.shape[0] // m],), (y[:y.shape[0] // m],)), vocab_parallel=True)
    pipes = loopback_pipes(model, opts, pp)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, m)
    losses = run_pipes(lambda r: pipes[r].step(x, y), pp)
    assert losses == pytest.approx([want] * pp, rel=tol), (losses, want)
    refp = dict(ref.named_parameters())
    for r, pipe in enumerate(pipes):
        for n, p in pipe.named_parameters():
            if p.grad is not None or refp[n].grad is not None:
                assert rel(p.grad, shard_of(refp[n].grad, p, r)) <= tol, f"rank {r} {n}"
    return pipes, ref


def test_vocab_parallel_float64_gradients_are_exact_for_three_microbatches():
    """float64 with vocab_parallel=True and 3 microbatches: every gradient equals eager's to float64 precision.
    (The sharded loss took a float32 gradient seed, so 1/3 was float32's: every gradient was off by 3e-8.)"""
    model, loss_fn, (x, y), _ = gpt(layers=4, batch=6)
    _vocab_step_matches_eager(model.double(), loss_fn, x, y, PP, 3)


def test_a_vocabulary_shard_holding_only_padding_rows():
    """V = 9 over 4 ranks: 3 rows per shard, the last shard all padding. Loss, evaluate() and gradients equal
    eager's (its softmax statistics were NaN: the max of no logits is -inf), and the pipeline-wide norms, which
    count nothing of the empty shard, equal torch's on eager's gradients (the empty shard raised in the inf norm)."""
    case = _untied_gpt(vocab=9, dropout=0.0)
    model, loss_fn, (x, y) = case.model.double(), case.loss_fn, case.example
    x, y = torch.cat([x] * 2), torch.cat([y.flip(0)] * 2)
    pipes, ref = _vocab_step_matches_eager(model, loss_fn, x, y, 4, 4)
    with torch.no_grad():
        want = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(4), y.chunk(4))) / 4
    grads = [p.grad for p in ref.parameters()]
    norms = {q: torch.nn.utils.get_total_norm(grads, q).item() for q in (2.0, math.inf, -math.inf)}
    for out in run_pipes(lambda r: (pipes[r].eval().evaluate(x, y),
                                    {q: pipes[r].get_total_norm(q).item() for q in norms}), 4):
        assert out[0] == pytest.approx(want, rel=1e-12)
        assert out[1] == pytest.approx(norms, rel=1e-12), (out[1], norms)


def test_load_state_dict_takes_the_whole_vocabulary_tables():
    """A vocabulary-parallel pipe loads the plain model's state dict (whole [V, d] tables, V = 61 over 2 ranks),
    each rank keeping its rows: evaluate() and a step then equal eager's on that model, and state_dict() gives
    the rows back. A table of another vocabulary size is still refused by name, before anything is written."""
    from zbcompile.errors import CheckpointError

    case = _untied_gpt(dropout=0.0)
    model, loss_fn, x, y, pipes = _pipes(case, "zbv", dtype=torch.float64, vocab_parallel=True)
    other = _untied_gpt(dropout=0.0).model.double()
    for p in other.parameters():
        torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = sum(loss_fn(other(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
    ref = copy.deepcopy(other)
    want_step = eager_step(ref, loss_fn, x, y, M)
    wrong = {k: v[:60] if k == "wte.weight" else v for k, v in other.state_dict().items()}

    def run(r):
        pipe = pipes[r]
        with pytest.raises(CheckpointError, match="wte.weight"):
            pipe.load_state_dict(wrong, strict=False)
        pipe.load_state_dict(other.state_dict(), strict=False)   # (a rank holds its stages' entries only)
        rows = {k: v.clone() for k, v in pipe.state_dict().items()}
        return pipe.eval().evaluate(x, y), pipe.train().step(x, y), rows

    for r, (got, step, rows) in enumerate(run_pipes(run, PP)):
        assert got == pytest.approx(want, rel=1e-12) and step == pytest.approx(want_step, rel=1e-12)
        for k, v in rows.items():
            assert torch.equal(v, shard_of(other.state_dict()[k], v, r)), (r, k)
    _assert_state_equal(pipes, ref, 1e-12, "after a step from the loaded state")



def test_load_state_dict_strict_false_skips_missing_keys_as_torch_does():
    """A pretrained state dict without the tied head (HuggingFace checkpoints leave `lm_head.weight` out):
    strict=False loads the rest and reports the key missing, as nn.Module.load_state_dict does, and the tied head
    then is the loaded embedding on every rank; strict=True refuses it by name before anything is written."""
    from zbcompile.errors import CheckpointError

    case = gpt(layers=4, batch=8)
    model, loss_fn, x, y, pipes = _pipes(case, dtype=torch.float64)
    pretrained = copy.deepcopy(model)
    for p in pretrained.parameters():
        torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(7))
    sd = {k: v for k, v in pretrained.state_dict().items() if k != "lm_head.weight"}
    eager = copy.deepcopy(model)
    assert eager.load_state_dict(sd, strict=False).missing_keys == ["lm_head.weight"]
    want = eager_step(eager, loss_fn, x, y, M)

    def run(r):
        pipe = pipes[r]
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        with pytest.raises(CheckpointError, match="missing: lm_head.weight"):
            pipe.load_state_dict(sd)
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items()), "strict=True wrote"
        result = pipe.load_state_dict(sd, strict=False)
        return result, pipe.step(x, y)

    for r, (result, loss) in enumerate(run_pipes(run, PP)):
        held = dict(pipes[r].state_dict())
        assert result.missing_keys == (["lm_head.weight"] if "lm_head.weight" in held else []), (r, result)
        assert loss == pytest.approx(want, rel=1e-12), (r, loss, want)
    _assert_state_equal(pipes, eager, 1e-12, "after a step from the loaded state")

def test_ids_and_targets_outside_the_vocabulary_are_refused():
    """vocab_parallel=True: a token id or a target outside [0, V) is looked up by no shard (zeros, a missed
    logit) where eager raises: step, evaluate and pipe(x) refuse it by name on every rank, before anything is
    sent, and the pipe trains normally afterwards. An ignored target (-100) is no such target."""
    def viewed_loss(logits, targets):   # views the targets: the check must hand it contiguous microbatches
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8)._replace(loss_fn=viewed_loss), "zbv",
                                         vocab_parallel=True)
    v = model.wte.num_embeddings
    y = y.clone()
    y[0, 0] = -100

    def run(r):
        pipe = pipes[r]
        with pytest.raises(UsageError, match=f"step: a token id the embedding looks up is \\d+ .*\\[0, {v}\\)"):
            pipe.step(x + v, y)
        wide = torch.cat([y, y], 1)   # targets whose microbatches are strided views (the README's data[:, 1:])
        assert math.isfinite(pipe.evaluate(x, wide[:, :y.shape[1]]))
        with pytest.raises(UsageError, match="evaluate: a target the loss reads is -1 .*not ignore_index=-100"):
            pipe.evaluate(x, y.clamp_min(0) - 1)
        with pytest.raises(UsageError, match="forward: a token id"):
            pipe(x - v)
        return pipe.step(x, y)

    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, M)
    assert run_pipes(run, PP) == pytest.approx([want] * PP, rel=1e-5)


def _shifted_loss(logits, labels):
    """A causal LM's loss as HuggingFace writes it: position t predicts token t + 1."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[..., :-1, :].contiguous().view(-1, v), labels[..., 1:].contiguous().view(-1))


def _shifted_loss_reshaped(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("loss_fn", [_shifted_loss, _shifted_loss_reshaped])
def test_vocab_parallel_takes_a_shifted_causal_lm_loss(loss_fn):
    """The logits sliced to drop the last position, then viewed (after .contiguous()) or reshaped to
    [tokens, V]: the slice and the view are replayed on the layer's input, where the view must copy (it raised
    'cannot view a tensor with shape ...' at compile)."""
    model, _, (x, y), _ = gpt(layers=4, batch=8)
    _vocab_step_matches_eager(model.double(), loss_fn, x, y, PP, M)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_aux_loss_from_every_stage_matches_eager(schedule):
    """A mixture-of-experts model whose loss adds a router load-balancing term computed from every layer's router
    logits (spread over every stage): loss and every gradient equal eager's, the routers' included."""
    torch.manual_seed(1)
    x, y = torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))
    case = type(gpt())(MoE(), moe_loss, (x, y), 4)
    model, loss_fn, x, y, pipes = _pipes(case, schedule)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, M)
    losses = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(loss - want) <= 1e-5 * abs(want) for loss in losses), (losses, want)
    refp = dict(ref.named_parameters())
    graded = set()
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            if refp[n].grad is None:
                assert p.grad is None, n
                continue
            graded.add(n)
            assert rel(p.grad, refp[n].grad) <= 1e-5, n
    routers = {n for n in refp if ".gate." in n or n.endswith(".gate.weight")}
    assert routers and routers <= graded, sorted(routers - graded)


def test_profiler_trace_shows_the_schedule():
    """Under torch.profiler a step runs the program variant with one range per action (`zb:<stage>F<mb>`, B, W)
    and per message; outside a profiler the plain program runs, and both give eager's loss. (A profiler records
    its own thread: rank 0's thread profiles, as each torchrun rank would in its process.)"""
    model, loss_fn, x, y, pipes = _pipes(mlp(layers=4, batch=8), "zb-h1")
    want = eager_step(copy.deepcopy(model), loss_fn, x, y, M)

    def run(r):
        if r:
            return pipes[r].step(x, y), None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss = pipes[r].step(x, y)
        return loss, {e.name for e in prof.events()}

    profiled = run_pipes(run, PP)
    plain = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(loss - want) <= 1e-6 * want for loss in [p[0] for p in profiled] + plain)
    names = profiled[0][1]
    actions = {f"zb:{a}" for a in pipes[0].schedule.ranks[0]}
    assert actions <= names, sorted(actions - names)
    assert {"zb:send", "zb:wait_recv"} <= names
    assert pipes[0].runtime._profiled_program is not None and pipes[1].runtime._profiled_program is None


def _outputs(outs: list) -> tuple[int, object]:
    """(rank, outputs) of the one rank that returned the model's outputs; every other rank returned None."""
    held = [(r, o) for r, o in enumerate(outs) if o is not None]
    assert len(held) == 1, f"the outputs came back on ranks {[r for r, _ in held]}"
    return held[0]


class _Split(torch.autograd.Function):
    """A custom Function with two results: the model's outputs come straight out of it."""

    @staticmethod
    def forward(ctx, x):
        return x * 3, x.sum(-1)

    @staticmethod
    def backward(ctx, g, gs):
        return 3 * g + gs[..., None]


class _EndsInAFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return _Split.apply(x)


def _loss_through_max(out, y):
    return F.mse_loss(out[0].max(-1).values + out[1], y.mean(-1))


def test_forward_returns_outputs_that_come_straight_out_of_a_custom_function():
    """run_decompositions numbers the getitems anew but keeps the call signature's names: pipe(x) looked up the
    Function's result by a name the loss's own getitem then had, and returned the row maxima the loss computes
    (or read the targets: a raw IndexError). It returns eager's outputs."""
    torch.manual_seed(0)
    model = _EndsInAFunction().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    _, _, _, _, pipes = _pipes((model, _loss_through_max, (x, y), None))
    with torch.no_grad():
        want = model(x)
    _, (out, total) = _outputs(run_pipes(lambda r: pipes[r](x), PP))
    assert out.shape == (8, 6) and rel(out, want[0]) <= 1e-12 and rel(total, want[1]) <= 1e-12


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "dualpipev"])
def test_forward_returns_the_model_outputs_in_eval_mode(schedule):
    """pipe(x) after eval() returns what the eager model returns under no_grad in eval mode (dropout in the
    blocks and inside attention off), whole, on the rank that runs the last stage (rank 0 for a V), None on the
    others; no gradient is touched."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, dropout=0.3, batch=8), schedule)
    with torch.no_grad():
        want = copy.deepcopy(model).eval()(x)
    rank, got = _outputs(run_pipes(lambda r: pipes[r].eval()(x), PP))
    assert {rank} == pipes[0].schedule.stage_ranks()[-1], "not the rank of the last stage"
    assert got.shape == want.shape and rel(got, want) <= 1e-6
    assert all(p.grad is None for pipe in pipes for p in pipe.parameters())


def test_forward_in_train_mode_updates_batchnorm_as_eager_does():
    """In train mode pipe(x) is the forward of a training step: BatchNorm normalizes each microbatch by its own
    statistics and updates the running ones, as eager does microbatch by microbatch under no_grad."""
    model, loss_fn, x, y, pipes = _pipes(convnet(blocks=4, batch=8), "zbv")
    ref = copy.deepcopy(model).train()
    with torch.no_grad():
        want = torch.cat([ref(xb) for xb in x.chunk(M)])
    _, got = _outputs(run_pipes(lambda r: pipes[r].train()(x), PP))
    assert rel(got, want) <= 1e-6
    _assert_state_equal(pipes, ref, 1e-6, "after a train-mode forward")


def test_forward_rebuilds_an_output_tree_with_a_scalar_per_microbatch():
    """A model returning (logits, aux_loss): the logits come back concatenated over microbatches, the 0-dim
    auxiliary loss as one value per microbatch, each equal to eager's on that microbatch."""
    torch.manual_seed(1)
    x, y = torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))
    model, loss_fn, x, y, pipes = _pipes(type(gpt())(MoE(), moe_loss, (x, y), 4), "1f1b")
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = [ref(xb) for xb in x.chunk(M)]
    _, (logits, aux) = _outputs(run_pipes(lambda r: pipes[r].eval()(x), PP))
    assert rel(logits, torch.cat([w[0] for w in want])) <= 1e-6
    assert aux.shape == (M,) and rel(aux, torch.stack([w[1] for w in want])) <= 1e-6


class _TimeMajor(torch.nn.Module):
    """Batch-major inputs [B, T], outputs time-major [T, B, V] (as an nn.LSTM or nn.Transformer with
    batch_first=False returns them), flattened batch-major logits [B * T, V], or a value with no row dim: one from
    the position table alone, or a mean over the batch (T = 5, 13 features: no multiple of 3-row microbatches)."""

    def __init__(self, out: str = "time") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 13)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(13, 13) for _ in range(4)])
        self.head = torch.nn.Linear(13, 32)
        self.pos = torch.nn.Parameter(torch.randn(5, 13))
        self.out = out

    def forward(self, ids):
        x = self.emb(ids) + self.pos
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        logits = self.head(x)
        if self.out == "flat":
            return logits.flatten(0, 1)
        logits = logits.transpose(0, 1)
        if self.out == "time":
            return logits
        return logits, (self.pos * 2.0 if self.out == "table" else x.mean((0, 1)))


def _time_major_loss(out, y):
    if isinstance(out, torch.Tensor) and out.dim() == 2:   # flattened batch-major
        return F.cross_entropy(out, y.flatten())
    logits = out if isinstance(out, torch.Tensor) else out[0]
    extra = 0.0 if isinstance(out, torch.Tensor) else out[1].pow(2).mean()
    return F.cross_entropy(logits.transpose(0, 1).flatten(0, 1), y.flatten()) + extra


@pytest.mark.parametrize("out", ["time", "flat", "table", "mean"])
def test_forward_puts_a_time_major_output_together_on_its_batch_dim_and_refuses_one_with_no_row_dim(out):
    """pipe(x) concatenated every output on dim 0: time-major logits [T, rows, V] came back [M*T, rows, V], a
    value made from the position table [5, 13] came back [M*5, 13], a batch mean [13] came back [M*13], each with
    no word (probe 39). A time-major output is now put together on its one dim of the microbatch's rows, as
    model(x) returns it, flattened batch-major logits still on dim 0; an output with no row dim is refused by
    its index."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 32, (3 * M, 5), generator=g), torch.randint(0, 32, (3 * M, 5), generator=g)
    model, _, x, y, pipes = _pipes(type(gpt())(_TimeMajor(out), _time_major_loss, (x, y), 4), "1f1b")
    if out in ("table", "mean"):
        with pytest.raises(UsageError, match=r"output tensor 1 has shape .* of 3 rows.* not per row"):
            run_pipes(lambda r: pipes[r].eval()(x), PP)
        return
    with torch.no_grad():
        want = copy.deepcopy(model).eval()(x)
    _, got = _outputs(run_pipes(lambda r: pipes[r].eval()(x), PP))
    assert got.shape == want.shape == ((5, 3 * M, 32) if out == "time" else (3 * M * 5, 32)) and rel(got, want) <= 1e-6


class _Contrastive(torch.nn.Module):
    """CLIP's pattern: two encoders and the learned temperature, returned itself for the loss to read."""

    def __init__(self) -> None:
        super().__init__()
        self.enc_a = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        self.enc_b = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        self.logit_scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, a, b):
        return F.normalize(self.enc_a(a), dim=-1), F.normalize(self.enc_b(b), dim=-1), self.logit_scale


def _contrastive_loss(out, labels):
    za, zb, scale = out
    logits = za @ zb.t() * scale.exp()
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@pytest.mark.fresh_split   # the output tree is read from this model's own trace
def test_forward_returns_a_parameter_the_model_returns_itself():
    """pipe(a, b) of a model returning its logit_scale Parameter (which the loss reads) was refused as "the
    loss does not read every output": export's signature also names a parameter for a dead output, and every
    parameter leaf was taken for one. A parameter the forward returned itself comes back as eager's does, once,
    not once per microbatch; the encoders' outputs are eager's."""
    torch.manual_seed(0)
    model = _Contrastive().double()
    a, b = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    labels = torch.arange(2).repeat(4)
    pipes = loopback_pipes(model, CompileOptions(schedule="1f1b", microbatches=M, loss_fn=_contrastive_loss,
                                                 example=((a[:2], b[:2]), labels[:2])), PP)
    ref = copy.deepcopy(model)
    _, (za, zb, scale) = _outputs(run_pipes(lambda r: pipes[r](a, b), PP))
    want = ref(a, b)
    assert rel(za, want[0]) <= 1e-12 and rel(zb, want[1]) <= 1e-12
    assert isinstance(scale, torch.nn.Parameter) and scale.shape == () and float(scale) == 1.5


def test_a_dict_batch_is_passed_by_keyword_in_any_order():
    """With the example's inputs as a dict, step(*batch.values()) bound by the dict's order, which a collator
    need not keep (the mask went in as the ids, silently), and step(**batch) raised torch's TypeError. step,
    evaluate and pipe(x) take the inputs by the example's names now, in any order, and equal eager's; a name
    missing or unknown is refused, naming the example's."""
    from support.models import keyword_lm

    model, loss_fn, ((inputs, (tgt,))), _ = keyword_lm(batch=2 * M)
    model = model.double()
    mask = inputs["attention_mask"].double()
    ids = inputs["input_ids"]
    example = ({"input_ids": ids[:2], "attention_mask": mask[:2]}, (tgt[:2],))
    pipes = loopback_pipes(model, CompileOptions(schedule="1f1b", microbatches=M, loss_fn=loss_fn,
                                                 example=example), PP)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        want = sum(float(loss_fn(ref(input_ids=i, attention_mask=m), t))
                   for i, m, t in zip(ids.chunk(M), mask.chunk(M), tgt.chunk(M))) / M
    batch = {"attention_mask": mask, "input_ids": ids}   # not the example's order
    got = run_pipes(lambda r: pipes[r].evaluate(tgt, **batch), PP)
    assert all(abs(g - want) <= 1e-12 * want for g in got), (got, want)
    got = run_pipes(lambda r: pipes[r].step(tgt, **batch), PP)
    assert all(abs(g - want) <= 1e-12 * want for g in got), (got, want)
    _, logits = _outputs(run_pipes(lambda r: pipes[r].eval()(**batch), PP))
    with torch.no_grad():
        assert rel(logits, ref(input_ids=ids, attention_mask=mask)) <= 1e-12
    with pytest.raises(UsageError, match=r"named as the example's: \['input_ids', 'attention_mask'\] \(missing "
                                         r"\['attention_mask'\]; not in the example \['labels'\]\)"):
        pipes[0].step(tgt, input_ids=ids, labels=tgt)


class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        return {"out": self.body(x), "rows": x.shape[0]}


def test_forward_says_that_python_numbers_in_the_outputs_are_the_traces():
    """A model returning a Python number read off its input's shape: pipe(x) returned the example microbatch's
    (2) where eager's whole batch gives 8, without a word. The tensors come back as eager's; the number is said
    to be the trace's, once."""
    torch.manual_seed(0)
    model = _Counted().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipes = loopback_pipes(model, CompileOptions(schedule="1f1b", microbatches=M, loss_fn=lambda o, y: F.mse_loss(
        o["out"], y), example=(x[:2], x[:2])), PP)
    with pytest.warns(UserWarning, match=r"Python numbers \(leaf 1: 2\).*one microbatch of the example"):
        _, got = _outputs(run_pipes(lambda r: pipes[r](x), PP))
    assert rel(got["out"], model(x)["out"]) <= 1e-12 and got["rows"] == 2


def _untied_gpt(vocab: int = 61, dropout: float = 0.3):
    """The tests' GPT with a head of its own over `vocab` tokens (61: the last vocabulary shard is padded)."""
    case = gpt(layers=4, batch=8)
    cfg = case.model.cfg
    torch.manual_seed(3)
    model = type(case.model)(type(cfg)(vocab=vocab, seq=cfg.seq, d=cfg.d, heads=cfg.heads, layers=4,
                                       dropout=dropout))
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach() * 0.5)
    x, y = case.example
    return case._replace(model=model, example=(x % vocab, y % vocab))


@pytest.mark.parametrize("schedule,tied", [("1f1b", False), ("zbv", True), ("interleaved-1f1b", False),
                                           ("dualpipev", False)])
def test_forward_with_vocabulary_parallelism_returns_the_whole_logits(schedule, tied):
    """pipe(x) of a vocabulary-parallel model: the output layer runs whole on the rank of the last stage, its
    weight all-gathered from every rank's rows (the padding rows of the last shard dropped), so the logits equal
    eager's, [batch, seq, V], in eval mode; in train mode dropout draws. A tied table and an untied head over
    61 tokens (not a multiple of the ranks)."""
    case = gpt(layers=4, batch=8, dropout=0.3) if tied else _untied_gpt()
    model, loss_fn, x, y, pipes = _pipes(case, schedule, vocab_parallel=True)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = ref(x)
    outs = run_pipes(lambda r: (pipes[r].eval()(x), pipes[r].train()(x)), PP)
    rank, got = _outputs([o[0] for o in outs])
    assert {rank} == pipes[0].schedule.stage_ranks()[-1], "not the rank of the last stage"
    assert got.shape == want.shape and rel(got, want) <= 1e-5
    drawn = outs[rank][1]
    assert drawn.shape == want.shape and rel(drawn, want) > 1e-3, "train mode: dropout did not draw"
    assert all(p.grad is None for pipe in pipes for p in pipe.parameters())


def test_forward_where_the_loss_casts_and_compares_the_targets():
    """pipe(x) for a loss that casts its targets (`y.float()`: export puts a metadata check on them beside the
    cast) and masks with them: the forward returning the outputs reads no targets (it asked for them, and
    failed with an IndexError)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8, 8))

    def loss_fn(out, t):
        mask = (t != 0).float()
        return (F.binary_cross_entropy_with_logits(out, t.float(), reduction="none") * mask).sum() / mask.sum()

    model, loss_fn, x, y, pipes = _pipes(type(gpt())(net, loss_fn, (x, y), 4), "zbv")
    with torch.no_grad():
        want = copy.deepcopy(model).eval()(x)
    _, got = _outputs(run_pipes(lambda r: pipes[r].eval()(x), PP))
    assert rel(got, want) <= 1e-6


class _TwoHeads(torch.nn.Module):
    """Returns (main, side); the loss reads only `main`, so the traced step never computes `side`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.side = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h), self.side(h)


class _WithPredictions(torch.nn.Module):
    """Returns (logits, their argmax): the loss reads only the logits; the predictions come from a plain op."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        out = self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))
        return out, out.argmax(-1)



@dataclasses.dataclass
class _Unregistered:
    logits: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass
class _Registered:
    logits: torch.Tensor
    aux: torch.Tensor


torch.export.register_dataclass(_Registered)


class _DataclassOut(torch.nn.Module):
    """Returns its outputs as a dataclass (`kind`), as many model libraries do."""

    def __init__(self, kind) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.c, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.c(torch.tanh(self.a(x))))
        return self.kind(self.b(h), h.pow(2).mean())


def _dataclass_loss(out, t):
    return F.mse_loss(out.logits, t) + 0.1 * out.aux


def test_a_dataclass_output_trains_and_comes_back_once_registered():
    """A model returning a dataclass trains as eager does whether or not torch's pytree knows the class; pipe(x)
    needs the class registered (the trace keeps the call signature only then) and says so, naming
    torch.export.register_dataclass; registered, it returns the dataclass with the microbatches concatenated
    and the 0-dim leaf one value per microbatch."""
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    for kind in (_Unregistered, _Registered):
        case = type(gpt())(_DataclassOut(kind).double(), _dataclass_loss, (x, y), 4)
        model, loss_fn, x, y, pipes = _pipes(case)
        ref = copy.deepcopy(model)
        want = eager_step(ref, loss_fn, x, y, M)
        losses = run_pipes(lambda r: pipes[r].step(x, y), PP)
        assert all(abs(loss - want) <= 1e-12 * abs(want) for loss in losses), (kind, losses, want)
        _assert_state_equal(pipes, ref, 1e-10, kind.__name__)
        if kind is _Unregistered:
            with pytest.raises(UsageError, match=r"torch\.export\.register_dataclass"):
                pipes[0].eval()(x)
            continue
        outs = run_pipes(lambda r: pipes[r].eval()(x), PP)
        got = next(o for o in outs if o is not None)
        assert isinstance(got, _Registered) and outs.count(None) == PP - 1, outs
        with torch.no_grad():
            parts = [model(part) for part in x.chunk(M)]
        assert rel(got.logits, torch.cat([p.logits for p in parts])) <= 1e-12
        assert rel(got.aux, torch.stack([p.aux for p in parts])) <= 1e-12

@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_an_output_the_loss_does_not_read_made_by_a_plain_op_trains_as_eager(schedule):
    """`return logits, logits.argmax(-1)`: the decompositions drop the dead argmax, which failed the trace with
    torch's SpecViolationError (the model's call signature named it). It trains as eager does; `pipe(x)` is
    refused, as for any output the loss does not read, and says so (it gave the key-value cache hint)."""
    case = type(gpt())(_WithPredictions(), lambda out, t: F.mse_loss(out[0], t),
                       (torch.randn(8, 16), torch.randn(8, 4)), 4)
    model, loss_fn, x, y, pipes = _pipes(case, schedule, dtype=torch.float64)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, M)
    losses = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(loss - want) <= 1e-12 * abs(want) for loss in losses), (losses, want)
    _assert_state_equal(pipes, ref, 1e-10, schedule)
    with pytest.raises(UsageError, match="does not read every output") as info:   # not a key-value cache hint
        pipes[0].eval()(x)
    assert "use_cache" not in str(info.value)


class _LogitsAux(torch.nn.Module):
    """(logits, aux): the loss is cross_entropy(logits) + 0.1 * aux, with fewer modules than a V's stages."""

    def __init__(self, d: int = 16, vocab: int = 11) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(d, d), torch.nn.Linear(d, d), torch.nn.Linear(d, vocab)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        return self.head(torch.tanh(h)), h.pow(2).mean()


def _logits_aux_loss(out, y):
    logits, aux = out
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.1 * aux


def test_an_output_made_on_an_earlier_stage_than_the_loss_is_refused_by_its_name():
    """zbv's automatic split of a 3-layer model cuts between the cross-entropy and the `+ aux`: pipe(x) refused
    the logits naming the traced node ('linear_2'). It names the output as the user indexes it and the stage that
    computes it; cut before the loss's ops (1f1b) and pipe(x) returns eager's outputs (fuzzing, probe 24)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, 16, dtype=torch.float64), torch.randint(0, 11, (8, 4))
    case = type(gpt())(_LogitsAux().double(), _logits_aux_loss, (x, y), 4)
    _, _, _, _, pipes = _pipes(case, "zbv")
    with pytest.raises(UsageError, match=r"model output output\[0\] \(traced as '\w+'\) is computed on stage \d, "
                                         r"not on the loss stage \(stage 3\)"):
        pipes[0].eval()(x)
    model, _, _, _, pipes = _pipes(case, "1f1b")
    outs = run_pipes(lambda r: pipes[r].eval()(x), PP)
    with torch.no_grad():   # the aux (0-dim) once per microbatch
        want = model.eval()(x)[0], torch.stack([model(xc)[1] for xc in x.chunk(M)])
    got = next(o for o in outs if o is not None)
    assert rel(got[0], want[0]) <= 1e-12 and rel(got[1], want[1]) <= 1e-12


class _ScaledOutput(torch.nn.Module):
    """Returns (features, temperature): the parameter itself, which the loss reads through exp() (CLIP's
    logit_scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(6)])
        self.temp = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, self.temp


def test_a_returned_parameter_the_loss_stage_does_not_hold_is_refused_by_name():
    """zbv on 4 ranks cuts between temp.exp() and the loss: pipe(x) was refused saying the parameter "is computed
    on stage ?". It now says the output is the parameter itself, which stage reads it, and the ways out, on every
    rank."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    opts = CompileOptions.from_kwargs(None, schedule="zbv", microbatches=8, example=((x[:2],), (y[:2],)),
                                      loss_fn=lambda out, t: F.mse_loss(out[0] * out[1].exp(), t))
    pipes = loopback_pipes(_ScaledOutput().double(), opts, 4)

    def call(r):
        with pytest.raises(UsageError, match=r"output output\[1\] is the model's temp itself, which stage \d reads "
                                             r"but the loss stage \(stage 7\) does not"):
            pipes[r].eval()(x)

    run_pipes(call, 4)


def test_forward_is_refused_where_the_outputs_cannot_come_back_whole():
    """Our errors, before any message is sent: DualPipe ends in a copy of the last stage on both ranks (with
    vocabulary parallelism too), an output the loss never reads is never computed; and pipe(x, y)
    (targets handed to forward) is named as such."""
    cases = [(mlp(layers=4, batch=8), "dualpipe", {}, "runs the last stage on ranks"),
             (gpt(layers=4, batch=8), "dualpipe", {"vocab_parallel": True}, "runs the last stage on ranks"),
             (type(gpt())(_TwoHeads(), lambda out, t: F.mse_loss(out[0], t),
                          (torch.randn(8, 16), torch.randn(8, 4)), 4), "1f1b", {}, "does not read every output")]
    for case, schedule, options, message in cases:
        model, loss_fn, x, y, pipes = _pipes(case, schedule, **options)
        with pytest.raises(UsageError, match=message):
            pipes[0].eval()(x)
    with pytest.raises(UsageError, match=r"forward\(\) takes 1 model input\(s\) \(no targets\)"):
        pipes[0](x, y)
    with pytest.raises(UsageError, match=r"by position.*keyword arguments \['x'\]"):
        pipes[0](x=x)
