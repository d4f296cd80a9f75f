"""PipelineModule: this rank's share of a pipeline-parallel model and its compiled step, as an nn.Module.

`zbcompile.compile` returns one; `step(*batch)` trains on a whole batch, `evaluate(*batch)` and `pipe(*inputs)`
run a forward-only step for the loss or the model's outputs, the state-dict methods see the user's
keys (zbcompile/checkpoint.py), and the inspection methods read the compiled programs (memory plan, the
generated code of any rank, the last step's timeline).
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Sequence

import torch
from torch import fx, nn

from zbcompile import agreement, call_checks, grads, optimizer_checks, rng, share
from zbcompile.compiler import Compiled
from zbcompile.errors import CheckpointError, DisagreementError, UsageError
from zbcompile.grads import PipelineGradScaler
from zbcompile.pipeline_eval import Evaluation
from zbcompile.pipeline_failures import unusable_after_a_failure
from zbcompile.pipeline_grads import GradientStatistics
from zbcompile.post_validation import SteppedLoss
from zbcompile.step_verdict import synchronous_step
from zbcompile.split import autocast_state
from zbcompile.ir.schedule import Schedule
from zbcompile.ir.stages import StagedModel
from zbcompile.passes.lower import emit_fx
from zbcompile.passes.trace import input_keywords
from zbcompile.runtime import RankRuntime, StepTimings, abi
from zbcompile.runtime.eager import CALL_BITS, said_call

__all__ = ["PipelineModule"]


class PipelineModule(Evaluation, GradientStatistics, share.RefusedHooks, nn.Module):
    """This rank's share of a pipeline-parallel model: its parameters, its buffers and its compiled step.

    As an nn.Module it holds exactly this rank's share of the user's model under the model's own fully qualified
    names (`zbcompile.share.attach_share`): the parameters its stages use — the user's own nn.Parameter
    objects, so a torch optimizer that updates each parameter from its own state works on parameters() (LBFGS,
    which combines them all, is refused) — and the persistent buffers they read. A tied
    parameter is one Parameter under each of its names, as in the model itself: named_parameters() gives it
    once, under its first name; state_dict() under every name. So torch's state-dict helpers and
    torch.distributed.checkpoint see the user's keys (zbcompile/checkpoint.py: saving and loading at any layout).
    step(*batch) puts this step's gradients into their .grad (adding to what is there, like backward()).
    """

    def __init__(self, model: nn.Module, compiled: Compiled, runtime: RankRuntime, rank: int,
                 owned: tuple[str, ...], owned_buffers: tuple[str, ...] = (), group=None, *, runtime_for=None,
                 dp=None):
        from zbcompile.share import attach_share

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
        # runtime_for(programs) -> this rank's RankRuntime of other programs (the evaluation steps, made when first
        # asked for, one per mode; post-validation's two); every runtime made is kept in _runtimes, whose `failed`
        # says whether a program stopped half-way (_unusable_after_a_failure)
        self._runtimes = [runtime]
        self._runtime_for = None if runtime_for is None else functools.partial(self._new_runtime, runtime_for)
        # the evaluation steps' runtimes by (training, outputs, microbatches): the compiled number, and the few
        # other sizes last evaluated (FORWARD_SIZES of them, the least recently used dropped first)
        self._forward: collections.OrderedDict[tuple[bool, bool, int], RankRuntime] = collections.OrderedDict()
        self._sources: dict[tuple[bool, bool, int], range] = {}   # fx's numbers of the code each one made
        # whether each one runs a random op on some rank (an eval-mode one of a model with dropout does not, and
        # then draws nothing from the global generator, as eager's eval forward: rng.own_stream)
        self._draws: weakref.WeakKeyDictionary[RankRuntime, bool] = weakref.WeakKeyDictionary()
        self._failure: str | None = None   # the RuntimeFailure after which nothing more may run
        self._pv = None   # zbcompile.post_validation.PostValidated, made by the first step(post_validate=True)
        self._post_validated_last = False   # the last step was post-validated (memory_plan is then its plan)
        self._dp = dp   # zbcompile.data_parallel.Replicas: this rank's data-parallel group, or None
        self._calls: dict[str, int] = {}   # step / evaluate / forward calls past the batch check (check_batch)
        self._optimizers_agreed = weakref.WeakSet()   # the optimizers every rank's checks have passed
        self._entered: dict[str, int] = {}   # step / evaluate calls, refused ones included (RankRuntime.call)
        self._pipe_number = 0   # the same on every rank (agreement.wait_until_compiled): set by place()
        self.offload_report = compiled.offload   # per rank, what activation offload chose (compile's offload=)
        # per flat argument: the whole batch's shape and dtype (None: not traced), for step()'s one-comparison check
        staged = compiled.staged
        self._batch_specs = tuple(runtime.batch_specs.get(i) for i in range(staged.num_inputs + staged.num_targets))
        self._autocast = compiled.staged.meta.get("autocast", ())
        self._default_dtype = compiled.staged.meta.get("default_dtype")   # (dtype, op) where an op reads it
        self._seed_value = 1.0 / compiled.schedule.num_microbatches
        # random ops on the CPU draw from a stream of their own (zbcompile/rng.py): the global generator stays the
        # same on every rank (a shuffling DataLoader hands them the same batches). Any stage's, not only this
        # rank's: every rank draws its one number, or a rank without dropout would drift from the others
        self._own_rng = (runtime.device.type == "cpu" and isinstance(group, torch.distributed.ProcessGroup)
                         and rng.has_random_ops(st.f.gm for st in compiled.staged.stages))
        attach_share(self, model, owned, owned_buffers)   # last: the user's names may shadow the attributes above
        counted = compiled.counted_params(rank)
        self.__dict__["_counted"] = [model.get_parameter(n) for n in counted]
        # per counted parameter, its rows that hold vocabulary entries (None: all): the last shard's padding rows
        # never get a gradient, and would count as zeros in a norm that takes the minimum (norm_type=-inf)
        vocab = compiled.staged.vocab
        real = None if vocab is None else max(0, min(vocab.rows, vocab.size - rank * vocab.rows))
        self.__dict__["_counted_rows"] = [real if vocab is not None and n in vocab.params else None for n in counted]
        # what later calls are compared against: which parameters have a gradient, every tensor's dtype and device
        self.__dict__["_traced"] = call_checks.Traced.of(self, [(n, model.get_parameter(n)) for n in owned], model,
                                                         compiled.options.loss_fn)
        optimizer_checks.watch_optimizers(self)

    def _new_runtime(self, runtime_for, programs, **kwargs) -> RankRuntime:
        runtime = runtime_for(programs, **kwargs)
        self._runtimes.append(runtime)
        return runtime

    @classmethod
    def from_staged(cls, model: nn.Module, staged: StagedModel, schedule: Schedule, **options) -> PipelineModule:
        """Build from an already split model (split once, try several schedules). options: zbcompile.compile's
        (group, init_fn, timeout, offload, backend, cuda_graphs ...; loss_fn and example are the split's). The
        split's stage graphs create tensors (masks, positions) on the device they were traced for: the
        example's, or for a model on the meta device the device `compile` runs on."""
        from zbcompile.api import from_staged

        return from_staged(model, staged, schedule, **options)

    def __deepcopy__(self, memo):
        raise UsageError("a PipelineModule cannot be copied (copy.deepcopy, torch.optim.swa_utils.AveragedModel) "
                         "or pickled: it holds this rank's process groups and compiled programs. For an EMA of the "
                         "weights keep copies of this rank's parameters ({n: p.detach().clone() for n, p in "
                         "pipe.named_parameters()}) and update them after each step; to save, use "
                         "zbcompile.checkpoint.save or pipe.state_dict()")

    def __reduce_ex__(self, protocol):
        self.__deepcopy__({})

    # ---- training ------------------------------------------------------------------------------
    @unusable_after_a_failure
    def step(self, *batch: torch.Tensor, scaler: PipelineGradScaler | None = None,
             optimizer: torch.optim.Optimizer | None = None, max_norm: float | None = None, norm_type: float = 2.0,
             post_validate: bool | str = False, **inputs: torch.Tensor):
        """One training step on the whole batch (model inputs, then loss targets; split on dim 0 into
        microbatches). Returns the batch's mean loss, the same value on every rank. scaler: a grad_scaler() of
        this pipeline, whose scale seeds the backward (loss scaling for float16; the loss returned is not
        scaled).

        With `optimizer` (over this rank's parameters) the step updates too: the gradient norm over the whole
        pipeline clipped to `max_norm` (if given, `norm_type` as clip_grad_norm_'s), `optimizer.step()` unless a
        gradient on some rank is not finite (with `scaler`: scaler.step / update), then `zero_grad()`; the loss
        returned is then a SteppedLoss, a float with the step's `.norm`, `.clipped` and `.skipped`.
        post_validate=True makes that update without waiting for the other ranks (zbcompile/post_validation.py):
        the result is then a StepResult, whose loss, norm and skipped / clipped flags are known once the next
        step has validated this one (or `settle()` was called); losses and parameters equal the synchronous
        step's. post_validate="inverse" undoes a wrong optimistic update in closed form instead of from a copy
        (AdamW, SGD: zbcompile/rollback.py; no snapshot memory, exact to rounding)."""
        batch = self._bound(batch, inputs, "step")
        if max_norm is not None and optimizer is None:   # refused before anything runs, as every argument is
            raise UsageError("step(max_norm=...) clips before an optimizer step: pass optimizer= too (or call "
                             "pipe.clip_grad_norm_(max_norm) yourself after step())")
        norm_type = grads.check_norm_type(norm_type)
        if max_norm is not None:
            max_norm = grads.check_max_norm(max_norm, "step()")
        call = self._enter("step")
        self._check_step_context()
        if optimizer is not None:
            self._check_optimizer(optimizer)
        if post_validate is not False:
            return self._post_validated(batch, optimizer, max_norm, norm_type, scaler, post_validate, call)
        self.settle()
        self._seed(scaler)
        local = self._checked(batch, "step")
        self._check_same_batch(batch, "step")
        self.runtime.call, self.runtime.trains = call, self._traced.trains_here()
        with rng.own_stream(self.rank, self._own_rng):
            loss = self.runtime.step_batch(local)   # with dp, the program averaged the gradients over the replicas
        self._post_validated_last = False
        if self._traced.trainable and not self.runtime.some_rank_trains:
            raise call_checks.nothing_trained("the step trained nothing, on any rank: it wrote no gradient")
        loss = loss if self._dp is None else self._dp.mean(loss, self.runtime.device)
        if optimizer is not None:
            try:
                return SteppedLoss(loss, *synchronous_step(self, optimizer, max_norm, norm_type, scaler))
            except DisagreementError:   # raised on every rank alike, before any update
                raise
            except BaseException as e:   # after the exchange: the peers update, this rank did not, or in part
                self._failure = f"its optimizer step failed on this rank after the ranks' exchange: {e!r}"[:300]
                raise
        return loss

    def _post_validated(self, batch, optimizer, max_norm, norm_type, scaler, how, call: int):
        from zbcompile.post_validation import ROLLBACKS, PostValidated, key

        if how not in ROLLBACKS:
            raise UsageError(f"step(post_validate={how!r}): give False (synchronous), True or 'snapshot' (roll a "
                             "wrong optimistic update back from a copy) or 'inverse' (undo it in closed form: "
                             "AdamW / SGD, no copy, exact to rounding)")
        if optimizer is None:
            raise UsageError("step(post_validate=True) updates the parameters itself: pass optimizer= (a torch "
                             "optimizer over pipe.parameters())")
        if norm_type == 0 and max_norm is not None and self.staged.vocab is not None:   # (step checked norm_type)
            raise UsageError("step(max_norm=..., norm_type=0, post_validate=True) with vocab_parallel: the 0-\"norm\" "
                             "counts nonzero tensors, and a vocabulary parameter is one tensor over every rank's "
                             "rows, which the prefix chain cannot count once; use post_validate=False (the "
                             "synchronous step counts it once) or another norm_type")
        self._seed_for(scaler)   # refuses a scaler of another pipeline before anything runs
        local = self._checked(batch, "step")
        self._check_same_batch(batch, "step")
        rollback, pv = ROLLBACKS[how], self._pv
        if pv is None:
            pv = self._pv = PostValidated(self, optimizer, max_norm, norm_type, scaler, rollback)
        elif pv.key != key(optimizer, max_norm, norm_type, scaler, rollback):   # other arguments: settle first
            pv.settle()
            pv.reset(self, optimizer, max_norm, norm_type, scaler, rollback)
        self.runtime.forget_last_step()   # it gathers no timings: last_step is None, not an older step's
        self._post_validated_last = True
        pv.boundary.call = call   # compared along the prefix chain, as the synchronous step's loss gather does
        with rng.own_stream(self.rank, self._own_rng):
            result = pv.step(local)
        self._check_trained()
        return result

    @unusable_after_a_failure
    def settle(self) -> None:
        """Validate the last post-validated step now (a wait for the last rank): its StepResult is then known and
        the parameters are final. Every other call of the pipeline does this first; call it on every rank
        before reading the parameters or the optimizer's state yourself (a checkpoint, an evaluation)."""
        if self._pv is not None:
            self._pv.settle()
            self._check_trained()

    def _check_trained(self) -> None:
        """UsageError, on every rank alike, where the last post-validated step to be validated trained nothing on
        any rank (the whole model frozen through pipe.parameters(), each rank its own share): its prefix chain
        carries whether each rank trained, as the synchronous step's gather does."""
        boundary = self._pv.boundary
        if not boundary.trained:
            boundary.trained = True   # said once
            if self._traced.trainable:
                raise call_checks.nothing_trained("the post-validated step before this call trained nothing, on "
                                                  "any rank: it wrote no gradient")

    def state_dict(self, *args, **kwargs):
        """nn.Module.state_dict, after the pending post-validated step (if any) is validated; after a failure the
        state as it is (nothing more can be exchanged with the peers)."""
        if self._failure is None:
            self.settle()
        return super().state_dict(*args, **kwargs)

    def _bound(self, batch: tuple, inputs: dict, what: str) -> tuple:
        """The batch flat, as the step takes it: the model's inputs given by keyword (`step(**batch)`, named as
        the example's dict of inputs) in the example's order, then what came by position (the loss targets).
        By position a dict's values bind by its order, which a collator may not keep: keywords are safer."""
        if not inputs:
            return batch
        names = input_keywords(self.compiled.options.example)
        if not names:
            raise UsageError(f"{what}() takes the batch by position: the example's model inputs are not a dict of "
                             f"keyword arguments; got keyword arguments {sorted(inputs)}")
        missing, extra = [n for n in names if n not in inputs], sorted(set(inputs) - set(names))
        if missing or extra:
            said = "; ".join(f"{k} {v}" for k, v in (("missing", missing), ("not in the example", extra)) if v)
            raise UsageError(f"{what}(**inputs) takes the model's inputs named as the example's: {list(names)} "
                             f"({said}); loss targets go by position after them")
        return (*(inputs[n] for n in names), *batch)

    def _checked(self, batch: Sequence[torch.Tensor], what: str, targets: bool = True,
                 microbatches: int | None = None) -> Sequence[torch.Tensor]:
        """This rank's share of a batch (_share), refused with UsageError unless it is what the compiled step
        takes: flat tensors with data, as many as it has arguments, each splitting into `microbatches` (default:
        the schedule's number) of the traced shape and dtype."""
        call_checks.check_kinds(batch, what, self.runtime.device)
        if what != "step":   # (step's context check covers it)
            self._traced.check_model()
            self._traced.check_layouts(self.rank)
            call_checks.check_autocast(what, self._autocast, autocast_state())
            call_checks.check_default_dtype(what, self._default_dtype)
        m = microbatches or self.schedule.num_microbatches
        staged = self.staged
        call_checks.check_shapes(batch, self._batch_specs, self.runtime.data_specs,
                                 (staged.num_inputs, staged.num_targets), m, what, targets,
                                 any_count=what != "step", replicas=self._batch_replicas)
        local = self._share(batch, what, m)
        call_checks.check_vocabulary(local, staged.vocab, m, what, targets)
        return local

    def _share(self, batch: Sequence[torch.Tensor], what: str, m: int) -> Sequence[torch.Tensor]:
        """This data-parallel replica's rows of the global batch (the batch itself without data parallelism, or
        where each replica is handed its own rows), for m microbatches."""
        if self._dp is None or self._local_batches:
            return batch
        return self._dp.share(batch, m, what)

    def train(self, mode: bool = True) -> PipelineModule:
        """Train mode (the default) or, with mode=False, eval mode: step() trains only in train mode;
        evaluate() runs the forward of the mode (eval: dropout off, BatchNorm on its running statistics)."""
        if not isinstance(mode, bool):
            raise UsageError(f"train(mode) takes a bool, got {mode!r}")
        self.training = mode
        share.set_mode(self, mode)
        return self

    def _refuse(self, kind: str):
        """A hook on the pipe itself (share.RefusedHooks) would run for pipe(x) at most: step() and evaluate() run
        the compiled programs, which never call this module's forward and have no backward of it."""
        raise UsageError(f"{kind} on the PipelineModule itself would never run in step() or evaluate(): they run "
                         "the compiled programs, not this module's forward, and no autograd backward of it. Register "
                         "it on your model before zbcompile.compile (a forward hook's tensor code is traced in), or "
                         "read the outputs pipe(x) returns")

    def _apply(self, fn, recurse: bool = True):
        """nn.Module.to / double / half / float / cuda / cpu / to_empty (and share_memory()) all convert through
        here: one that would change a tensor's dtype or device, or replace a buffer, is refused before any tensor
        is touched (the stage graphs, P2P buffers and messages are fixed to what was compiled; a rank converted
        alone dies in the next step's collectives)."""
        call_checks.check_conversion(self, fn, self.rank)
        call_checks.check_replacement(self.model, fn, self.rank)
        return super()._apply(fn, recurse)

    def _enter(self, what: str) -> int:
        """This call's number among the calls of its kind, counted before anything can refuse it: every rank
        compares them in the step's loss gather (RankRuntime.call), so a call refused on one rank only is found.
        It carries the pipeline's number too (pipe * 2**CALL_BITS + count), so that where a job's pipes share
        their groups, one pipe's call paired with another's on a peer is found as well."""
        self._entered[what] = self._entered.get(what, 0) + 1
        return (self._pipe_number << CALL_BITS) + self._entered[what]

    def _check_same_batch(self, batch: Sequence[torch.Tensor], what: str) -> None:
        agreement.check_same_batch(self, batch, what)

    def _agree_on_call(self, what: str, call: int, m: int) -> None:
        """DisagreementError on every rank unless every rank makes this evaluation call (evaluate, forward) with
        the same number and the same number of microbatches: one labelled all-gather before the program runs.
        The program's own loss gather compares call numbers too late here: ranks out of step (a call refused
        on one rank only) running programs of other sizes would wait on each other's messages until the
        timeout and lose the process groups, before any gather."""
        self._gather(torch.zeros(1, dtype=torch.float64), f"{what}() {said_call(call)} of {m} microbatches")

    def _check_step_context(self) -> None:
        """What a compiled training step cannot honour (zbcompile/call_checks.py): eval mode, no_grad, another
        autocast region; a parameter unfrozen or a tensor converted since compile."""
        call_checks.check_step_context(self.training, self._autocast, autocast_state())
        call_checks.check_default_dtype("step", self._default_dtype)
        self._traced.check(self.rank, bool(self.compiled.options.capture))

    def _seed(self, scaler: PipelineGradScaler | None) -> None:
        """The backward's seed for this step: 1 / microbatches, times the scaler's scale."""
        seed = self._seed_for(scaler)
        if seed != self._seed_value:
            self.runtime.grad_loss.fill_(seed)
            self._seed_value = seed

    def _seed_for(self, scaler: PipelineGradScaler | None) -> float:
        m = self.schedule.num_microbatches
        if scaler is None:
            return 1.0 / m
        if not isinstance(scaler, PipelineGradScaler) or scaler._gather != self._found_anywhere:
            raise UsageError("step(scaler=...) takes the scaler this pipeline made (scaler = pipe.grad_scaler()), "
                             "whose inf checks cover every rank; a plain torch.amp.GradScaler sees this rank only, "
                             f"so ranks would skip different steps (got {type(scaler).__name__})")
        return scaler.seed(m)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module.load_state_dict, but all or nothing: keys and shapes are checked against this rank's share first
        (`zbcompile.checkpoint_checks.check_state_dict`), so a state dict of another model raises CheckpointError
        naming the first mismatches before any tensor is written. Tensors are copied in place (assign=True is
        refused: the compiled program holds the live parameters and buffers). A vocabulary parameter's entry may be
        this rank's rows (what state_dict() gives) or the whole table, of which this rank keeps its rows; with
        dp_shard, a parameter's entry may be its DTensor (what state_dict() gives) or the whole tensor, of which
        this replica keeps its rows. The plain model's whole state dict loads as it is, strict or not: the entries
        of the other ranks' stages are the model's, not unexpected, and each rank loads its own."""
        from zbcompile.checkpoint_checks import check_state_dict
        from zbcompile.checkpoint_rows import rows_of_whole_tables

        if assign:
            raise UsageError("PipelineModule.load_state_dict(assign=True): the compiled step holds this rank's "
                             "parameters and buffers, so they are loaded in place; call it with assign=False")
        live = self.state_dict(keep_vars=True)
        elsewhere = self.model.state_dict(keep_vars=True).keys() - live.keys()   # the other ranks' stages'
        state_dict = rows_of_whole_tables(self, {k: v for k, v in state_dict.items() if k not in elsewhere}, live)
        check_state_dict(state_dict, live, strict=False, where=f"rank {self.rank}")   # the shapes
        if self._sharded:   # a whole tensor for a sharded parameter: this replica's rows of it
            from zbcompile.checkpoint import as_live

            state_dict = {k: as_live((v, live[k])) if k in live and hasattr(live[k], "device_mesh")
                          and not hasattr(v, "device_mesh") else v for k, v in state_dict.items()}
        try:
            check_state_dict(state_dict, live, strict=strict, where=f"rank {self.rank}")
        except CheckpointError as keys:
            return self._load_or_restore(state_dict, keys)
        return super().load_state_dict(state_dict, strict=strict)

    def _load_or_restore(self, state_dict, refusal: CheckpointError):
        """A strict load whose keys are not this rank's: the module's own load code may still take them (a
        legacy key it renames; BatchNorm's checkpoints from before num_batches_tracked), so torch's load decides.
        Where it refuses, every parameter and buffer is put back as it was and the key check's error raised."""
        saved = [(t, t.detach().clone()) for t in dict.fromkeys([*self.parameters(), *self.buffers()])]
        try:
            return super().load_state_dict(state_dict, strict=True)
        except RuntimeError:
            with torch.no_grad():
                for t, before in saved:
                    t.copy_(before)
            raise refusal from None

    # ---- inspection ----------------------------------------------------------------------------
    def rank_program(self, rank: int | None = None) -> fx.GraphModule:
        """The generated program of `rank` (default: this rank); `.code` prints sends, receives, frees."""
        rank = self.rank if rank is None else rank
        if not isinstance(rank, int) or not 0 <= rank < len(self.programs):
            raise UsageError(f"rank_program(rank): rank is one of 0..{len(self.programs) - 1}, got {rank!r}")
        if rank not in self._fx:
            self._fx[rank] = emit_fx(self.programs[rank], abi)
        return self._fx[rank]

    def memory_plan(self):
        """Every rank's device memory over one step, computed from the rank programs (passes/analysis/memory/):
        per rank the resident bytes, the bytes live after every op by category, and the peak and where it is.
        `.table()` prints it; `.to_json()` is what `zbcompile inspect --memory --json` writes. When the last
        step was post-validated: the plan of that step, which also holds the last step's gradients and the snapshot
        of its optimistic update until the deadline (zbcompile/post_validation.py)."""
        from zbcompile.passes.analysis.memory import memory_plan

        if self._post_validated_last:
            return self._pv.memory_plan()
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

        if self.compiled.options.backend is not None and self.runtime.device.type == "cpu":
            raise UsageError(f"measure_memory() on CPU tracks the storages aten ops allocate, but with backend="
                             f"{self.compiled.options.backend!r} the stage graphs' compiled kernels allocate their "
                             "buffers where it cannot see them (it would report a small part of the peak); measure "
                             "a pipe compiled without backend= (the same programs and plan), or on CUDA")
        return measure(lambda: self.step(*batch), self.runtime.device)

    @property
    def last_step(self) -> StepTimings | None:
        """Per-action start / end of every rank for the last step, and `.bubble` per rank; None before the first
        step and after a post-validated one (it gathers no timings: that would be the exchange it removes)."""
        return self.runtime.last_step

    def chrome_trace(self, path: str) -> str:
        """Write the last step as a Chrome trace (open in Perfetto / chrome://tracing)."""
        if self.runtime.last_step is None:
            raise UsageError("no step with timings has run: call step() first (a post-validated step gathers "
                             "no timings; run one synchronous step(...) to trace)")
        return self.runtime.last_step.save_chrome_trace(path)
