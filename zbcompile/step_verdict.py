"""The optimizer step's verdict over the whole pipeline, the same arithmetic for the synchronous step and for
post-validation's prefix chain (zbcompile/post_validation.py): each rank's partial values (the norm's power sum,
maximum or minimum, an inf / NaN flag), merged in rank order, give "skip" (a gradient is not finite), "clip"
(clip_grad_norm_'s coefficient is below 1) or "step", and the total norm.

`synchronous_step` is the reference: one all-gather of those values, then the verdict applied on every rank.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from zbcompile import grads, optimizer_checks
from zbcompile.agreement import STEP_ARGUMENTS, check_step_arguments, step_arguments
from zbcompile.errors import UsageError
from zbcompile.ir.names import Role, role_of

__all__ = ["check_optimizer", "synchronous_step", "norm_dtype", "local_values", "any_not_finite", "combine",
           "verdict", "mixed", "apply"]


def check_optimizer(pipe, optimizer) -> None:
    """UsageError for step(optimizer=...) given something else than a torch optimizer, or one over none of this
    rank's trained parameters (an optimizer of another model: nothing would be updated and the gradients would
    pile up step after step)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"step(optimizer=...) takes a torch.optim.Optimizer over pipe.parameters(); got a "
                         f"{type(optimizer).__name__}")
    optimizer_checks.check_cross_parameter(optimizer)
    trained = {id(p) for p in pipe.parameters() if p.requires_grad}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if trained and not trained & held:
        raise UsageError(f"rank {pipe.rank}: step(optimizer=...) got an optimizer over none of this rank's "
                         f"{len(trained)} trained parameter(s), so it would update nothing while their gradients "
                         "pile up; build it over this pipeline's parameters: optimizer(pipe.parameters(), ...)")


def synchronous_step(pipe, optimizer: torch.optim.Optimizer, max_norm: float | None, norm_type: float,
                     scaler=None) -> tuple[float | None, str]:
    """The reference: every rank's partial norm and inf flag in one all-gather over the pipeline, then on every
    rank the same verdict (clip_grad_norm_'s total and coefficient, the step skipped where a gradient is not
    finite) and zero_grad. With a scaler (pipe.grad_scaler()), torch's recipe: unscale_, clip, scaler.step (it
    skips on an inf found on any rank), scaler.update. Returns (the total norm or None without max_norm, the
    verdict: "step", "clip" or "skip")."""
    if scaler is not None:
        scaler.unscale_(optimizer)   # (its found-inf is the pipeline's: the same on every rank)
        skipped = scaler.found_inf(optimizer)
        norm = None if max_norm is None else pipe.clip_grad_norm_(max_norm, norm_type)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        clipped = norm is not None and float(max_norm / (norm + 1e-6)) < 1.0
        return (None if norm is None else float(norm)), "skip" if skipped else "clip" if clipped else "step"
    device = pipe.runtime.device
    found = float(any_not_finite(pipe._counted_grads()))   # the real gradients, not _norm_grads' flags
    mine = local_values(pipe._norm_grads(norm_type), norm_type, pipe._dp.reduce if pipe._sharded else None, found)
    mine += step_arguments(max_norm, norm_type)   # compared in the same all-gather, then dropped
    rows = pipe._gather(torch.tensor(mine, dtype=torch.float64, device=device),
                        "step()'s gradient norm and inf check").tolist()
    rows = [row[:-len(STEP_ARGUMENTS)] for row in check_step_arguments(rows, pipe.rank)]
    combined = functools.reduce(lambda a, b: combine(a, b, norm_type), rows)
    kind, norm = verdict(combined, norm_type, max_norm, norm_dtype(pipe), device)
    apply(kind, norm, list(pipe.parameters()), max_norm, optimizer)
    optimizer.zero_grad(set_to_none=True)
    return (None if norm is None else float(norm)), kind


def norm_dtype(pipe) -> torch.dtype:
    """The dtype of the pipeline's total norm as torch.nn.utils.get_total_norm gives it (torch.stack's promotion of
    every gradient's dtype: bfloat16 for a bfloat16 model), the same on every rank without an exchange: read from
    every stage's gradient outputs (their traced dtypes), not from this rank's parameters alone."""
    staged = pipe.compiled.staged
    graphs = [st.w for st in staged.stages] + [staged.vocab.graphs[k] for k in ("t", "ib") if staged.vocab]
    dtypes = [node.meta["val"].dtype.to_real() for g in graphs for name, node in g.output_nodes().items()
              if role_of(name) is Role.GRAD_PARAM and isinstance(node, torch.fx.Node) and "val" in node.meta]
    return grads.promoted(dtypes) or torch.get_default_dtype()


def local_values(counted: Sequence[torch.Tensor], p: float, shards=None,
                 found: float | None = None) -> list[float]:
    """This rank's [norm partial, inf / NaN flag]: grads.partial (with `shards`, over this rank's replicas:
    sharded data parallelism), 1.0 where a gradient is not finite (`found`: a check made already, a GradScaler's
    over every gradient of the rank; with `shards`, over the replicas too)."""
    partial = grads.partial(counted, p, shards)
    bad = float(any_not_finite(counted)) if found is None else found
    if shards is not None:
        bad = float(shards(torch.tensor([bad], dtype=torch.float64), "max")[0])
    return [partial, bad]


def any_not_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """One fused check over all tensors (GradScaler's: it multiplies by 1.0, which changes no bit)."""
    if not tensors:
        return False
    found = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    groups: dict = {}
    for t in tensors:
        t = torch.view_as_real(t) if t.is_complex() else t   # (the check takes real tensors only)
        groups.setdefault((t.device, t.dtype), []).append(t)
    one = torch.ones((), dtype=torch.float32, device=tensors[0].device)
    for group in groups.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
    return bool(found)


def combine(a: Sequence[float], b: Sequence[float], p: float) -> list[float]:
    """Two prefixes (or rows) in rank order: norm partials merged (grads.merge: added, the max or min for the
    infinite orders), flags maxed, loss sums added, of the ranks' call numbers the least and the greatest, and
    whether some rank trained."""
    merged = [grads.merge(a[0], b[0], p), max(a[1], b[1])]
    if len(a) > 2:
        merged.append(a[2] + b[2])
    if len(a) > 3:
        merged += [min(a[3], b[3]), max(a[4], b[4])]
    if len(a) > 5:
        merged.append(max(a[5], b[5]))
    return merged


def verdict(values: Sequence[float], p: float, max_norm: float | None, dtype: torch.dtype,
            device) -> tuple[str, torch.Tensor | None]:
    """"skip" (a gradient is not finite), "clip" (clip_grads_with_norm_'s coefficient is below 1) or "step", and
    the total norm (None without max_norm)."""
    norm = None if max_norm is None else _norm(values, p, dtype, device)
    if values[1]:
        return "skip", norm
    if norm is not None and float(max_norm / (norm + 1e-6)) < 1.0:
        return "clip", norm
    return "step", norm


def mixed(values: torch.Tensor) -> bool:
    """Whether a prefix or the totals saw different call numbers (see Boundary.prefix)."""
    least, greatest = values.tolist()[3:5]
    return least != greatest


def _norm(values: Sequence[float], p: float, dtype: torch.dtype, device) -> torch.Tensor:
    """The total norm of the merged values. For a negative order the partial of no gradient (+inf for -inf, 0 for a
    sum of negative powers) would give inf where torch's norm of nothing is 0; a gradient gives that partial only
    where it holds an inf, which sets the flag: without it, no rank counted a gradient."""
    if p < 0 and values[0] == grads.identity(p) and not values[1]:
        return torch.zeros((), dtype=dtype, device=device)
    return grads.norm_from(values[0], p, dtype, device)


def apply(kind: str, norm: torch.Tensor | None, params: Sequence[torch.nn.Parameter], max_norm: float | None,
          optimizer: torch.optim.Optimizer) -> None:
    """The update of a verdict. torch's clip scales by min(coefficient, 1): only a clipping verdict scales (by 1.0
    the gradients would not change)."""
    if kind == "skip":
        return
    if kind == "clip":
        grads.clip_grads(params, max_norm, norm)
    optimizer.step()
