"""A zoo of transformers architectures (tests/support/zoo.py: rotary, ALiBi and learned positions, encoder-only masked
LMs, encoder-decoders, a vision transformer, mixtures of experts), each split and run as a threaded pp=2
pipeline under 1f1b (2 stages) and zbv (4 stages) over 4 microbatches: the loss, every gradient and every
floating buffer after the step equal eager microbatch accumulation within 1e-5 relative."""

from __future__ import annotations

import copy

import pytest
import torch

from support import zoo
from support.zoo import MICROBATCHES, batch
from support.threaded import max_grad_error, param_holders, run_threaded
from zbcompile.passes.schedules import generate
from zbcompile.split import split_model

torch.set_num_threads(1)

@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("arch", list(zoo.ZOO))
def test_zoo_step_matches_eager_microbatches(arch, schedule):
    sched = generate(schedule, 2, MICROBATCHES)
    case, staged = zoo.split(arch, sched)   # one trace per architecture, split for each schedule
    inputs, targets = batch(case)
    n = len(inputs)

    ref = copy.deepcopy(case.model)
    losses_ref = []
    for mb in zip(*(x.chunk(MICROBATCHES) for x in inputs + targets)):
        loss = case.loss_fn(ref(*mb[:n]), *mb[n:]) / MICROBATCHES
        loss.backward()
        losses_ref.append(loss.item())
    want = sum(losses_ref)

    losses, ranks, _ = run_threaded(case.model, staged, sched, inputs + targets)
    assert all(abs(v - want) <= 1e-5 * abs(want) for v in losses), (losses, want)

    holders = param_holders(sched, staged)
    graded = {name for name, p in ref.named_parameters() if p.grad is not None}
    assert graded, arch
    owned = [[f for f, rs in holders.items() if r in rs and f in graded] for r in range(2)]
    assert set().union(*owned) == graded, graded - set().union(*owned)
    err, where = max_grad_error(ref, ranks, owned)
    assert err <= 1e-5, (err, where)
    for r, mdl in enumerate(ranks):
        assert all(p.grad is None for name, p in mdl.named_parameters() if name not in graded), r

    # every floating buffer: the rank whose stages hold it has eager's value; the others kept the initial one
    want_bufs, init = dict(ref.named_buffers()), dict(case.model.named_buffers())
    for r, mdl in enumerate(ranks):
        mine = {b for s, rank in enumerate(sched.placement) if rank == r
                for b in staged.stages[sched.model_stage(s)].buffers}
        for name, buf in mdl.named_buffers():
            if not buf.is_floating_point():
                continue
            expect = want_bufs[name] if name in mine else init[name]
            torch.testing.assert_close(buf, expect, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")


def test_stage_ending_in_a_linear_on_3d_input_splits_and_matches_eager():
    """aten.linear on 3-d input decomposes to view(addmm(view(x))): a stage whose sent output is that view of an
    intermediate (BERT's cut after `output.dense` under zbv) used to fail aot's joint export."""
    from support.models import Case
    from support.reference import check_against_eager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    case = Case(model, torch.nn.functional.mse_loss, ((torch.randn(2, 3, 8),), (torch.randn(2, 3, 8),)), 2)
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2)
    assert staged.stages[0].send[0].shape == (2, 3, 8)
    check_against_eager(staged, case)
