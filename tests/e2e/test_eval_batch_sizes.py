"""evaluate() and pipe(x) on batches of another size than the training step's: any number of microbatches of the
example's shape (a last, smaller batch of an evaluation set; an evaluation batch larger than the training one),
each against eager on the same model (every rank a thread: support.threaded.loopback_pipes). step() keeps the
compiled size. The pipeline is compiled for 4 microbatches of 2 rows; the evaluation batches hold 1, 3 and 6.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from support.loops import rel
from support.models import convnet, gpt
from support.threaded import loopback_pipes, run_pipes
from zbcompile.errors import UsageError
from zbcompile.options import CompileOptions
from zbcompile.pipeline_eval import FORWARD_SIZES

pytestmark = pytest.mark.slow
PP, M, ROWS = 2, 4, 2
TOL = 1e-10


def _compiled(case, schedule: str, **options):
    """(model, loss_fn, pipes): case's model in float64 compiled for M microbatches of ROWS rows on PP ranks."""
    model, loss_fn, (x, y), _ = case
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    opts = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=M, loss_fn=loss_fn,
                                      example=((x[:ROWS],), (y[:ROWS],)), **options)
    return model, loss_fn, loopback_pipes(model, opts, PP)


def _batch(case, k: int, seed: int):
    """k microbatches' worth of rows shaped like the case's example."""
    x, y = case.example
    g = torch.Generator().manual_seed(seed)
    if x.is_floating_point():
        xb = torch.randn((k * ROWS, *x.shape[1:]), generator=g, dtype=torch.float64)
    else:
        xb = torch.randint(0, 64, (k * ROWS, *x.shape[1:]), generator=g)
    return xb, torch.randint(0, 5 if y.dim() == 1 else 64, (k * ROWS, *y.shape[1:]), generator=g)


def _eager_loss(model, loss_fn, x, y) -> float:
    """The pipeline's evaluation semantics in eager: the mean of the microbatches' losses, under no_grad."""
    with torch.no_grad():
        parts = [loss_fn(model(xc), yc).item() for xc, yc in zip(x.split(ROWS), y.split(ROWS))]
    return sum(parts) / len(parts)


@pytest.mark.parametrize("schedule,vocab", [("1f1b", False), ("zbv", False), ("interleaved-1f1b", False),
                                            ("zb-h1", True)])
def test_evaluate_and_forward_take_any_number_of_microbatches(schedule, vocab):
    """After a training step, in eval mode: evaluate() on 1, 3 and 6 microbatches equals eager's loss, and pipe(x)
    returns eager's logits on the rank that runs the loss stage (None on the other); the compiled size still
    does, and the sizes do not disturb each other (each size twice, in turns)."""
    case = gpt(layers=4, batch=M * ROWS)
    model, loss_fn, pipes = _compiled(case, schedule, vocab_parallel=vocab)
    ref = copy.deepcopy(model)
    x, y = case.example
    run_pipes(lambda r: pipes[r].step(x, y), PP)
    for xc, yc in zip(x.split(ROWS), y.split(ROWS)):   # eager's step: the microbatches' mean loss
        (loss_fn(ref(xc), yc) / M).backward()
    ref.eval()
    batches = {k: _batch(case, k, seed=k) for k in (1, 3, M, 6)}
    for k in (1, 3, M, 6, 3, 1):
        xb, yb = batches[k]
        want = _eager_loss(ref, loss_fn, xb, yb)
        got = run_pipes(lambda r: pipes[r].eval().evaluate(xb, yb), PP)
        assert all(abs(g - want) <= TOL * abs(want) for g in got), (k, got, want)
        outs = run_pipes(lambda r: pipes[r](xb), PP)
        with torch.no_grad():
            logits = ref(xb)
        mine = [o for o in outs if o is not None]
        assert len(mine) == 1 and rel(mine[0], logits) <= TOL, (k, [o is None for o in outs])


def test_batchnorm_in_train_mode_and_eval_mode_at_another_size():
    """A convnet with BatchNorm: evaluate() in train mode on 3 microbatches updates the running statistics as
    eager's no_grad forwards of the same 3 microbatches do, and evaluate() in eval mode then reads them."""
    case = convnet(blocks=4, batch=M * ROWS)
    model, loss_fn, pipes = _compiled(case, "1f1b")
    ref = copy.deepcopy(model)
    xb, yb = _batch(case, 3, seed=5)
    got = run_pipes(lambda r: pipes[r].evaluate(xb, yb), PP)
    want = _eager_loss(ref, loss_fn, xb, yb)   # train mode: each microbatch's statistics, the running ones moved
    assert all(abs(g - want) <= TOL * abs(want) for g in got), (got, want)
    buffers = dict(ref.named_buffers())
    for r, pipe in enumerate(pipes):
        for n, b in pipe.named_buffers():
            assert rel(b.double(), buffers[n].double()) <= TOL, (r, n)
    ref.eval()
    xe, ye = _batch(case, 6, seed=6)
    got = run_pipes(lambda r: pipes[r].eval().evaluate(xe, ye), PP)
    want = _eager_loss(ref, loss_fn, xe, ye)
    assert all(abs(g - want) <= TOL * abs(want) for g in got), (got, want)


def test_dualpipe_evaluates_an_odd_number_of_microbatches():
    """DualPipe's two mirrored pipelines split 3 microbatches 1 and 2, each through its own direction."""
    case = gpt(layers=4, batch=M * ROWS)
    model, loss_fn, pipes = _compiled(case, "dualpipe")
    xb, yb = _batch(case, 3, seed=3)
    want = _eager_loss(model, loss_fn, xb, yb)
    got = run_pipes(lambda r: pipes[r].evaluate(xb, yb), PP)
    assert all(abs(g - want) <= TOL * abs(want) for g in got), (got, want)


def test_other_sizes_are_refused_with_what_the_call_takes_and_few_are_kept():
    """A batch that is no multiple of the example's rows, or of another sequence length, is refused naming what
    evaluate() takes; step() still takes only the compiled size. Evaluating at many sizes keeps only the last
    FORWARD_SIZES of them besides the compiled one (each holds its static buffers)."""
    case = gpt(layers=4, batch=M * ROWS)
    model, loss_fn, pipes = _compiled(case, "1f1b")
    x, y = case.example

    def refused(r):   # on every rank alike (a call refused on one rank only puts the ranks out of step)
        with pytest.raises(UsageError, match=r"has 5 rows, which do not split into 4 equal microbatches; "
                                             r"evaluate\(\) takes any multiple of the example's 2 rows"):
            pipes[r].evaluate(x[:5], y[:5])
        with pytest.raises(UsageError, match=r"microbatches of shape \[2, 4\] .* compiled for microbatches of "
                                             r"shape \[2, 8\] .* forward\(\) takes any multiple of the example's 2 rows"):
            pipes[r](x[:4, :4])
        with pytest.raises(UsageError, match=r"the compiled step takes 4 microbatches of 2 rows \(example's\), a "
                                             r"batch of 8 rows"):
            pipes[r].step(x[:6], y[:6])

    run_pipes(refused, PP)
    pipe = pipes[0]
    sizes = range(1, FORWARD_SIZES + 4)
    for k in sizes:
        xb, yb = _batch(case, k, seed=k)
        want = _eager_loss(model, loss_fn, xb, yb)
        got = run_pipes(lambda r: pipes[r].evaluate(xb, yb), PP)
        assert all(abs(g - want) <= TOL * abs(want) for g in got), (k, got, want)
    kept = {key[2] for key in pipe._forward}
    assert kept == {M, *[k for k in sizes if k != M][-FORWARD_SIZES:]}, kept
    assert len(pipe._runtimes) == 1 + len(pipe._forward), (len(pipe._runtimes), list(pipe._forward))
    # another round makes and drops a program per call (more sizes than are kept): what fx caches of the code it
    # generates (torch.fx.graph_module._loader, for tracebacks) is dropped with them, so a long loop stays flat
    from torch.fx.graph_module import _loader

    cached = len(_loader.eval_cache)
    for k in sizes:
        xb, yb = _batch(case, k, seed=k)
        got = run_pipes(lambda r: pipes[r].evaluate(xb, yb), PP)
        assert all(abs(g - _eager_loss(model, loss_fn, xb, yb)) <= TOL * abs(g) for g in got), (k, got)
    assert len(_loader.eval_cache) <= cached, (len(_loader.eval_cache), cached)


def test_ranks_out_of_step_at_other_sizes_raise_instead_of_waiting_out_the_timeout():
    """Rank 1 alone refuses a batch while rank 0 evaluates 3 microbatches; then both evaluate 5. Their programs
    (3 and 5 microbatches) waited on each other's messages until the timeout, which lost the process groups,
    before the loss gather could compare the calls (probe 26). Every evaluation call is now agreed on first
    (its number and size): both ranks raise DisagreementError at once."""
    from zbcompile.errors import DisagreementError

    case = gpt(layers=4, batch=M * ROWS)
    model, loss_fn, pipes = _compiled(case, "1f1b", timeout=60.0)
    x, y = _batch(case, 5, seed=1)
    run_pipes(lambda r: pipes[r].evaluate(x[:2 * ROWS], y[:2 * ROWS]), PP)

    def run(r):
        if r == 1:
            with pytest.raises(UsageError):
                pipes[r].evaluate(x[:5], y[:5])
        started = time.monotonic()
        with pytest.raises(DisagreementError):
            pipes[r].evaluate(x[:3 * ROWS] if r == 0 else x, y[:3 * ROWS] if r == 0 else y)
            pipes[r].evaluate(x, y)   # (rank 0: its second call meets rank 1's first)
        return time.monotonic() - started

    assert max(run_pipes(run, PP)) < 30


def test_arguments_holding_different_numbers_of_microbatches_are_named():
    """Inputs of 3 microbatches with targets of 2: the refusal said "6 rows do not split into 4 microbatches;
    evaluate() takes any multiple of 2 rows" (probe 26). It names each argument's count now."""
    case = gpt(layers=4, batch=M * ROWS)
    _, _, pipes = _compiled(case, "1f1b")
    x, y = _batch(case, 3, seed=2)

    def run(r):
        with pytest.raises(UsageError, match=r"different numbers of microbatches .*argument 0: 3, argument 1: 2"):
            pipes[r].evaluate(x, y[:2 * ROWS])
    run_pipes(run, PP)


def test_a_size_is_kept_for_every_mode_and_kind_of_call():
    """evaluate() and pipe(x) in both modes at 2 sizes other than the compiled one: 8 programs, kept as 2 sizes
    (the cache counted keys, so alternating them lowered again on every call, probe 26)."""
    case = gpt(layers=4, batch=M * ROWS)
    _, _, pipes = _compiled(case, "1f1b")
    batches = [_batch(case, k, seed=k) for k in (1, 3)]

    def run(r):
        pipe = pipes[r]
        for _ in range(2):
            for training in (True, False):
                pipe.train(training)
                for x, y in batches:
                    pipe.evaluate(x, y)
                    pipe(x)
        return len(pipe._runtimes)

    assert run_pipes(run, PP) == [1 + 8] * PP   # the training step's runtime and 8 evaluation programs, none redone
