"""A sparse gradient (an embedding with sparse=True) is refused where ranks would have to sum it: a weight tied
across ranks, DualPipe's mirrored stages, data-parallel replicas. Held by one rank it is kept as it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zbcompile.compiler import compile_programs
from zbcompile.errors import LoweringError
from zbcompile.options import CompileOptions


class _Bag(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        self.out = nn.Linear(8, 10, bias=False)
        if tie:
            self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.blocks(self.emb(ids).mean(1)))


def _compile(tie: bool, schedule: str, replicas: int = 1):
    x, y = torch.randint(0, 10, (2, 3)), torch.randint(0, 10, (2,))
    options = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=4, loss_fn=F.cross_entropy,
                                         example=((x,), (y,)))
    return compile_programs(_Bag(tie), options, 2, replicas=replicas)


@pytest.mark.parametrize("tie,schedule,replicas,holders", [
    (True, "1f1b", 1, "ranks \\[0, 1\\] each hold a copy"),
    (False, "dualpipe", 1, "ranks \\[0, 1\\] each hold a copy"),
    (False, "1f1b", 2, "data-parallel replicas"),
])
def test_a_sparse_gradient_summed_between_ranks_is_refused(tie, schedule, replicas, holders):
    with pytest.raises(LoweringError, match=f"'emb.weight' gets a sparse gradient .*{holders}.* fix: sparse=False"):
        _compile(tie, schedule, replicas)


def test_a_sparse_gradient_on_one_rank_trains_as_eager():
    """zbv keeps the embedding on one rank: its gradient stays sparse and equals eager's."""
    import copy

    from support.threaded import loopback_pipes, run_pipes

    x, y = torch.randint(0, 10, (8, 3)), torch.randint(0, 10, (8,))
    model = _Bag()
    ref = copy.deepcopy(model)
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        (F.cross_entropy(ref(xb), yb) / 4).backward()
    options = CompileOptions.from_kwargs(None, schedule="zbv", microbatches=4, loss_fn=F.cross_entropy,
                                         example=((x[:2],), (y[:2],)))
    pipes = loopback_pipes(model, options, 2)
    run_pipes(lambda r: pipes[r].step(x, y), 2)
    (grad,) = [p.grad for pipe in pipes for n, p in pipe.named_parameters() if n == "emb.weight" and p.grad is not None]
    assert grad.layout is torch.sparse_coo
    assert torch.allclose(grad.to_dense(), ref.emb.weight.grad.to_dense(), rtol=1e-5, atol=1e-7)


class _Direct(nn.Module):
    """The embedding alone in the first stage: its sparse gradient's values are the received output gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.out = nn.Linear(8, 10)

    def forward(self, ids):
        return self.out(self.blocks(self.emb(ids))).flatten(0, 1)


@pytest.mark.parametrize("schedule", ["zbv", "v-half", "1f1b"])
def test_a_sparse_gradient_made_of_a_received_gradient_sums_every_microbatch(schedule):
    """The sparse gradient holds the received output gradient as its values, by reference (the op's schema calls
    its result fresh): the lowering must not reuse that receive buffer while the gradient is still summed into,
    or a later microbatch's message overwrites an earlier one's contribution (it did under zbv and v-half)."""
    import copy

    from support.threaded import loopback_pipes, run_pipes

    def loss_fn(logits, y):
        return F.cross_entropy(logits, y.flatten())

    model = _Direct().double()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 10, (8, 3), generator=g), torch.randint(0, 10, (8, 3), generator=g)
    ref = copy.deepcopy(model)
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        (loss_fn(ref(xb), yb) / 4).backward()
    stages = 4 if schedule in ("zbv", "v-half") else 2
    cuts = ["blocks.0", "blocks.2", "out"] if stages == 4 else ["blocks.0"]
    options = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=4, loss_fn=loss_fn,
                                         example=((x[:2],), (y[:2],)), split_points=cuts)
    pipes = loopback_pipes(model, options, 2)
    run_pipes(lambda r: pipes[r].step(x, y), 2)
    (grad,) = [p.grad for pipe in pipes for n, p in pipe.named_parameters() if n == "emb.weight" and p.grad is not None]
    assert grad.layout is torch.sparse_coo
    want = ref.emb.weight.grad.to_dense()
    assert (grad.to_dense() - want).abs().max() <= 1e-12 * want.abs().max(), schedule


def test_the_pipeline_wide_norm_inf_check_and_optimizer_step_take_a_sparse_gradient():
    """grads_finite(), get_total_norm() and step(optimizer=) read a sparse gradient's summed values (they raised
    torch's NotImplementedError on one rank while the others waited): the norm is eager's over the dense
    gradients, and the step's parameters are eager's SGD step."""
    import copy

    from support.threaded import loopback_pipes, run_pipes

    model = _Bag().double()
    x, y = torch.randint(0, 10, (8, 3)), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        (F.cross_entropy(ref(xb), yb) / 4).backward()
    want = torch.cat([p.grad.to_dense().flatten() for p in ref.parameters()]).norm().item()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    options = CompileOptions.from_kwargs(None, schedule="1f1b", microbatches=4, loss_fn=F.cross_entropy,
                                         example=((x[:2],), (y[:2],)))
    pipes = loopback_pipes(model, options, 2)

    def run(r):
        pipe = pipes[r]
        pipe.step(x, y)
        finite, norm = pipe.grads_finite(), pipe.get_total_norm().item()
        pipe.zero_grad()
        pipe.step(x, y, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1))
        return finite, norm

    for finite, norm in run_pipes(run, 2):
        assert finite and abs(norm - want) <= 1e-12 * want, (finite, norm, want)
    params = dict(ref.named_parameters())
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            assert (p.detach() - params[n].detach()).abs().max() <= 1e-12, n
