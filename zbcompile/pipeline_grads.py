"""The optimizer step over the whole pipeline, a mixin of zbcompile.pipeline_module.PipelineModule: the gradient
norm and clipping, the inf check and the grad scaler, each over every rank's gradients (each parameter counted
once: tied and mirrored copies, vocabulary row shards, data-parallel shards), and the first step's comparison of
the ranks' optimizers. The arithmetic is zbcompile/grads.py's; this is where the pipeline's gathers feed it.
"""

from __future__ import annotations

import functools

import torch

from zbcompile import grads
from zbcompile.errors import UsageError
from zbcompile.grads import PipelineGradScaler
from zbcompile.pipeline_failures import unusable_after_a_failure
from zbcompile.step_verdict import check_optimizer

__all__ = ["GradientStatistics"]


class GradientStatistics:
    """PipelineModule's get_total_norm, clip_grad_norm_, grads_finite and grad_scaler, and what they gather."""

    def _check_optimizer(self, optimizer) -> None:
        """check_optimizer, on every rank alike: the first step with an optimizer compares the ranks' findings
        (one all-gather), so that a rank whose optimizer is refused does not leave the others waiting for it in
        the step until the timeout."""
        try:
            check_optimizer(self, optimizer)
            problem = None
        except UsageError as e:
            problem = e
        try:
            agreed = optimizer in self._optimizers_agreed
        except TypeError:   # not weak-referenceable: not an optimizer, refused on every rank alike
            agreed = False
        if agreed:
            if problem is not None:
                raise problem
            return
        flags = self._gather(torch.tensor([float(problem is not None)], dtype=torch.float64),
                             "comparing the ranks' optimizers (the first step with one)").reshape(-1).tolist()
        if problem is not None:
            raise problem
        refused = [r for r, f in enumerate(flags) if f]
        if refused:
            raise UsageError(f"rank {self.rank}: step(optimizer=...) was refused on rank(s) {refused} (their error "
                             "says why: an optimizer over none of their trained parameters?), so no rank runs the "
                             "step; give every rank an optimizer over its own pipe.parameters()")
        self._optimizers_agreed.add(optimizer)

    def _gather(self, values: torch.Tensor, what: str = "reducing gradient statistics over the pipeline"):
        return self.runtime.allgather(values, what)

    def _counted_grads(self) -> list[torch.Tensor]:
        """The gradients this rank counts (sharded data parallelism: this replica's rows of them); none of a
        vocabulary parameter whose shard here holds only padding rows (a small vocabulary over many ranks)."""
        return [g for _, g, _ in self._counted_each() if g is not None]

    def _counted_each(self):
        """grads.counted_each of this rank's counted parameters (a sharded replica's rows are a slice of its own)."""
        return grads.counted_each(self._counted, self._counted_rows, whole=not self._sharded)

    def _norm_grads(self, p: float) -> list[torch.Tensor]:
        """The gradients whose order-p norm is the pipeline's: _counted_grads, except for the 0-"norm" of a
        vocabulary-parallel model, which counts a vocabulary parameter once over its shards (grads.counted_once:
        an all-gather over the pipeline, so every rank calls this together)."""
        if p == 0 and self.staged.vocab is not None:
            gather = functools.partial(self._gather, what="counting each vocabulary parameter once (norm_type=0)")
            return grads.counted_once(self._counted_each(), gather, self.rank, self.runtime.device)
        return self._counted_grads()

    @property
    def _sharded(self) -> bool:
        return self._dp is not None and self._dp.sharded

    @unusable_after_a_failure
    def get_total_norm(self, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """The norm of all the model's gradients over the whole pipeline (torch.nn.utils.get_total_norm's
        semantics, each parameter counted once); the same value on every rank. Call it on every rank."""
        self.settle()
        p = grads.check_norm_type(norm_type)
        gather = functools.partial(self._gather, what="the gradient norm (get_total_norm / clip_grad_norm_)")
        return grads.total_norm(self._norm_grads(p), p, gather,
                                error_if_nonfinite=error_if_nonfinite, device=self.runtime.device,
                                shards=self._dp.reduce if self._sharded else None)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the total norm of every rank's gradients (each
        parameter once: tied and mirrored copies, vocabulary row shards), every gradient of this rank scaled by
        max_norm / (norm + 1e-6) where that is below 1. Returns the total norm, the same on every rank (a
        non-finite one where any gradient holds an inf or NaN). Call it on every rank."""
        max_norm = grads.check_max_norm(max_norm, "clip_grad_norm_()", nan=True)   # (NaN: NaN grads, as torch's)
        total = self.get_total_norm(norm_type, error_if_nonfinite)
        grads.clip_grads(self.parameters(), max_norm, total, foreach)
        return total

    @unusable_after_a_failure
    def grads_finite(self) -> bool:
        """False when any gradient on any rank holds an inf or a NaN (then skip the optimizer step: every rank
        gets the same answer, over the data-parallel replicas too). Call it on every rank."""
        self.settle()
        finite = grads.grads_finite(self._counted_grads(), functools.partial(self._gather, what="grads_finite()"),
                                    self.runtime.device)
        return finite if self._dp is None else self._dp.all_true(finite)

    def grad_scaler(self, **kwargs) -> PipelineGradScaler:
        """A torch.amp.GradScaler (`kwargs`: init_scale, growth_factor, ...) whose inf checks cover the whole
        pipeline, for step(*batch, scaler=...): an inf on any rank skips the optimizer step on every rank."""
        return PipelineGradScaler(self._found_anywhere, self.runtime.device.type, **kwargs)

    def _found_anywhere(self, values: torch.Tensor) -> torch.Tensor:
        """The scaler's gather: every pipeline rank's found-inf; sharded, each already the maximum over the
        replicas, which hold different rows of the gradients (replicated ones hold the same)."""
        if self._sharded:
            values = self._dp.reduce(values, "max")
        return self._gather(values, "the grad scaler's inf check (scaler.unscale_)")
