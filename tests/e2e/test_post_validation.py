"""Post-validation (zbcompile/post_validation.py): `pipe.step(..., optimizer=, max_norm=, post_validate=True)`
against the synchronous `step(..., optimizer=, max_norm=)`, which is itself checked against eager training.

Every rank is a thread of this process (support.threaded.loopback_pipes, whose messages match first come first
served, as gloo's do); tests/distributed/test_post_validation_dist.py runs the same across processes. The runs
have steps that clip, steps that do not, a NaN step and (float16) an overflowing step, so that optimistic
updates are both kept and rolled back, and the steps after a rollback are run again.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from support.loops import NAN_STEP, batches_with_nan, eager_clipped, eager_step, median_norm, rel
from support.models import gpt, mlp
from support.threaded import loopback_pipes, run_pipes
from zbcompile.compiler import compile_programs, compile_staged
from zbcompile.errors import DisagreementError, UsageError, ZBCompileWarning
from zbcompile.options import CompileOptions
from zbcompile.passes.lower import OffloadChoice
from zbcompile.post_validation import StepResult
from zbcompile.runtime.eager import RankRuntime

pytestmark = pytest.mark.slow
STEPS = 20


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


def _train(model, compiled, batches, pp: int, optimizer=_adamw, **step):
    """Every rank's (losses, state) after training on `batches` with step(..., optimizer=AdamW, **step)."""
    pipes = loopback_pipes(model, compiled.options, pp, compiled=compiled)

    def run(r):
        pipe = pipes[r]
        opt = optimizer(pipe.parameters())
        results = [pipe.step(x, y, optimizer=opt, **step) for x, y in batches]
        pipe.settle()
        state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        return results, state, pipe
    return run_pipes(run, pp)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


CASES = [("1f1b", 2), ("zb-h1", 2), ("zbv", 2), ("1f1b", 4), ("zb-h1", 4), ("zbv", 4), ("zb-h2", 4),
         ("interleaved-1f1b", 2), ("dualpipe", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule,pp", CASES, ids=[f"{s}-pp{p}" for s, p in CASES])
def test_post_validated_training_equals_the_synchronous_step(schedule, pp):
    """20 AdamW steps, max_norm at the median of eager's norms (about half the steps clip) and a NaN step:
    the synchronous step follows eager (float64, 1e-9), and the post-validated one equals it bit for bit on every
    rank: losses, every parameter and the optimizer's effect; the StepResults say which steps clipped and which
    one was skipped, and the clipping and skipped steps are exactly the ones run again."""
    torch.manual_seed(0)
    case = mlp(layers=8, batch=2)
    model = case.model.double()
    case = case._replace(model=model, example=tuple(t.double() for t in case.example))
    m = 2 * pp
    batches = batches_with_nan(case, m)
    max_norm = median_norm(model, case.loss_fn, batches, m)
    want_losses, want_norms, ref = eager_clipped(model, case.loss_fn, batches, m, max_norm)
    options = CompileOptions(schedule=schedule, microbatches=m, loss_fn=case.loss_fn, example=case.example)
    compiled = compile_programs(model, options, pp)

    sync = _train(model, compiled, batches, pp, max_norm=max_norm)
    post = _train(model, compiled, batches, pp, max_norm=max_norm, post_validate=True)
    ref_params = dict(ref.named_parameters())
    clipping = [i for i, n in enumerate(want_norms) if math.isfinite(n) and n > max_norm]
    assert 0 < len(clipping) < STEPS - 1, want_norms
    for r in range(pp):
        (losses, state, _), (results, pv_state, pipe) = sync[r], post[r]
        for got, want in zip(losses, want_losses):
            assert _same(got, want) or abs(got - want) <= 1e-9 * abs(want), (r, losses, want_losses)
        for n, p in state.items():
            if n in ref_params:
                assert rel(p, ref_params[n].detach()) <= 1e-9, f"synchronous, rank {r}: {n}"
        assert all(isinstance(x, StepResult) and x.validated for x in results)
        # the synchronous step's losses are floats carrying the same verdict: which clipped, which was skipped
        assert [i for i, x in enumerate(losses) if x.clipped] == clipping, (r, losses)
        assert [i for i, x in enumerate(losses) if x.skipped] == [NAN_STEP], (r, losses)
        assert all(_same(x.norm, want) or abs(x.norm - want) <= 1e-9 * want for x, want in zip(losses, want_norms))
        assert all(_same(float(x), want) for x, want in zip(results, losses)), (r, results, losses)
        assert state.keys() == pv_state.keys() and all(torch.equal(state[k], pv_state[k]) for k in state), r
        assert [i for i, x in enumerate(results) if x.clipped] == clipping, (r, results)
        assert [i for i, x in enumerate(results) if x.skipped] == [NAN_STEP]
        for x, want in zip(results, want_norms):
            assert _same(x.norm, want) or abs(x.norm - want) <= 1e-9 * want
        assert pipe._pv.boundary.redone == len(clipping) + 1   # a wrong optimistic update: the next step again


def test_what_the_users_loop_does_to_grad_between_post_validated_steps():
    """The update a verdict redoes (a clipping or skipped step) is made from the step's gradients, which a loop
    used to the synchronous step may clear in between: opt.zero_grad() set them to None and the redo stepped on
    nothing, silently. They are held until the verdict now, so clearing or rebinding .grad changes nothing (the
    synchronous step's result, bit for bit); a gradient changed in place is lost, and the next call says so
    before anything runs."""
    torch.manual_seed(0)
    case = mlp(layers=4, batch=2)
    model = case.model.double()
    case = case._replace(model=model, example=tuple(t.double() for t in case.example))
    pp, m = 2, 4
    batches = batches_with_nan(case, m, steps=NAN_STEP + 2)
    max_norm = median_norm(model, case.loss_fn, batches, m)
    compiled = compile_programs(model, CompileOptions(schedule="zbv", microbatches=m, loss_fn=case.loss_fn,
                                                      example=case.example), pp)
    between = [lambda opt, pipe: opt.zero_grad(), lambda opt, pipe: pipe.zero_grad(),
               lambda opt, pipe: [setattr(p, "grad", torch.zeros_like(p)) for p in pipe.parameters()]]

    def loop(post_validate):
        pipes = loopback_pipes(model, compiled.options, pp, compiled=compiled)

        def run(r):
            pipe, results = pipes[r], []
            opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
            for k, (x, y) in enumerate(batches):
                results.append(pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=post_validate))
                between[k % len(between)](opt, pipe)
            pipe.settle()
            return [float(v) for v in results], {k: v.clone() for k, v in pipe.state_dict().items()}, results, opt
        return run_pipes(run, pp)

    sync, post = loop(False), loop(True)
    for r in range(pp):
        assert _same_list(sync[r][0], post[r][0]), (r, sync[r][0], post[r][0])
        assert all(torch.equal(sync[r][1][k], post[r][1][k]) for k in sync[r][1]), r
    assert any(x.clipped for x in post[0][2]) and post[0][2][NAN_STEP].skipped

    pipes = loopback_pipes(model, compiled.options, pp, compiled=compiled)

    def in_place(r):
        pipe, (x, y) = pipes[r], batches[0]
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=True)
        before = {k: v.clone() for k, v in pipe.named_parameters()}
        opt.zero_grad(set_to_none=False)
        with pytest.raises(UsageError, match=r"changed in place after a post-validated step.*leave \.grad"):
            pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=True)   # every rank: none waits
        assert all(torch.equal(before[k], v) for k, v in pipe.named_parameters())

    run_pipes(in_place, pp)


def test_a_post_validated_step_refused_on_one_rank_only_is_found_at_its_verdict():
    """Rank 1 refuses one batch (a wrong shape) and its loop goes on to the next, while rank 0 steps it: every
    later step paired two different batches, silently, where the synchronous step's loss gather compares the
    ranks' call numbers. The prefix chain carries them now: the mixed step's verdict raises DisagreementError on
    both ranks, and its update is not applied (the parameters are those after the last agreed step)."""
    torch.manual_seed(0)
    case = mlp(layers=4, batch=2)
    pp, m = 2, 4
    batches = batches_with_nan(case, m, steps=5)
    compiled = compile_programs(case.model, CompileOptions(schedule="1f1b", microbatches=m, loss_fn=case.loss_fn,
                                                           example=case.example), pp)
    pipes = loopback_pipes(case.model, compiled.options, pp, compiled=compiled)

    def run(r):
        pipe, before = pipes[r], None
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for k, (x, y) in enumerate(batches):
            if k == 2:   # the last agreed step validated, on both ranks
                pipe.settle()
                before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
            if r == 1 and k == 2:
                with pytest.raises(UsageError):
                    pipe.step(x[:-1], y[:-1], optimizer=opt, post_validate=True)
                continue
            try:
                pipe.step(x, y, optimizer=opt, post_validate=True)   # validates the step before, in its program
            except DisagreementError as e:
                return k, str(e), before, {n: p.detach().clone() for n, p in pipe.named_parameters()}
        return None

    results = run_pipes(run, pp)
    assert all(res is not None and "out of step" in res[1] and "not applied" in res[1] for res in results), results
    # rank 0's call 3 (batch 2) ran with rank 1's call 4 (batch 3); the next call of each validated it
    assert [res[0] for res in results] == [3, 4]
    for _, _, before, after in results:
        assert all(torch.equal(before[n], after[n]) for n in before)


def _same_list(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _eager(model, loss_fn, batches, m: int, max_norm: float, norm_type: float):
    """eager_clipped with clip_grad_norm_ of `norm_type`: losses, norms and the trained copy."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    losses, norms = [], []
    for x, y in batches:
        losses.append(eager_step(ref, loss_fn, x, y, m))
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)))
        if math.isfinite(norms[-1]):
            opt.step()
        opt.zero_grad()
    return losses, norms, ref


@pytest.mark.parametrize("norm_type", [-math.inf, 3.0])
def test_other_norm_orders_through_the_prefix_chain(norm_type):
    """step(..., max_norm=, norm_type=-inf) clips by torch's -inf norm, the min |g| over every gradient: the prefix
    chain merges the ranks' minima (they shrink along the chain, so a prefix over max_norm proves nothing: the
    rank waits for the totals). pp=4, 12 steps, max_norm at the median of eager's norms, a NaN step: the
    synchronous step follows eager (norms, clipping, parameters), the post-validated one equals it bit for bit.
    3.0: a sum of cubes, through the same chain."""
    torch.manual_seed(0)
    case = mlp(layers=8, batch=2)
    model = case.model.double()
    case = case._replace(model=model, example=tuple(t.double() for t in case.example))
    pp, m = 4, 8
    batches = batches_with_nan(case, m, steps=12)
    # the median norm, and clip's 1e-6 on top: min |g| is far below 1e-6 here, and a step clips where its norm
    # is over the median
    max_norm = sorted(n for n in _eager(model, case.loss_fn, batches, m, math.inf, norm_type)[1]
                      if math.isfinite(n))[5] + 1e-6
    want_losses, want_norms, ref = _eager(model, case.loss_fn, batches, m, max_norm, norm_type)
    clipping = [i for i, n in enumerate(want_norms) if math.isfinite(n) and max_norm / (n + 1e-6) < 1]
    assert 0 < len(clipping) < len(batches) - 1, want_norms
    options = CompileOptions(schedule="1f1b", microbatches=m, loss_fn=case.loss_fn, example=case.example)
    compiled = compile_programs(model, options, pp)
    sync = _train(model, compiled, batches, pp, max_norm=max_norm, norm_type=norm_type)
    post = _train(model, compiled, batches, pp, max_norm=max_norm, norm_type=norm_type, post_validate=True)
    ref_params = dict(ref.named_parameters())
    for r in range(pp):
        (losses, state, _), (results, pv_state, _) = sync[r], post[r]
        assert all(_same(a, b) or abs(a - b) <= 1e-9 * abs(b) for a, b in zip(losses, want_losses)), r
        assert all(rel(p, ref_params[n].detach()) <= 1e-9 for n, p in state.items() if n in ref_params), r
        assert all(_same(float(x), want) for x, want in zip(results, losses)), (r, results, losses)
        assert all(torch.equal(state[k], pv_state[k]) for k in state), r
        assert all(_same(x.norm, n) or abs(x.norm - n) <= 1e-9 * n for x, n in zip(results, want_norms)), r
        assert [i for i, x in enumerate(results) if x.clipped] == clipping
        assert [i for i, x in enumerate(results) if x.skipped] == [NAN_STEP]


@pytest.mark.parametrize("variant", ["vocab", "offload"])
def test_post_validation_with_vocabulary_parallelism_and_offload(variant):
    """The GPT with its vocabulary layers sharded over the ranks (1f1b), or zbv with every saved activation
    offloaded to the host pool: the warm-up's vocabulary collectives and offload copies are part of what a
    rollback runs again. float32, clipping on every step: bit for bit the synchronous step's."""
    case = gpt(layers=4, batch=1)
    pp, m = 2, 4
    x, y = case.example
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 50, (m * t.shape[0], *t.shape[1:]), generator=g) for t in (x, y))
               for _ in range(6)]
    options = CompileOptions(schedule="1f1b" if variant == "vocab" else "zbv", microbatches=m, loss_fn=case.loss_fn,
                             example=case.example, vocab_parallel=variant == "vocab")
    compiled = compile_programs(case.model, options, pp)
    if variant == "offload":
        compiled = compile_staged(compiled.staged, compiled.schedule, options,
                                  offload_choices=(OffloadChoice(min_bytes=0),) * pp)
        assert all(q.host_buffers for q in compiled.programs)
    sync = _train(case.model, compiled, batches, pp, max_norm=1.0)
    post = _train(case.model, compiled, batches, pp, max_norm=1.0, post_validate=True)
    for r in range(pp):
        assert [float(x) for x in post[r][0]] == sync[r][0]
        assert all(torch.equal(sync[r][1][k], post[r][1][k]) for k in sync[r][1])
        assert post[r][2]._pv.boundary.redone == sum(x.clipped for x in post[r][0]) > 0


def test_a_batch_sliced_from_a_larger_tensor_trains_post_validated():
    """`x, y = tokens[:, :-1], tokens[:, 1:]` (the README's loop): the inputs are not contiguous, and the graphs
    were traced with contiguous ones (the GPT views them): both steps take them, with the same results."""
    case = gpt(layers=4, batch=1)
    pp, m = 2, 4
    x, _ = case.example
    tokens = torch.randint(0, 50, (3, m * x.shape[0], x.shape[1] + 1), generator=torch.Generator().manual_seed(0))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    assert not batches[0][0].is_contiguous()
    options = CompileOptions(schedule="zbv", microbatches=m, loss_fn=case.loss_fn, example=case.example)
    compiled = compile_programs(case.model, options, pp)
    sync = _train(case.model, compiled, batches, pp, max_norm=1.0)
    post = _train(case.model, compiled, batches, pp, max_norm=1.0, post_validate=True)
    for r in range(pp):
        assert [float(x) for x in post[r][0]] == sync[r][0]
        assert all(torch.equal(sync[r][1][k], post[r][1][k]) for k in sync[r][1])


INVERSES = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
            "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
            "sgd-dampened": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.01),
            # a float32 tensor lr: the step rounds lr / bc1 and 1 - lr * wd in float32, and the inverse must too
            "adamw-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01), weight_decay=0.1)}


@pytest.mark.parametrize("schedule,pp", [("zbv", 2), ("1f1b", 4)])
@pytest.mark.parametrize("name", list(INVERSES))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)], ids=["float64", "float32"])
def test_closed_form_rollback_follows_the_synchronous_step(schedule, pp, name, dtype, tol):
    """post_validate="inverse": a wrong optimistic update undone in closed form from the state after it and the
    gradient (zbcompile/rollback.py), no snapshot. 20 steps, half of them clipping, a NaN step: losses and
    parameters within rounding of the synchronous step (float64 1e-12, float32 1e-6), the clipped and skipped
    steps the same ones, and the memory plan holds no snapshot."""
    torch.manual_seed(0)
    case = mlp(layers=8, batch=2)
    case = case._replace(model=case.model.to(dtype), example=tuple(t.to(dtype) for t in case.example))
    m = 2 * pp
    batches = batches_with_nan(case, m)
    max_norm = median_norm(case.model, case.loss_fn, batches, m)
    options = CompileOptions(schedule=schedule, microbatches=m, loss_fn=case.loss_fn, example=case.example)
    compiled = compile_programs(case.model, options, pp)
    sync = _train(case.model, compiled, batches, pp, INVERSES[name], max_norm=max_norm)
    post = _train(case.model, compiled, batches, pp, INVERSES[name], max_norm=max_norm, post_validate="inverse")
    for r in range(pp):
        (losses, state, _), (results, pv_state, pipe) = sync[r], post[r]
        assert all(_same(float(x), want) or abs(float(x) - want) <= tol * abs(want) for x, want in
                   zip(results, losses)), (r, results, losses)
        assert all(rel(pv_state[k], state[k]) <= tol for k in state), r
        assert sum(x.clipped for x in results) > 2 and [i for i, x in enumerate(results) if x.skipped] == [NAN_STEP]
        assert pipe._pv.boundary.snapshot_bytes == 0


_LR = torch.optim.lr_scheduler
SCHEDULED = {   # an optimizer and a scheduler that changes its hyperparameters after every step
    "sgd-lambda": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                   lambda opt: _LR.LambdaLR(opt, lambda k: (1.0, 3.0, 0.1, 2.0, 0.5)[k % 5])),
    "sgd-onecycle": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),   # lr and momentum
                     lambda opt: _LR.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)),
    "adamw-steplr": (lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
                     lambda opt: _LR.StepLR(opt, step_size=1, gamma=0.8)),
    "adamw-onecycle": (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),   # lr and betas
                       lambda opt: _LR.OneCycleLR(opt, max_lr=0.02, total_steps=STEPS + 1)),
}


@pytest.mark.parametrize("name", list(SCHEDULED))
def test_a_scheduler_stepped_after_each_step_changes_no_redone_update(name):
    """The usual loop, `pipe.step(..., post_validate=...)` then `sched.step()`: a wrong optimistic update is undone
    and redone at the next step's deadline, after the scheduler changed lr (and momentum / betas), and must use the
    values of its own step, as the synchronous step and rank p-1 did. 20 float64 steps with clipping and a NaN
    step: post_validate=True equals the synchronous step bit for bit, "inverse" to rounding, and the optimizer's
    hyperparameters and the scheduler's state end as the synchronous run's."""
    torch.manual_seed(0)
    case = mlp(layers=8, batch=2)
    case = case._replace(model=case.model.double(), example=tuple(t.double() for t in case.example))
    pp, m = 2, 4
    batches = batches_with_nan(case, m)
    max_norm = median_norm(case.model, case.loss_fn, batches, m)
    options = CompileOptions(schedule="zbv", microbatches=m, loss_fn=case.loss_fn, example=case.example)
    compiled = compile_programs(case.model, options, pp)
    optimizer, scheduler = SCHEDULED[name]

    def train(post_validate):
        pipes = loopback_pipes(case.model, options, pp, compiled=compiled)

        def run(r):
            opt = optimizer(pipes[r].parameters())
            sched = scheduler(opt)
            results = []
            for x, y in batches:
                results.append(pipes[r].step(x, y, optimizer=opt, max_norm=max_norm, post_validate=post_validate))
                sched.step()
            pipes[r].settle()
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            return [float(x) for x in results], [p.detach().clone() for p in pipes[r].parameters()], (
                groups, sched.state_dict()), results
        return run_pipes(run, pp)

    sync, post, inverse = train(False), train(True), train("inverse")
    for r in range(pp):
        assert all(_same(a, b) for a, b in zip(sync[r][0], post[r][0])), (r, sync[r][0], post[r][0])
        assert all(torch.equal(a, b) for a, b in zip(sync[r][1], post[r][1])), f"rank {r}: post_validate=True"
        assert all(rel(b, a) <= 1e-12 for a, b in zip(sync[r][1], inverse[r][1])), f"rank {r}: 'inverse'"
        assert sync[r][2] == post[r][2] == inverse[r][2]   # lr, momentum / betas, the scheduler's own state
        results = post[r][3]
        assert sum(x.clipped for x in results) > 2 and [i for i, x in enumerate(results) if x.skipped] == [NAN_STEP]


def test_a_first_update_waiting_for_its_verdict_is_not_a_skipped_scheduler_value():
    """Every step clips (max_norm 1e-3), so rank 0's prefix proves it and its update waits for the verdict: the
    usual `sched.step()` after the first step made torch warn that the loop called the scheduler before
    optimizer.step() and skipped the schedule's first value. It does not, and the rates follow the synchronous
    run's."""
    case = mlp(layers=4, batch=8)
    options = CompileOptions(schedule="1f1b", microbatches=4, loss_fn=case.loss_fn,
                             example=tuple(t[:2] for t in case.example))
    compiled = compile_programs(case.model, options, 2)
    x, y = case.example

    def train(post_validate):
        pipes = loopback_pipes(case.model, options, 2, compiled=compiled)

        def run(r):
            opt = torch.optim.SGD(pipes[r].parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            for _ in range(3):
                pipes[r].step(x, y, optimizer=opt, max_norm=1e-3, post_validate=post_validate)
                sched.step()
            pipes[r].settle()
            return sched.get_last_lr(), [p.detach().clone() for p in pipes[r].parameters()]
        return run_pipes(run, 2)

    with warnings.catch_warnings(record=True) as caught:   # (the threads' warnings: caught around them all)
        warnings.simplefilter("always")
        post = train(True)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]
    sync = train(False)
    for r in range(2):
        assert post[r][0] == sync[r][0] == [0.1 * 0.5 ** 3]
        assert all(torch.equal(a, b) for a, b in zip(post[r][1], sync[r][1])), r


@pytest.mark.parametrize("schedule,pp", [("zbv", 2), ("1f1b", 4)])
def test_float16_loss_scaling_post_validated_equals_synchronous(schedule, pp):
    """float16 autocast with pipe.grad_scaler() and clipping: an overflowing batch is skipped on every rank and
    halves the scale, the next step's backward is seeded with the new scale; losses, parameters and scales of the
    post-validated steps equal the synchronous ones (torch's recipe: unscale_, clip, scaler.step, update)."""
    torch.manual_seed(0)
    case = mlp(layers=8, batch=2)
    m = 2 * pp
    batches = batches_with_nan(case, m, steps=8)
    batches[NAN_STEP] = (batches[NAN_STEP - 1][0], batches[NAN_STEP][1])   # no NaN here: an overflow instead
    batches[3] = (batches[3][0] * 6e4, batches[3][1])   # overflows float16 in the first layer's backward
    with torch.autocast("cpu", dtype=torch.float16):
        options = CompileOptions(schedule=schedule, microbatches=m, loss_fn=case.loss_fn, example=case.example)
        compiled = compile_programs(case.model, options, pp)

    def train(post_validate: bool):
        pipes = loopback_pipes(case.model, options, pp, compiled=compiled)

        def run(r):
            pipe = pipes[r]
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            scaler = pipe.grad_scaler(init_scale=2.0 ** 10)
            out = []
            for x, y in batches:
                with torch.autocast("cpu", dtype=torch.float16):
                    result = pipe.step(x, y, optimizer=opt, max_norm=1.0, scaler=scaler,
                                       post_validate=post_validate)
                out.append(result)
            pipe.settle()
            return [float(x) for x in out], scaler.get_scale(), [p.detach().clone() for p in pipe.parameters()], out
        return run_pipes(run, pp)

    sync, post = train(False), train(True)
    for r in range(pp):
        assert all(_same(a, b) for a, b in zip(sync[r][0], post[r][0])), (sync[r][0], post[r][0])
        assert sync[r][1] == post[r][1] == 2.0 ** 9   # one overflow: the scale halved once
        assert all(torch.equal(a, b) for a, b in zip(sync[r][2], post[r][2]))
        assert [i for i, x in enumerate(post[r][3]) if x.skipped] == [3]
        # the synchronous step's results carry the same verdicts and norms (SteppedLoss)
        assert [(x.skipped, x.clipped) for x in sync[r][3]] == [(x.skipped, x.clipped) for x in post[r][3]], r
        assert all(_same(a.norm, b.norm) for a, b in zip(sync[r][3], post[r][3])), r


def test_no_pipeline_wide_collective_runs_in_a_post_validated_step(monkeypatch):
    """Between two post-validated steps nothing waits for the whole pipeline: neither the step's loss and timings
    gather nor the pipeline group's all-gather (a norm, an inf check, the batch check, off here) runs, nor before
    settle(); the first post-validated step checks once that every rank passed the same arguments. The prefix and totals travel as P2P messages of the programs. A synchronous step before them
    does gather (so the spies see what they should), and its timings are not shown as the last step's after."""
    case = mlp(layers=4, batch=2)
    pp, m = 2, 4
    options = CompileOptions(schedule="zbv", microbatches=m, loss_fn=case.loss_fn, example=case.example,
                             check_batch=False)
    pipes = loopback_pipes(case.model, options, pp)
    batches = batches_with_nan(case, m, steps=5)
    gathers = []
    for name in ("allgather", "_gather"):
        real = getattr(RankRuntime, name)
        monkeypatch.setattr(RankRuntime, name, lambda self, *a, real=real, name=name: gathers.append(name)
                            or real(self, *a))

    def run(r):
        opt = torch.optim.AdamW(pipes[r].parameters(), lr=0.01)
        pipes[r].step(*batches[0], optimizer=opt, max_norm=0.01)
        had_timings = pipes[r].last_step is not None
        return had_timings, [pipes[r].step(x, y, optimizer=opt, max_norm=0.01, post_validate=True)
                             for x, y in batches[1:]]

    out = run_pipes(run, pp)
    results = [row for _, row in out]
    # the synchronous step's loss gather and norm exchange on every rank, the first step's one comparison of the
    # ranks' optimizer checks (PipelineModule._check_optimizer), the first post-validated step's one check that
    # every rank steps with the same arguments (agreement.check_step_arguments), and nothing after them
    assert sorted(gathers) == ["_gather"] * pp + ["allgather"] * (3 * pp)
    assert all(had for had, _ in out) and all(p.last_step is None for p in pipes)
    assert all(not x.validated for x in (results[0][-1], results[1][-1]))
    assert sum(x.clipped for x in results[0][:-1]) == 3   # max_norm=0.01: every step clips (and is run again)
    run_pipes(lambda r: pipes[r].settle(), pp)
    assert len(gathers) == 4 * pp and all(x.validated for row in results for x in row)


def test_the_pending_step_is_settled_before_anything_else_reads_the_pipeline():
    """evaluate(), a synchronous step and state_dict() validate the pending step first (every rank, the same
    point), so they see its update; reading a StepResult early settles it too."""
    case = mlp(layers=4, batch=2)
    pp, m = 2, 4
    options = CompileOptions(schedule="1f1b", microbatches=m, loss_fn=case.loss_fn, example=case.example)
    compiled = compile_programs(case.model, options, pp)
    batches = batches_with_nan(case, m, steps=3)
    (x0, y0), (x1, y1), (x2, y2) = batches

    def run_with(post_validate: bool):
        pipes = loopback_pipes(case.model, options, pp, compiled=compiled)

        def run(r):
            pipe = pipes[r]
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            first = pipe.step(x0, y0, optimizer=opt, post_validate=post_validate)
            evaluated = pipe.evaluate(x1, y1)
            pipe.step(x1, y1, optimizer=opt, post_validate=post_validate)
            second = pipe.step(x2, y2, optimizer=opt)   # synchronous after a post-validated one
            early = pipe.step(x0, y0, optimizer=opt, max_norm=0.5, post_validate=post_validate)
            return float(first), evaluated, second, float(early), {k: v.clone() for k, v in pipe.state_dict().items()}
        return run_pipes(run, pp)

    for a, b in zip(run_with(False), run_with(True)):
        assert a[:4] == b[:4]
        assert all(torch.equal(a[4][k], b[4][k]) for k in a[4])


def test_the_memory_plan_counts_the_snapshot_and_the_kept_gradients():
    """After post-validated AdamW steps, pipe.memory_plan() is the validating step's, holding from its start to its
    VALIDATE the last step's gradients (this rank's parameter bytes) and, on every rank but the last, exactly the
    bytes of the snapshot this rank took (parameters, exp_avg, exp_avg_sq, step); after VALIDATE the step's
    memory is the plain plan's."""
    from zbcompile.ir.program.ops import OpKind
    from zbcompile.passes.analysis.memory import CATEGORIES, memory_plan

    case = mlp(layers=4, batch=2)
    pp, m = 2, 4
    options = CompileOptions(schedule="1f1b", microbatches=m, loss_fn=case.loss_fn, example=case.example)
    pipes = loopback_pipes(case.model, options, pp)
    batches = batches_with_nan(case, m, steps=3)

    def run(r):
        opt = torch.optim.AdamW(pipes[r].parameters(), lr=0.01)
        for x, y in batches:
            pipes[r].step(x, y, optimizer=opt, post_validate=True)
        return pipes[r].memory_plan(), pipes[r]._pv.boundary.snapshot_bytes, pipes[r]._pv.programs
    grads, params = CATEGORIES.index("grads"), CATEGORIES.index("params")
    for r, (plan, snapshot, programs) in enumerate(run_pipes(run, pp)):
        mine, plain = plan.ranks[r], memory_plan(programs).ranks[r]
        start, at = mine.samples[0].after, next(i for i, op in enumerate(programs[r].ops) if op.kind is OpKind.VALIDATE)
        assert start[grads] - plain.samples[0].after[grads] == mine.resident["parameters"] > 0
        assert start[params] - plain.samples[0].after[params] == (snapshot if r < pp - 1 else 0)
        assert r == pp - 1 or snapshot > 3 * mine.resident["parameters"]   # AdamW: two moments and a step each
        assert [s.after for s in mine.samples[at:]] == [s.after for s in plain.samples[at:]]


def test_post_validate_refuses_what_it_cannot_do():
    case = mlp(layers=4, batch=2)
    options = CompileOptions(schedule="1f1b", microbatches=4, loss_fn=case.loss_fn, example=case.example)
    pipes = loopback_pipes(case.model, options, 2)
    (x, y), = batches_with_nan(case, 4, steps=1)

    def run(r):
        with pytest.raises(UsageError, match="pass optimizer="):
            pipes[r].step(x, y, post_validate=True)
        with pytest.raises(UsageError, match="optimizer= too"):
            pipes[r].step(x, y, max_norm=1.0)
        with pytest.raises(UsageError, match="grad_scaler"):
            pipes[r].step(x, y, optimizer=torch.optim.SGD(pipes[r].parameters(), lr=0.1), post_validate=True,
                          scaler=torch.amp.GradScaler("cpu"))
        # the closed-form rollback: what it cannot invert, by name
        for opt, match in ((torch.optim.AdamW(pipes[r].parameters(), amsgrad=True), "amsgrad"),
                           (torch.optim.RMSprop(pipes[r].parameters()), "RMSprop has no closed-form inverse"),
                           (_DecayIntoGrad(pipes[r].parameters(), lr=0.1), "_DecayIntoGrad has no closed-form"),
                           (torch.optim.Adam(pipes[r].parameters(), weight_decay=0.1), "coupled weight decay")):
            with pytest.raises(UsageError, match=match):
                pipes[r].step(x, y, optimizer=opt, post_validate="inverse")
        with pytest.raises(UsageError, match="'inverse'"):
            pipes[r].step(x, y, optimizer=torch.optim.SGD(pipes[r].parameters(), lr=0.1), post_validate="yes")
    run_pipes(run, 2)


@pytest.mark.parametrize("post_validate", [False, True])
def test_ranks_stepping_with_other_clipping_are_refused_on_every_rank(post_validate):
    """step(optimizer=, max_norm=) with another max_norm on each rank: synchronously each rank clipped its own
    gradients by its own verdict (a model no single setting trains), post-validated the ranks rolled back
    differently and timed out. Now every rank raises DisagreementError naming the argument, before any update;
    the same arguments then train."""
    torch.manual_seed(0)
    case = mlp(layers=4, batch=2)
    options = CompileOptions(schedule="1f1b", microbatches=4, loss_fn=case.loss_fn, example=case.example)
    pipes = loopback_pipes(case.model, options, 2)
    x, y = batches_with_nan(case, 4, steps=1)[0]

    def run(r):
        pipe = pipes[r]
        opt = _adamw(pipe.parameters())
        before = [p.detach().clone() for p in pipe.parameters()]
        with pytest.raises(DisagreementError) as err:
            pipe.step(x, y, optimizer=opt, max_norm=0.05 if r == 0 else 1e9, post_validate=post_validate)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
        pipe.zero_grad()
        result = pipe.step(x, y, optimizer=opt, max_norm=0.05, post_validate=post_validate)
        pipe.settle()
        return str(err.value), unchanged, float(result)

    for r, (text, unchanged, loss) in enumerate(run_pipes(run, 2)):
        assert text.startswith(f"rank {r}: step() was called with other arguments on different ranks: max_norm: "
                               "rank 0: 0.05; rank 1: 1000000000.0"), text
        assert unchanged and math.isfinite(loss), (r, unchanged, loss)


class _Counting(torch.optim.Optimizer):
    """A hand-written optimizer keeping counters where real ones do: in its groups (Prodigy, D-Adaptation), on
    itself, and a state entry made at its second step only."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, {"lr": lr})
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["k"] >= 2:
                    state.setdefault("v", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                    p.add_(state["v"], alpha=-group["lr"] / group["k"] / self.t)
                else:
                    p.add_(p.grad, alpha=-group["lr"])


class _DecayIntoGrad(torch.optim.SGD):
    """An old-style weight decay: added into .grad in place, inside the step."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(p, alpha=0.1)
        return super().step(closure)


def _pv_case(pp: int = 2, m: int = 4, steps: int = NAN_STEP + 3):
    torch.manual_seed(0)
    case = mlp(layers=4, batch=2)
    model = case.model.double()
    case = case._replace(model=model, example=tuple(t.double() for t in case.example))
    batches = batches_with_nan(case, m, steps=steps)
    max_norm = median_norm(model, case.loss_fn, batches, m)
    compiled = compile_programs(model, CompileOptions(schedule="zbv", microbatches=m, loss_fn=case.loss_fn,
                                                      example=case.example), pp)
    return model, compiled, batches, max_norm


@pytest.mark.parametrize("change", ["counters", "add_param_group"])
def test_what_an_optimizer_keeps_and_gains_between_post_validated_steps(change):
    """A rolled-back update put back only the parameters and the state entries it found: a group entry the step
    wrote (a step counter) kept the optimistic value or lost the redo's, an attribute of the optimizer kept both
    increments, a state entry the update made kept its optimistic value, and a group added after the step took
    part in its redo (its parameters updated from a step they were not in). Each equals the synchronous step now,
    bit for bit, on every rank."""
    model, compiled, batches, max_norm = _pv_case()
    pp = 2
    added = None   # the group is added right after a step whose update is redone (found by a first run)

    def loop(post_validate):
        pipes = loopback_pipes(model, compiled.options, pp, compiled=compiled)

        def run(r):
            pipe, results = pipes[r], []
            if change == "counters":
                opt = _Counting(pipe.parameters())
            else:
                opt = torch.optim.AdamW([p for n, p in pipe.named_parameters() if n.endswith("weight")], lr=0.01)
            for k, (x, y) in enumerate(batches):
                results.append(pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=post_validate))
                if change == "add_param_group" and k == added:
                    opt.add_param_group({"params": [p for n, p in pipe.named_parameters() if n.endswith("bias")],
                                         "lr": 0.05})
            pipe.settle()
            counters = (opt.t, [g["k"] for g in opt.param_groups]) if change == "counters" else None
            clipped = [k for k, v in enumerate(results) if getattr(v, "clipped", False)]
            return [float(v) for v in results], {k: v.clone() for k, v in pipe.state_dict().items()}, counters, \
                pipe._pv, clipped
        return run_pipes(run, pp)

    if change == "add_param_group":
        added = loop(True)[0][4][0]
    sync, post = loop(False), loop(True)
    assert all(post[r][3].boundary.redone for r in range(pp))   # some updates were rolled back
    for r in range(pp):
        assert _same_list(sync[r][0], post[r][0]), (r, sync[r][0], post[r][0])
        assert all(torch.equal(sync[r][1][k], post[r][1][k]) for k in sync[r][1]), r
        assert sync[r][2] == post[r][2], (r, sync[r][2], post[r][2])


@pytest.mark.parametrize("change", ["weights", "optimizer writes grad", "optimizer state"])
def test_what_a_rollback_would_lose_is_refused_at_the_next_call(change):
    """A weight changed in place between post-validated steps (a clamp) was undone by a rollback, or had the
    redone update applied on top; an optimizer that adds into .grad in its own step had the addition made twice
    by a redo; the optimizer's state cleared in between (opt.state.clear()) failed the rollback with a KeyError.
    The next call now refuses on every rank, before anything runs; pipe.settle() before the change
    makes it safe, and then it equals the synchronous step."""
    model, compiled, batches, max_norm = _pv_case()
    pp = 2
    pipes = loopback_pipes(model, compiled.options, pp, compiled=compiled)
    match = {"weights": r"was changed in place after a post-validated step.*pipe\.settle\(\)",
             "optimizer writes grad": r"_DecayIntoGrad\.step\(\) changed the gradient of .* in place",
             "optimizer state": r"the optimizer's state of .* was changed after a post-validated step.*settle"}[change]
    kind = {"weights": torch.optim.SGD, "optimizer writes grad": _DecayIntoGrad, "optimizer state": _adamw}[change]

    def refused(r):
        pipe, (x, y) = pipes[r], batches[0]
        opt = kind(pipe.parameters(), lr=0.1) if change != "optimizer state" else kind(pipe.parameters())
        pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=True)
        if change == "weights":
            with torch.no_grad():
                for p in pipe.parameters():
                    p.clamp_(-0.1, 0.1)
        if change == "optimizer state":
            opt.state.clear()
        with pytest.raises(UsageError, match=match):
            pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=True)
    run_pipes(refused, pp)

    def clamped(post_validate):
        pipes = loopback_pipes(model, compiled.options, pp, compiled=compiled)

        def run(r):
            pipe = pipes[r]
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            for x, y in batches:
                pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=post_validate)
                pipe.settle()
                with torch.no_grad():
                    for p in pipe.parameters():
                        p.clamp_(-0.3, 0.3)
            return {k: v.clone() for k, v in pipe.state_dict().items()}
        return run_pipes(run, pp)

    if change == "weights":
        sync, post = clamped(False), clamped(True)
        assert all(torch.equal(sync[r][k], post[r][k]) for r in range(pp) for k in sync[r])


@pytest.mark.parametrize("rollback", [True, "inverse"])
def test_an_optimizer_state_loaded_between_post_validated_steps_is_the_one_trained_on(rollback):
    """optimizer.load_state_dict() right after a step whose optimistic update the verdict redoes (a clipped
    step): the redo wrote the step over the loaded state, which was lost without a word. A load now settles the
    pending step first, as pipe.load_state_dict() does: the losses and parameters equal the synchronous
    step's (bit for bit; within rounding when the rollback is the closed-form inverse)."""
    model, compiled, batches, max_norm = _pv_case()
    pp, tol = 2, (0.0 if rollback is True else 1e-12)

    def loop(post_validate, at):
        pipes = loopback_pipes(model, compiled.options, pp, compiled=compiled)

        def run(r):
            pipe, results = pipes[r], []
            opt = _adamw(pipe.parameters())
            for k, (x, y) in enumerate(batches):
                results.append(pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=post_validate))
                if k == 1:
                    pipe.settle()
                    saved = copy.deepcopy(opt.state_dict())
                if k == at:
                    opt.load_state_dict(saved)
            pipe.settle()
            clipped = [k for k, v in enumerate(results) if v.clipped and k > 1]
            return [float(v) for v in results], {k: v.clone() for k, v in pipe.state_dict().items()}, clipped
        return run_pipes(run, pp)

    at = loop(False, None)[0][2][0]   # a step that clips: its optimistic update is redone at the verdict
    sync, post = loop(False, at), loop(rollback, at)
    for r in range(pp):
        assert all(_same(a, b) or abs(a - b) <= tol * abs(b) for a, b in zip(post[r][0], sync[r][0])), r
        assert all(rel(post[r][1][k], sync[r][1][k]) <= tol for k in sync[r][1]), r


def test_an_optimizer_state_read_before_the_verdict_warns():
    """optimizer.state_dict() between post-validated steps returns an update the verdict may still undo and redo
    (a checkpoint of it would not be the state training goes on from): it warns on the ranks whose update is
    not final yet (all but the last), and not once the step is settled. Reading opt.state[p] of a parameter
    without state (which adds an empty entry) changes nothing and is not refused."""
    model, compiled, batches, max_norm = _pv_case()
    pipes = loopback_pipes(model, compiled.options, 2, compiled=compiled)
    idle = [torch.nn.Parameter(torch.zeros(1)) for _ in pipes]   # never given a gradient: no state
    opts = [_adamw([*pipe.parameters(), extra]) for pipe, extra in zip(pipes, idle)]
    run_pipes(lambda r: pipes[r].step(*batches[0], optimizer=opts[r], max_norm=max_norm, post_validate=True), 2)
    with pytest.warns(ZBCompileWarning, match="read before the last post-validated step's verdict"):
        opts[0].state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts[1].state_dict()   # the last rank updated from the totals: final
        assert [len(opt.state[extra]) for opt, extra in zip(opts, idle)] == [0, 0]
        run_pipes(lambda r: pipes[r].step(*batches[1], optimizer=opts[r], max_norm=max_norm, post_validate=True), 2)
        run_pipes(lambda r: pipes[r].settle(), 2)
        opts[0].state_dict()
