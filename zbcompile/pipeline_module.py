"""PipelineModule: this rank's share of a pipeline-parallel model and its compiled step, as an nn.Module.

`zbcompile.compile` returns one; `step(*batch)` trains on a whole batch, the state-dict methods see the user's
keys (zbcompile/checkpoint.py), and the inspection methods read the compiled programs (memory plan, the
generated code of any rank, the last step's timeline).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import fx, nn

from zbcompile.compiler import Compiled
from zbcompile.errors import UsageError
from zbcompile.ir.schedule import Schedule
from zbcompile.ir.stages import StagedModel
from zbcompile.passes.lower import emit_fx
from zbcompile.runtime import RankRuntime, StepTimings, abi

__all__ = ["PipelineModule"]


class PipelineModule(nn.Module):
    """This rank's share of a pipeline-parallel model: its parameters, its buffers and its compiled step.

    As an nn.Module it holds exactly this rank's share of the user's model under the model's own fully qualified
    names (`zbcompile.checkpoint.attach_share`): the parameters its stages use — the user's own nn.Parameter
    objects, so any torch optimizer works on parameters() — and the persistent buffers they read. A tied
    parameter is one Parameter under each of its names, as in the model itself: named_parameters() gives it
    once, under its first name; state_dict() under every name. So torch's state-dict helpers and
    torch.distributed.checkpoint see the user's keys (zbcompile/checkpoint.py: saving and loading at any layout).
    step(*batch) puts this step's gradients into their .grad (adding to what is there, like backward()).
    """

    def __init__(self, model: nn.Module, compiled: Compiled, runtime: RankRuntime, rank: int,
                 owned: tuple[str, ...], owned_buffers: tuple[str, ...] = (), group=None):
        from zbcompile.checkpoint import attach_share

        super().__init__()
        # Not a child module: the user's model keeps meta tensors for what other ranks hold, and its state
        # here is this rank's share only (attached below), under the same names.
        self.__dict__["model"] = model
        self.compiled = compiled
        self.staged = compiled.staged
        self.schedule = compiled.schedule
        self.programs = compiled.programs
        self.runtime = runtime
        self.rank = rank
        self.process_group = group
        self._owned = owned
        self._fx: dict[int, fx.GraphModule] = {rank: runtime.program}
        self._plan = None
        self.offload_report = compiled.offload   # per rank, what activation offload chose (compile's offload=)
        # per flat argument: the whole batch's shape and dtype (None: not traced), for step()'s one-comparison check
        staged = compiled.staged
        self._batch_specs = tuple(runtime.batch_specs.get(i) for i in range(staged.num_inputs + staged.num_targets))
        attach_share(self, model, owned, owned_buffers)   # last: the user's names may shadow the attributes above

    @classmethod
    def from_staged(cls, model: nn.Module, staged: StagedModel, schedule: Schedule, **options) -> PipelineModule:
        """Build from an already split model (split once, try several schedules). options: zbcompile.compile's
        (group, init_fn, timeout, offload, backend, cuda_graphs ...; loss_fn and example are the split's). The
        split's stage graphs create tensors (masks, positions) on the device they were traced for: the
        example's, or for a model on the meta device the device `compile` runs on."""
        from zbcompile.api import from_staged

        return from_staged(model, staged, schedule, **options)

    # ---- training ------------------------------------------------------------------------------
    def step(self, *batch: torch.Tensor) -> float:
        """One training step on the whole batch (model inputs, then loss targets; split on dim 0 into
        microbatches). Returns the batch's mean loss, the same value on every rank."""
        specs = self._batch_specs
        if len(batch) != len(specs):
            raise UsageError(f"step() takes {self.staged.num_inputs} model input(s) then "
                                 f"{self.staged.num_targets} target(s), {len(specs)} tensors; got {len(batch)}")
        for t, spec in zip(batch, specs):
            if spec is None or t.shape != spec[0] or t.dtype != spec[1]:
                self._check_microbatch_shapes(batch, self.schedule.num_microbatches)   # raises what is wrong
                break
        return self.runtime.step_batch(batch)

    __call__ = step

    def _check_microbatch_shapes(self, batch: Sequence[torch.Tensor], m: int) -> None:
        """Every argument splits into m microbatches of the shape the programs were traced for (static
        shapes, fixed P2P buffer sizes)."""
        specs = self.runtime.data_specs
        for i, t in enumerate(batch):
            if t.dim() == 0 or t.shape[0] % m:
                rows = t.shape[0] if t.dim() else 0
                raise UsageError(f"batch argument {i} has {rows} rows, which do not split into {m} equal "
                                     f"microbatches; use a batch size that is a multiple of {m}")
            spec = specs.get(i)
            if spec is None:
                continue
            shape, dtype = spec
            if t.dtype != dtype or t.shape[0] // m != shape[0] or t.shape[1:] != shape[1:]:
                got = (t.shape[0] // m, *t.shape[1:])
                raise UsageError(
                    f"batch argument {i}: {m} microbatches of shape {list(got)} ({t.dtype}), but the model was "
                    f"compiled for microbatches of shape {list(shape)} ({dtype}) from `example`; pass a batch of "
                    f"{m} x {shape[0]} rows with the example's other sizes, or compile again for this shape")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module.load_state_dict, but all or nothing: keys and shapes are checked against this rank's share
        first (`zbcompile.checkpoint.check_state_dict`), so a state dict of another model raises CheckpointError
        naming the first mismatches before any tensor is written. Tensors are copied in place (assign=True is
        refused: the compiled program holds the live parameters and buffers)."""
        from zbcompile.checkpoint import check_state_dict

        if assign:
            raise UsageError("PipelineModule.load_state_dict(assign=True): the compiled step holds this rank's "
                             "parameters and buffers, so they are loaded in place; call it with assign=False")
        check_state_dict(state_dict, self.state_dict(keep_vars=True), strict=strict, where=f"rank {self.rank}")
        return super().load_state_dict(state_dict, strict=strict)

    # ---- inspection ----------------------------------------------------------------------------
    def rank_program(self, rank: int | None = None) -> fx.GraphModule:
        """The generated program of `rank` (default: this rank); `.code` prints sends, receives, frees."""
        rank = self.rank if rank is None else rank
        if rank not in self._fx:
            self._fx[rank] = emit_fx(self.programs[rank], abi)
        return self._fx[rank]

    def memory_plan(self):
        """Every rank's device memory over one step, computed from the rank programs (passes/analysis/memory/):
        per rank the resident bytes, the bytes live after every op by category, and the peak and where it is.
        `.table()` prints it; `.to_json()` is what `zbcompile inspect --memory --json` writes."""
        from zbcompile.passes.analysis.memory import memory_plan

        if self._plan is None:
            self._plan = memory_plan(self.programs)
        return self._plan

    def measure_memory(self, *batch: torch.Tensor):
        """Run one training step (as step()) and measure the memory it allocates, independently of the plan:
        `torch.cuda.max_memory_allocated` on CUDA, a tracker of every storage the step's aten ops allocate on
        CPU (zbcompile.runtime.memory). Returns (loss, MemoryMeasurement); compare `.peak` with
        `memory_plan()[rank].peak_dynamic_bytes`. The plan assumes the step starts with `.grad` None
        (optimizer.zero_grad()'s default)."""
        from zbcompile.runtime.memory import measure

        return measure(lambda: self.step(*batch), self.runtime.device)

    @property
    def last_step(self) -> StepTimings | None:
        """Per-action start / end of every rank for the last step, and `.bubble` per rank."""
        return self.runtime.last_step

    def chrome_trace(self, path: str) -> str:
        """Write the last step as a Chrome trace (open in Perfetto / chrome://tracing)."""
        if self.runtime.last_step is None:
            raise UsageError("no step has run yet; call step() first")
        return self.runtime.last_step.save_chrome_trace(path)
