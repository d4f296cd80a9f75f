"""The forward-only calls of a PipelineModule: `evaluate(*batch)` (the mean loss) and `pipe(*inputs)` (the model's
outputs), a mixin of zbcompile.pipeline_module.PipelineModule.

Each runs a forward-only step lowered from the same split as the training step (compiler.compile_forward), made
when first asked for, per mode (train / eval), per result (loss / outputs) and per number of microbatches: the
compiled batch size, and the FORWARD_SIZES other sizes last used (a last smaller batch, a larger eval batch).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from zbcompile import eval_check, rng
from zbcompile._torch_private import forget_fx_sources, fx_sources_made
from zbcompile.errors import UsageError, ZBCompileWarning
from zbcompile.pipeline_failures import unusable_after_a_failure
from zbcompile.runtime import RankRuntime

__all__ = ["Evaluation", "FORWARD_SIZES"]

# evaluation steps kept per pipeline for batch sizes other than the compiled one (each holds static buffers of its
# batch): an evaluation loop uses one or two (its batch size, a last smaller batch)
FORWARD_SIZES = 4


class Evaluation:
    """PipelineModule's forward(), evaluate() and the evaluation steps' runtimes behind them."""

    @unusable_after_a_failure
    def forward(self, *inputs: torch.Tensor, **keywords):
        """The model's outputs for a whole batch of model inputs (no targets), from a forward-only step in the
        module's mode (eval(): dropout off, BatchNorm on its running statistics), as `model(*inputs)` under
        torch.no_grad() returns them: each tensor leaf the microbatches' outputs concatenated on dim 0 (a 0-dim
        leaf, e.g. an auxiliary loss, one value per microbatch). Returned on the rank that runs the loss stage,
        None on the others (as torch.distributed.pipelining's eval). Call it on every rank; `pipe(*inputs)`
        calls it."""
        if keywords and inputs:
            raise UsageError(f"forward() takes the model's inputs either by position or by keyword, not both; got "
                             f"{len(inputs)} by position and {sorted(keywords)} by keyword")
        inputs = self._bound(inputs, keywords, "forward")
        call = self._enter("forward")
        self.settle()
        m = self._forward_microbatches(inputs)
        local = self._checked(inputs, "forward", targets=False, microbatches=m)
        runtime = self._forward_runtime(self.training, outputs=True, microbatches=m)
        self._check_same_batch(inputs, "forward")
        self._agree_on_call("forward", call, m)
        self._replicas_share(m, "forward")
        with torch.inference_mode(False), rng.own_stream(self.rank, self._draws[runtime]):
            flat = runtime.run_batch(local)
        if flat is None:
            return None
        model_outputs = self.staged.meta["outputs"].outputs
        if model_outputs.numbers and not getattr(self, "_numbers_said", False):
            self._numbers_said = True
            warnings.warn(f"the model's outputs hold Python numbers ({_said_numbers(model_outputs.numbers)}): "
                          "pipe(x) returns them as the trace computed them, once, on one microbatch of the "
                          "example, so a shape or a count read in forward is the microbatch's, not the batch's; "
                          "return such values as tensors (one per row) to have them per batch", ZBCompileWarning,
                          stacklevel=2)
        rows = next((shape[0] for shape, _ in self.runtime.data_specs.values() if shape), None)
        dims = model_outputs.batch_dims(flat[:len(flat) // m], rows)
        outputs = model_outputs.rebuild(flat, m, dims)
        if self._dp is None or self._local_batches:   # dp_batch="local": the replica's own rows, as DDP's
            return outputs
        leaves, spec = torch.utils._pytree.tree_flatten(outputs)
        tensors = iter(self._dp.gather([t for t in leaves if isinstance(t, torch.Tensor)], dims))
        return torch.utils._pytree.tree_unflatten([next(tensors) if isinstance(t, torch.Tensor) else t
                                                   for t in leaves], spec)

    @unusable_after_a_failure
    def evaluate(self, *batch: torch.Tensor, **inputs: torch.Tensor) -> float:
        """The batch's mean loss from a forward-only step (model inputs, then loss targets, as step() takes them):
        no backward, no gradients written, nothing kept for a backward. It runs in the module's mode: after
        eval(), dropout is off and BatchNorm uses (and keeps) its running statistics; in train mode it is the
        forward of a training step (what `with torch.no_grad(): loss_fn(model(x), y)` does). The forward-only
        programs are lowered from the same split when first asked for. Call it on every rank."""
        batch = self._bound(batch, inputs, "evaluate")
        call = self._enter("evaluate")
        self.settle()
        m = self._forward_microbatches(batch)
        local = self._checked(batch, "evaluate", microbatches=m)
        runtime = self._forward_runtime(self.training, microbatches=m)
        self._check_same_batch(batch, "evaluate")
        self._agree_on_call("evaluate", call, m)
        share = self._replicas_share(m, "evaluate")
        runtime.call = call
        # (inference_mode off: the step's buffers must stay usable outside inference_mode too)
        with torch.inference_mode(False), rng.own_stream(self.rank, self._draws[runtime]):
            loss = runtime.step_batch(local)
            return loss if self._dp is None else self._dp.mean(loss * share, self.runtime.device)

    def _replicas_share(self, m: int, what: str) -> float:
        """With data parallelism, this replica's weight in the mean over the replicas: 1 where each is handed the
        global batch; with dp_batch="local" (a replica's last, smaller batch of an evaluation set) its share of
        the microbatches every replica evaluates, times their number, agreed on in one small all-gather. A
        sharded pipe that gathers parameters per microbatch (dp_gather="microbatch") needs the same number on
        every replica (its gathers pair microbatch by microbatch): UsageError on every replica otherwise."""
        if self._dp is None or not self._local_batches:
            return 1.0
        counts = [int(c) for c in self._dp.allgather(torch.tensor([float(m)], dtype=torch.float64))[:, 0]]
        options = self.compiled.options
        if len(set(counts)) > 1 and options.dp_shard and options.dp_gather == "microbatch":
            raise UsageError(f"{what}() with dp_batch=\"local\": the replicas were handed {counts} microbatches "
                             "(in replica order), but with dp_gather=\"microbatch\" they gather each microbatch's "
                             "parameters together; hand every replica the same number of rows (pad the last "
                             "batch, or drop it: DataLoader(drop_last=True)), or compile with dp_gather=\"step\"")
        return m * len(counts) / sum(counts)

    @property
    def _batch_replicas(self) -> int:
        """How many data-parallel replicas' rows a call's batch holds: all of them where each rank is handed the
        global batch, else 1 (no data parallelism, or dp_batch="local")."""
        return 1 if self._dp is None or self._local_batches else self._dp.size

    @property
    def _local_batches(self) -> bool:
        """Whether each data-parallel replica is handed its own rows (options.dp_batch="local")."""
        return self.compiled.options.dp_batch == "local"

    def _forward_microbatches(self, batch: Sequence[torch.Tensor]) -> int:
        """How many microbatches an evaluation call (evaluate, forward) cuts `batch` into: as many of the
        compiled microbatch shape as this replica's rows hold (the schedule's number for a batch of the compiled
        size; a last, smaller batch or a larger evaluation batch gets its own count). UsageError where the
        arguments hold different whole numbers; the schedule's number where one holds no whole number of them
        (_checked then says what is wrong)."""
        m, replicas = self.schedule.num_microbatches, self._batch_replicas
        counts = {}
        for i, (shape, _) in self.runtime.data_specs.items():
            t = batch[i] if i < len(batch) else None
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or not shape or not shape[0]:
                continue
            rows, left = divmod(t.shape[0], replicas)
            counts[i] = rows // shape[0] if not left and rows % shape[0] == 0 else 0
        if len(set(counts.values())) > 1 and 0 not in counts.values():
            said = ", ".join(f"argument {i}: {k}" for i, k in sorted(counts.items()))
            raise UsageError(f"the batch's arguments hold different numbers of microbatches of the example's shape "
                             f"({said}); hand every argument the same number of rows")
        return next(iter(counts.values())) if len(set(counts.values())) == 1 and 0 not in counts.values() else m

    def _forward_runtime(self, training: bool, outputs: bool = False, microbatches: int | None = None) -> RankRuntime:
        """The evaluation step's runtime for the mode, what it returns and the number of microbatches, made when
        first asked for (an eval-mode one after the eval check below); kept for the compiled number and for the
        FORWARD_SIZES other numbers last used."""
        m = microbatches or self.schedule.num_microbatches
        key = (training, outputs, m)
        if key in self._forward:
            self._forward.move_to_end(key)
            return self._forward[key]
        made = fx_sources_made()
        runtime = self._new_forward_runtime(training, outputs, m)
        self._forward[key] = runtime
        self._sources[key] = range(made, fx_sources_made())
        # the sizes in the order last used (any mode, loss or outputs): the compiled one and FORWARD_SIZES others
        recent = list(dict.fromkeys(k[2] for k in reversed(self._forward) if k[2] != self.schedule.num_microbatches))
        for k in [k for k in self._forward if k[2] in recent[FORWARD_SIZES:]]:   # its static buffers go with it
            dropped = self._forward.pop(k)
            self._runtimes.remove(dropped)   # (a failure in it was seen by the call it failed in)
            forget_fx_sources(self._sources.pop(k), [m for r in self._runtimes for m in r.graph_modules()])
        return runtime

    def _new_forward_runtime(self, training: bool, outputs: bool, m: int) -> RankRuntime:
        from zbcompile.compiler import compile_forward
        from zbcompile.passes.forward_only import switched_off

        if self._runtime_for is None:
            raise UsageError("this PipelineModule was built without a way to make more runtimes; build it with "
                             "zbcompile.compile or PipelineModule.from_staged to evaluate")
        with torch.inference_mode(False):
            options = self.compiled.options
            # once (it raises until the check passes); with vocabulary parallelism the model's tables hold this
            # rank's rows: not checked. What it finds about the outputs (another tree in eval mode) is kept for pipe(x)
            checked = False   # (Bernoulli draws at their expectation only where the check compared them)
            if not training and options.example is not None and self.staged.vocab is None:
                if "_eval_outputs" not in self.__dict__:
                    self.__dict__["_eval_checked"], self.__dict__["_eval_outputs"] = eval_check.check_eval_branches(
                        self.model, options.loss_fn, options.example)
                if outputs and self.__dict__["_eval_outputs"]:
                    raise UsageError(self.__dict__["_eval_outputs"])
                checked = self.__dict__["_eval_checked"]
            programs = compile_forward(self.compiled, training, outputs=outputs,
                                       microbatches=None if m == self.schedule.num_microbatches else m, means=checked)
            runtime = self._runtime_for(programs)
            # every rank's programs: the same decision on every rank
            self._draws[runtime] = self._own_rng and rng.has_random_ops(
                (g.gm for program in programs for g in program.graphs.values()), switched_off)
            return runtime


def _said_numbers(numbers: list[tuple[int, object]]) -> str:
    shown = ", ".join(f"leaf {k}: {v!r}" for k, v in numbers[:4])
    return shown + (f" and {len(numbers) - 4} more" if len(numbers) > 4 else "")
