"""Models and references of the training-loop tests, shared by the threaded ones (tests/e2e/test_training_loop.py,
tests/split/test_cut_anywhere.py) and the multi-process worker (tests/distributed/workers/loop_worker.py).

    mixtral_moe(batch)        transformers' Mixtral whose loss adds the router load-balancing loss of every layer
    titan_loss                torchtitan's cross-entropy: the logits cast to float32 first
    three_linears, few_ops, cnn_sequential    models with fewer modules than stages (the split cuts between ops)
    eager_step, rel, shard_of                 the references the tests compare against
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from support.models import Case

__all__ = ["MoE", "moe_loss", "mixtral_moe", "titan_loss", "Three", "FewOps", "three_linears", "few_ops",
           "cnn_sequential", "CUT_CASES", "eager_step", "rel", "shard_of"]


class MoE(nn.Module):
    """transformers' Mixtral with `output_router_logits=True`: each layer's router logits travel to the loss,
    which adds the load-balancing loss over all layers to the cross-entropy (terms from every stage)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        torch.manual_seed(0)
        cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.1)
        self.lm = MixtralForCausalLM(cfg)

    def forward(self, ids):
        out = self.lm(input_ids=ids, use_cache=False, output_router_logits=True)
        return out.logits, out.aux_loss


def moe_loss(out, labels):
    logits, aux = out
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + 0.1 * aux


def mixtral_moe(layers: int = 4, batch: int = 8) -> Case:
    model = MoE(layers)
    torch.manual_seed(1)
    return Case(model, moe_loss, (torch.randint(0, 64, (batch, 8)), torch.randint(0, 64, (batch, 8))), layers)


def titan_loss(pred, labels):
    """torchtitan's cross-entropy: the logits cast to float32 first (a bfloat16 model, a float32 loss)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class FewOps(nn.Module):
    """Four matmuls and their activations in one forward: no submodule at all."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = torch.tanh(x @ self.w1)
        h = torch.relu(h @ self.w2)
        h = torch.sin(h @ self.w1.t())
        return torch.tanh(h @ self.w2) * 2.0 + h


def three_linears(batch: int = 8) -> Case:
    torch.manual_seed(0)
    return Case(Three(), F.mse_loss, (torch.randn(batch, 16), torch.randn(batch, 4)), 7)


def few_ops(batch: int = 8) -> Case:
    torch.manual_seed(0)
    return Case(FewOps(), F.mse_loss, (torch.randn(batch, 16), torch.randn(batch, 16)), 8)


def cnn_sequential(batch: int = 8) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    return Case(model, F.cross_entropy, (torch.randn(batch, 3, 8, 8), torch.randint(0, 5, (batch,))), 8)


CUT_CASES = {"three_linears": three_linears, "few_ops": few_ops, "cnn_sequential": cnn_sequential}


def eager_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, m: int, scaler=None) -> float:
    """The pipeline's reference step: microbatch by microbatch, each loss / m (BatchNorm sees microbatches),
    scaled by `scaler` where given; returns the mean loss."""
    loss = 0.0
    for xb, yb in zip(x.chunk(m), y.chunk(m)):
        part = loss_fn(model(xb), yb) / m
        (part if scaler is None else scaler.scale(part)).backward()
        loss += part.item()
    return loss


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of `b` (in float64)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def shard_of(full: torch.Tensor, part: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of `full` a vocabulary shard holds (the whole tensor where it is not sharded)."""
    if full.shape == part.shape:
        return full
    rows = part.shape[0]
    got = full[rank * rows:(rank + 1) * rows]
    return torch.cat([got, got.new_zeros((rows - got.shape[0], *got.shape[1:]))])


# ---- post-validation (tests/e2e/test_post_validation.py, workers/loop_worker.py) ---------------------------
NAN_STEP = 7


def batches_with_nan(case, m: int, steps: int = 20, seed: int = 0):
    """`steps` batches of m microbatches like the case's example, the NAN_STEP-th (if any) with a NaN input."""
    x, y = case.example
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn((m * x.shape[0], *x.shape[1:]), generator=g, dtype=x.dtype) for _ in range(steps)]
    ys = [torch.randn((m * y.shape[0], *y.shape[1:]), generator=g, dtype=y.dtype) for _ in range(steps)]
    if NAN_STEP < steps:
        xs[NAN_STEP][0, 0] = float("nan")
    return list(zip(xs, ys))


def eager_clipped(model, loss_fn, batches, m: int, max_norm: float | None):
    """Single-process training: AdamW, clip_grad_norm_ over every parameter, a non-finite step skipped."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    losses, norms = [], []
    for x, y in batches:
        losses.append(eager_step(ref, loss_fn, x, y, m))
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm is not None else math.inf)
        norms.append(float(norm))
        if math.isfinite(norms[-1]):
            opt.step()
        opt.zero_grad()
    return losses, norms, ref


def median_norm(model, loss_fn, batches, m: int) -> float:
    """The median of eager's unclipped gradient norms over `batches`: as max_norm, about half the steps clip."""
    norms = sorted(n for n in eager_clipped(model, loss_fn, batches, m, None)[1] if math.isfinite(n))
    return norms[len(norms) // 2]
