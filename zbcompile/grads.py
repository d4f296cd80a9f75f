"""The optimizer step over the whole pipeline: gradient norms, clipping, inf / NaN checks and loss scaling that
see every rank's gradients, each parameter counted once.

Each rank holds only its stages' parameters, so torch's `clip_grad_norm_(pipe.parameters(), ...)` on a rank sees
a part of the model; and a tied or mirrored parameter (a DualPipe stage on two ranks) has a full copy of its
gradient on every rank that holds it, so summing the ranks' own norms counts it twice. Here each rank reduces
the gradients it *counts* (`Compiled.counted_params`: a parameter on the lowest rank holding it, vocabulary
row shards on every rank, their rows being disjoint), and one all-gather of a few float64s across the pipeline
group combines them, in rank order, so that every rank gets the same bits.

    norm = pipe.clip_grad_norm_(1.0)        # torch.nn.utils.clip_grad_norm_'s semantics and return value
    if pipe.grads_finite(): opt.step()      # a NaN on any rank skips the step on every rank

    scaler = pipe.grad_scaler()             # torch.amp.GradScaler whose found-inf is the pipeline's
    loss = pipe.step(x, y, scaler=scaler)   # the backward seeded with the scale instead of scaling the loss
    scaler.step(opt); scaler.update()
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Sequence

import torch

from zbcompile.errors import DisagreementError, UsageError

__all__ = ["total_norm", "clip_grads", "PipelineGradScaler"]

# gather(values: float64 tensor [n]) -> [ranks, n]: every rank's values, in rank order (RankRuntime.allgather)
Gather = Callable[[torch.Tensor], torch.Tensor]


# shards(values, "sum" | "max") -> values reduced over the data-parallel replicas that each hold rows of the
# same gradients (sharded data parallelism, Replicas.reduce)
Shards = Callable[[torch.Tensor, str], torch.Tensor]


def total_norm(grads: Sequence[torch.Tensor], norm_type: float, gather: Gather, *, error_if_nonfinite: bool = False,
               device: torch.device | None = None, shards: Shards | None = None) -> torch.Tensor:
    """The norm of every counted gradient of the pipeline, as torch.nn.utils.get_total_norm over all of them:
    the `norm_type` norm of the per-tensor norms, in the dtype torch.stack gives them (the gradients' dtypes
    promoted over every rank: each rank sends its own with its partial), and torch's 0.0 where no rank counts a
    gradient. `grads`: the gradients this rank counts; with `shards`, this replica's rows of them, whose partials
    are first combined over the replicas."""
    p = float(norm_type)
    at = partial_device(grads, device)
    here = norm_dtype(grads)
    mine = [partial(grads, p, shards, at), -1.0 if here is None else float(_DTYPES.index(here)), p]
    rows = gather(torch.tensor(mine, dtype=torch.float64, device=at)).tolist()
    if len({order for *_, order in rows}) > 1:   # each rank would merge the partials of another norm
        raise DisagreementError(f"the ranks asked for the gradient norm of different orders (norm_type per rank: "
                                f"{[order for *_, order in rows]}): give every rank the same norm_type")
    codes = [int(code) for _, code, _ in rows if code >= 0]
    if not codes:   # no gradient anywhere: get_total_norm of no tensors
        total = torch.tensor(0.0, device=at)
    else:
        combined = functools.reduce(lambda a, b: merge(a, b, p), (value for value, *_ in rows))
        total = norm_from(combined, p, promoted(_DTYPES[c] for c in codes), at)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {p} for gradients from the whole pipeline is non-finite, so it "
                           "cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    return total


def identity(p: float) -> float:
    """The partial of a rank that counts no gradient: the identity of merge (a min's is +inf; a max over norms,
    which are never negative, and a sum start from 0)."""
    return math.inf if p == -math.inf else 0.0


def merge(a: float, b: float, p: float) -> float:
    """Two partials in rank order: added, or the max (inf) / min (-inf) with a NaN kept, as torch's max / min keep
    it (Python's max(1.0, nan) is 1.0, so a NaN on a later rank would vanish)."""
    if not math.isinf(p):
        return a + b
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b) if p > 0 else min(a, b)


def norm_from(combined: float, p: float, dtype: torch.dtype, device) -> torch.Tensor:
    """The total norm from the ranks' partials merged in rank order (a sum of p-th powers from left to right, a
    maximum or minimum, or a count of nonzero tensors, the 0-"norm"): the synchronous path and post-validation's
    prefix chain (zbcompile/post_validation.py) merge the same floats in the same order, so they get the same
    bits. Rounded once to `dtype`, as torch's vector_norm of the stacked per-tensor norms is."""
    total = torch.tensor(combined, dtype=torch.float64, device=device)
    if not (math.isinf(p) or p == 0):
        total = total ** (1.0 / p)
    return total.to(dtype)


def counted_each(params: Sequence[torch.nn.Parameter], rows: Sequence[int | None], whole: bool):
    """(parameter, the gradient rows this rank counts of it or None, whether it is a vocabulary parameter) per
    counted parameter; `rows`: per parameter its rows holding vocabulary entries (None: all of it; 0: only
    padding rows here, none counted); `whole`: the gradient is the whole parameter's (not a sharded replica's
    slice, which holds no padding rows to cut)."""
    for p, n in zip(params, rows):
        g = None if p.grad is None or n == 0 else local(p.grad)
        yield p, (g[:n] if g is not None and n is not None and whole else g), n is not None


def counted_once(each, gather: Gather, rank: int, device) -> list[torch.Tensor]:
    """The counted gradients for the 0-"norm", which counts the tensors holding a nonzero: a vocabulary
    parameter is one tensor, though every rank holds rows of it, so its rows become one 0-dim flag on rank 0,
    nonzero where any rank's rows are (one all-gather over the pipeline). `each`: counted_each's triples."""
    plain, flags, dtypes = [], [], []
    for p, g, vocab in each:
        if not vocab:
            plain += [g] if g is not None else []
            continue
        flags.append(float(g is not None and bool(g.count_nonzero())))
        dtypes.append(p.dtype)
    anywhere = gather(torch.tensor(flags, dtype=torch.float64, device=device)).amax(0)
    if rank != 0:
        return plain
    return plain + [torch.full((), float(f), dtype=dt, device=device) for f, dt in zip(anywhere.tolist(), dtypes)]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharded data parallelism: this replica's rows), a sparse gradient's values (an
    Embedding(sparse=True): summed per row, so its norms and inf checks are the dense gradient's), any other
    tensor itself."""
    if t.layout is torch.sparse_coo:
        return t.coalesce().values()
    return getattr(t, "_local_tensor", t)


# every dtype a gradient can have, in an order every rank agrees on: a rank sends its gradients' as an index
_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)
                        and (d.is_floating_point or d.is_complex)}, key=str))


def promoted(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """torch.stack's promotion of 0-dim tensors of `dtypes` (bfloat16 and float16 give float32); None for none."""
    dtypes = list(dtypes)
    return functools.reduce(torch.promote_types, dtypes) if dtypes else None


def norm_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The dtype of torch's get_total_norm over `tensors`: it stacks one norm per tensor, each in the tensor's
    dtype, so their promotion (a bfloat16 model's norm is bfloat16; a complex tensor's norm is real: float64 for
    complex128); None for no tensors."""
    return promoted(t.dtype.to_real() for t in tensors)


def partial_device(grads: Sequence[torch.Tensor], device) -> torch.device:
    return grads[0].device if grads else torch.device(device or "cpu")


def partial(grads: Sequence[torch.Tensor], p: float, shards: Shards | None = None, device=None) -> float:
    """This rank's share of the total (partial_of); with `shards`, over the data-parallel replicas that each hold
    rows of the same gradients (sharded data parallelism)."""
    if shards is None:
        return partial_of(grads, p)
    at = partial_device(grads, device)
    if p == 0:   # a tensor counts once if any replica's rows of it are nonzero
        nonzero = torch.tensor([float(bool(g.count_nonzero())) for g in grads], dtype=torch.float64, device=at)
        return float(shards(nonzero, "max").sum()) if grads else 0.0
    held = partial_of([g for g in grads if g.numel()], p)   # a replica without rows of a tensor: none of it
    if p == -math.inf:   # the replicas' min, as the max of the negated
        return -float(shards(torch.tensor([-held], dtype=torch.float64, device=at), "max")[0])
    return float(shards(torch.tensor([held], dtype=torch.float64, device=at), "max" if p == math.inf else "sum")[0])


def partial_of(grads: Sequence[torch.Tensor], p: float) -> float:
    """This rank's share of the total: the max (inf) or min (-inf) of the per-tensor norms, the number of nonzero
    ones (0), or the sum of their p-th powers; identity(p) for no gradients. The per-tensor norms as torch's
    get_total_norm takes them (one fused _foreach_norm per device and dtype where it supports the order)."""
    if not grads:
        return identity(p)
    norms = torch.stack([n.to(torch.float64) for n in _tensor_norms(grads, p)])
    if p == math.inf:
        return float(norms.max())
    if p == -math.inf:
        return float(norms.min())
    if p == 0:
        return float((norms != 0).sum())
    return float((norms ** p).sum())


def _tensor_norms(grads: Sequence[torch.Tensor], p: float) -> list[torch.Tensor]:
    if p not in (1.0, 2.0, math.inf):
        return [torch.linalg.vector_norm(g.detach(), p) for g in grads]
    groups: dict = {}
    for k, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(k)
    out: list = [None] * len(grads)
    for ks in groups.values():
        for k, n in zip(ks, torch._foreach_norm([grads[k].detach() for k in ks], p)):
            out[k] = n
    return out


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total: torch.Tensor,
               foreach: bool | None = None) -> None:
    """Scale every gradient of this rank's parameters (copies included) by max_norm / (total + 1e-6), at most 1:
    torch.nn.utils.clip_grads_with_norm_ with the pipeline's total norm."""
    torch.nn.utils.clip_grads_with_norm_(list(params), max_norm, total, foreach=foreach)


def grads_finite(grads: Sequence[torch.Tensor], gather: Gather, device=None) -> bool:
    """True when no gradient on any rank holds an inf or a NaN."""
    bad = any(not bool(torch.isfinite(g).all()) for g in grads)
    return not bool(gather(torch.tensor([float(bad)], dtype=torch.float64,
                                        device=partial_device(grads, device))).any())


class PipelineGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose found-inf is the whole pipeline's: after `unscale_` (called by `step` where the
    user did not), an inf or NaN in any rank's gradients counts as found on every rank, so every rank skips the
    same steps and keeps the same scale. Made by `PipelineModule.grad_scaler()`; `pipe.step(*batch,
    scaler=scaler)` seeds the backward with the scale (the loss it returns is not scaled)."""

    def __init__(self, gather: Gather, device: str = "cuda", **kwargs):
        super().__init__(device, **kwargs)
        self._gather = gather

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        here = float(sum(float(v) for v in found.values()) > 0) if found else 0.0
        anywhere = float(self._gather(torch.tensor([here], dtype=torch.float64,
                                                   device=self._device_of(found))).max())
        for v in found.values():
            v.fill_(anywhere)
        if not found and anywhere:   # this rank has no gradients, but another found an inf: skip here too
            found[torch.device(self._device)] = torch.full((1,), anywhere, dtype=torch.float32,
                                                           device=self._device)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether unscale_ found an inf or NaN in any rank's gradients (scaler.step then skips, on every rank)."""
        return sum(float(v) for v in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()) > 0

    def _device_of(self, found) -> torch.device:
        return next(iter(found.values())).device if found else torch.device(self._device)

    def seed(self, microbatches: int) -> float:
        """The backward's seed gradient: scale / microbatches (the scale lazily made, as GradScaler.scale does)."""
        if not self._enabled:
            return 1.0 / microbatches
        return float(self.scale(torch.ones((), device=self._device))) / microbatches


def check_max_norm(max_norm, what: str, nan: bool = False) -> float:
    """`max_norm` as a float; UsageError, before anything runs, for what is no number (a string from a config
    file: torch would fail inside the clipping, after the ranks' exchange) and, unless `nan`, for NaN (which
    clipping would multiply every gradient by, where step()'s verdict would not clip)."""
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
        max_norm = max_norm.item()
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise UsageError(f"{what} takes max_norm as a number (1.0), got {max_norm!r}"
                         + (f": convert it, float({max_norm!r})" if isinstance(max_norm, str) else ""))
    if math.isnan(max_norm) and not nan:
        raise UsageError(f"{what} got max_norm=nan, which would scale every gradient to NaN: give a number (or "
                         "float('inf') to measure the norm without clipping)")
    return float(max_norm)


def check_norm_type(norm_type) -> float:
    try:
        return float(norm_type)
    except (TypeError, ValueError):
        raise UsageError(f"norm_type must be a number (2.0, 1.0, float('inf')), got {norm_type!r}") from None
