"""The models, batches and eager reference shared by the checkpoint tests (tests/distributed/test_checkpoint.py,
test_vocab_checkpoint.py) and their worker processes."""

from __future__ import annotations

import torch
from torch import nn

from support.models import convnet, gpt
from zbcompile.examples.gpt import GPT, GPTConfig
from zbcompile.examples.gpt import loss_fn as gpt_loss

MICROBATCHES = 4
STEPS = 4   # saved after 2, resumed for steps 3 and 4


def case(name: str):
    """(model, loss_fn, one batch per step, microbatches), the same in every process."""
    if name == "gpt_other":   # wider and deeper than "gpt": other shapes, and blocks the checkpoint lacks
        torch.manual_seed(0)
        model, loss_fn, name = GPT(GPTConfig(vocab=64, seq=16, d=48, heads=2, layers=6)), gpt_loss, "gpt"
    elif name == "gpt":
        model, loss_fn, _, _ = gpt(layers=4)
    else:
        model, loss_fn, _, _ = convnet(blocks=4)
    g = torch.Generator().manual_seed(1)
    rows = 2 * MICROBATCHES
    if name == "gpt":
        batches = [(torch.randint(0, 64, (rows, 8), generator=g), torch.randint(0, 64, (rows, 8), generator=g))
                   for _ in range(STEPS)]
    else:
        batches = [(torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, 5, (rows,), generator=g))
                   for _ in range(STEPS)]
    return model, loss_fn, batches, MICROBATCHES


def microbatch(batch, m: int):
    """`example=` for compile: the first microbatch of `batch`, as (inputs, targets)."""
    x, y = batch
    return (x[: x.shape[0] // m],), (y[: y.shape[0] // m],)


def adamw(params):
    """eps=1e-3 (tests/distributed/workers/dist_worker.py's reference says why: near-zero gradients and float
    summation order)."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def perturb(model: nn.Module) -> None:
    """Other weights and BatchNorm statistics than the factory's: what a load must overwrite."""
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(1) if t.is_floating_point() else t.fill_(7)


def eager_step(model: nn.Module, loss_fn, batch, m: int) -> float:
    """One training step's forward and backward as the pipeline runs it: microbatch by microbatch (BatchNorm
    statistics per microbatch, in order), gradients summed over the batch's mean loss."""
    total = 0.0
    for x, y in zip(batch[0].chunk(m), batch[1].chunk(m)):
        loss = loss_fn(model(x), y) / m
        loss.backward()
        total += loss.item()
    return total


def eager_train(model: nn.Module, opt, loss_fn, batches, m: int) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(eager_step(model, loss_fn, batch, m))
        opt.step()
        opt.zero_grad()
    return losses


VOCAB_MICROBATCHES = 4


def vocab_case():
    """test_vocab_checkpoint's model, loss_fn and 4 batches of VOCAB_MICROBATCHES microbatches: an untied GPT
    over 61 tokens (the last vocabulary shard padded), the same in every process."""
    M = VOCAB_MICROBATCHES
    base = gpt(layers=4, batch=1)
    torch.manual_seed(5)
    cfg = base.model.cfg.__class__(vocab=61, seq=base.model.cfg.seq, d=base.model.cfg.d,
                                   heads=base.model.cfg.heads, layers=4)
    model = type(base.model)(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone() * 0.5)
    g = torch.Generator().manual_seed(9)
    x0, _ = base.example
    batches = [(torch.randint(0, 61, (M * x0.shape[0], x0.shape[1]), generator=g),
                torch.randint(0, 61, (M * x0.shape[0], x0.shape[1]), generator=g)) for _ in range(4)]
    return model, base.loss_fn, batches
