"""The optimizer step inside the pipeline, without a global synchronization: post-validation.

`pipe.step(*batch, optimizer=opt, max_norm=1.0)` is the synchronous step: the pipeline's gradient norm and inf
check (one all-gather over every rank), clipping, `opt.step()` unless a gradient is not finite, and
`opt.zero_grad()`. Every rank waits there for the slowest one, and the next step's warm-up waits for the update.

With `post_validate=True` the same step runs without that wait (the Zero Bubble paper's post-validation):

1. the step's program ends with a prefix chain (passes/lower/step_boundary.py): each rank adds its partial
   values (the norm's power sum, maximum or minimum, an inf / NaN flag, its loss sum) to what rank r-1 sent and
   sends the sum to r+1, so rank p-1 ends with the totals;
2. each rank decides at once on its prefix, which only grows along the chain: an inf or a norm over max_norm
   there is certain to be in the totals, so the rank waits for them (a negative norm_type's norm shrinks along
   the chain instead: only an inf proves anything there); otherwise it updates optimistically
   (without clipping), keeping a snapshot of what the update changes (its parameters and their optimizer
   state) and the hyperparameters it used. Rank p-1 holds the totals and applies the right update at once;
3. the next step's program starts its warm-up forwards on the updated parameters while the totals travel
   back (p-1 -> 0); at its deadline it validates: if the totals show neither an inf nor clipping, every
   optimistic update was right and the step goes on. Otherwise (the same verdict on every rank) each rank
   restores its snapshot, applies the right update (clipped, or none) under the hyperparameters of the
   update it replaces (an LR scheduler stepped in between changed the param_groups' lr, momentum, betas: they
   are put back after), drops its warm-up (the messages in flight are drained) and runs the step again.

Losses, norms and parameters equal the synchronous step's bit for bit: the prefix chain adds the same
floats in the same order as the synchronous all-gather (grads.norm_from), the clip coefficient comes from the
same total, and a step run again starts from the same RNG state and buffers. What it costs: the snapshot (a
copy of this rank's parameters and optimizer state, `snapshot_bytes`), the last step's gradients kept until
the verdict, and, when a step clips or skips, its warm-up forwards run twice. `post_validate="inverse"` undoes a
wrong update in closed form instead of from the snapshot (zbcompile/rollback.py: no copy, exact to rounding).
The loss of a step is known on every rank only once it is validated: step() returns a StepResult that fills in
then (the next step, or `pipe.settle()`, which every other call of the pipeline makes first).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from zbcompile import grads
from zbcompile._torch_private import mark_optimizer_stepped
from zbcompile.agreement import check_step_arguments, step_arguments
from zbcompile.errors import DisagreementError, UsageError
from zbcompile.ir.program.ops import OpKind
from zbcompile.ir.program.ops.step_boundary import VALUES
from zbcompile.optimizer_checks import watch_pending
from zbcompile.rollback import Inverse, Snapshot, hyperparameters, in_force, state_change, state_marks
from zbcompile.runtime import abi
from zbcompile.runtime.eager import said_call
from zbcompile.step_verdict import combine, local_values, mixed, norm_dtype, verdict

__all__ = ["StepResult", "Boundary", "PostValidated"]


class StepResult:
    """What a post-validated `pipe.step(...)` returns. `float(result)` / `.loss`: the batch's mean loss (the same
    on every rank); `.norm`: the total gradient norm (None without max_norm); `.skipped`: no update (an inf or
    NaN gradient); `.clipped`: the gradients were scaled to max_norm. They are known once the step is validated,
    during the next step; reading one earlier settles the pipeline first (a wait for the last rank)."""

    __slots__ = ("_settle", "_loss", "norm", "skipped", "clipped")

    def __init__(self, settle: Callable[[], None]):
        self._settle, self._loss = settle, None
        self.norm: float | None = None
        self.skipped = self.clipped = False

    @property
    def validated(self) -> bool:
        return self._loss is not None

    @property
    def loss(self) -> float:
        if self._loss is None:
            self._settle()
        return self._loss

    def __float__(self) -> float:
        return self.loss

    def _fill(self, loss: float, norm: float | None, verdict: str) -> None:
        self._loss, self.norm = loss, norm
        self.skipped, self.clipped = verdict == "skip", verdict == "clip"

    def __repr__(self) -> str:
        if self._loss is None:
            return "StepResult(not validated yet)"
        return _described(self, self._loss)


class SteppedLoss(float):
    """What a synchronous `pipe.step(..., optimizer=...)` returns: the batch's mean loss, a float, with the step's
    `.norm` (the total gradient norm; None without max_norm), `.skipped` (no update: an inf or NaN gradient) and
    `.clipped`, as a post-validated step's StepResult has them (known at once here)."""

    validated = True

    def __new__(cls, loss: float, norm: float | None = None, verdict: str = "step"):
        self = super().__new__(cls, loss)
        self.norm, self.skipped, self.clipped = norm, verdict == "skip", verdict == "clip"
        return self

    @property
    def loss(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return _described(self, float(self))


def _described(result, loss: float) -> str:
    """`Name(loss=..., norm=... clipped)`: a step's result as its repr shows it."""
    what = " skipped" if result.skipped else " clipped" if result.clipped else ""
    norm = "" if result.norm is None else f", norm={result.norm:.6g}"
    return f"{type(result).__name__}(loss={loss:.6g}{norm}{what})"


class Boundary:
    """One rank's side of post-validation (see the module docstring): what its program's PREFIX / TOTALS /
    VALIDATE ops call (abi.prefix, abi.totals, abi.validate), and the update between two programs.

    counted(): the gradients this rank counts in the pipeline's sums (PipelineModule._counted_grads); params:
    every parameter of this rank (clipping scales them all, copies included). shards(values, op): a sum or max
    over the data-parallel replicas where they hold different rows (sharded), else None; mean_loss(loss): the
    loss averaged over the replicas (identity without data parallelism)."""

    def __init__(self, *, rank: int, ranks: int, microbatches: int, optimizer: torch.optim.Optimizer,
                 params: Sequence[torch.nn.Parameter], counted: Callable[[], list], max_norm: float | None,
                 norm_type: float, dtype: torch.dtype, device: torch.device, shards=None,
                 mean_loss: Callable[[float], float] = lambda loss: loss, scaler=None,
                 reseed: Callable[[float], None] = lambda seed: None, rollback: str = "snapshot",
                 names: Sequence[str] = (), trains: Callable[[], bool] = lambda: True):
        self.rank, self.ranks, self.m = rank, ranks, microbatches
        self.optimizer, self.params, self.counted = optimizer, tuple(params), counted
        self.names = tuple(names) or tuple(f"parameter {k}" for k in range(len(self.params)))
        self.max_norm, self.p = max_norm, norm_type
        self.dtype, self.device = dtype, device
        self.shards, self.mean_loss = shards, mean_loss
        self.scaler, self.reseed = scaler, reseed   # loss scaling: the scaler, and how to seed the next backward
        self.pending: StepResult | None = None   # the step whose verdict is still to come
        self.stepped = False                     # this rank updated optimistically (the snapshot holds the before)
        self._snapshot: Snapshot | None = None
        self._hyper: list[dict] | None = None    # the param_groups' hyperparameters of the pending update
        self._after: list[dict] | None = None    # ... right after it (what the optimistic step wrote there)
        self._written: list[str] = []            # the gradients the optimistic step itself changed in place
        self._weights: list[tuple] = []          # (name, param, version) after the update, for the next call
        self._marks: tuple | None = None         # the optimizer's state after the update (rollback.state_marks)
        self._groups = 0                         # how many param_groups the optimizer had at the step
        self._prefix: torch.Tensor | None = None
        self._kept: torch.Tensor | None = None   # rank p-1: the last step's totals
        self.snapshot_bytes = 0
        # rollback="inverse": the optimistic update undone in closed form (zbcompile/rollback.py), no snapshot
        self._inverse = Inverse(optimizer) if rollback == "inverse" else None
        self.redone = 0                          # steps run again after a wrong optimistic update
        self._grads: list[tuple] = []   # (name, param, the pending step's .grad, its version), for the verdict
        self.call = 0                   # the number of the step() call being run (PipelineModule._enter)
        # whether this rank trains a parameter now, and whether some rank did in the last validated step (a step
        # over a model frozen whole trains nothing: PipelineModule._check_trained)
        self.trains, self.trained = trains, True

    # ---- in the program --------------------------------------------------------------------------------
    def prefix(self, up: torch.Tensor | None, loss: torch.Tensor | None) -> torch.Tensor:
        found = self._unscale() if self.scaler is not None else None
        values = local_values(self.counted(), self.p, self.shards, found)
        values += [float(loss) if loss is not None else 0.0, float(self.call), float(self.call), float(self.trains())]
        if up is not None:
            values = combine(up.tolist(), values, self.p)
        self._prefix = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self._prefix

    def kept_totals(self) -> torch.Tensor:
        return self._kept

    def validate(self, totals: torch.Tensor) -> bool:
        """Apply the verdict of `totals` on the pending step; True where every optimistic update was right."""
        verdict, norm = self._verdict(totals)
        if mixed(totals):
            self._out_of_step(totals)
        result, self.pending = self.pending, None
        if self.rank == self.ranks - 1:   # updated rightly already, from the totals
            right = verdict == "step"
        else:
            right = verdict == "step" and self.stepped
            if not right:   # undone and redone as the step made it, whatever a scheduler has set since
                with in_force(self.optimizer, self._hyper, self._after):
                    if self.stepped:
                        self._undo()
                    self._apply(verdict, norm)
        self._snapshot, self._hyper, self.stepped = None, None, False
        self._after, self._grads, self._written, self._weights = None, [], [], []
        self._marks = None
        values = totals.tolist()
        self.trained = bool(values[5])
        if self.scaler is not None:   # the scale for the next backward, as scaler.update() makes it
            self._update_scale(values[1])
        self._zero_grad()
        result._fill(self.mean_loss(values[2] / self.m), None if norm is None else float(norm), verdict)
        self.redone += not right
        return right

    # ---- between two programs ------------------------------------------------------------------------
    def after_step(self, result: StepResult) -> None:
        """Update on this rank's prefix: optimistically, or (rank p-1, which has the totals) rightly."""
        prefix, self._prefix = self._prefix, None
        self.pending, self._groups = result, len(self.optimizer.param_groups)
        if self.rank == self.ranks - 1:
            self._kept = prefix
            verdict, norm = self._verdict(prefix)
            if not mixed(prefix):   # a step of mixed batches raises at its verdict, on every rank, unapplied
                self._written = self._apply(verdict, norm)   # (checked as on every rank: the same error)
            self._keep_grads()   # not needed here, but checked as on every rank: the same error everywhere
            return
        self._hyper = hyperparameters(self.optimizer)
        verdict, _ = self._verdict(prefix)
        # wait only where the prefix proves the totals' verdict, as it grows along the chain: an inf does, and a
        # norm over max_norm for norm_type >= 0. A negative order's norm shrinks along the chain: its prefix
        # clipping proves nothing, and every rank must redo exactly when the totals do not say "step"
        if (verdict == "step" or (verdict == "clip" and self.p < 0)) and not mixed(prefix):   # keep what changes
            if self._inverse is not None:
                self._inverse.before_step()
            else:
                self._snapshot = Snapshot(self.optimizer)
                self.snapshot_bytes = self._snapshot.nbytes
            self._written = self._step()
            self.stepped = True
        else:   # the update waits for the verdict; torch's first LR scheduler step would warn of a skipped one
            mark_optimizer_stepped(self.optimizer)
        self._after = hyperparameters(self.optimizer)
        self._keep_grads()

    def _out_of_step(self, totals: torch.Tensor) -> None:
        """DisagreementError on every rank (each has the same totals): the ranks ran different step() calls
        together (one refused or skipped a call the others made), so the step mixed batches. An optimistic update
        of it is undone first: every rank is left as before that step."""
        if self.stepped:
            self._undo()
        self.pending, self._snapshot, self.stepped, self._grads = None, None, False, []
        self._written, self._weights, self._marks = [], [], None
        self._zero_grad()
        first, last = (said_call(v) for v in totals.tolist()[3:5])
        raise DisagreementError(
            f"rank {self.rank}: the ranks are out of step (they ran step() {first} to {last} together): a "
            "call refused on some ranks only (a batch refused on one rank, an exception caught on one) left them "
            "pairing different calls, of one pipeline or of two, so the last post-validated step mixed different "
            "batches or models; it was not applied. "
            "Refuse or skip a batch on every rank alike (hand every rank the same batch), and restart the job")

    def _zero_grad(self) -> None:
        """The synchronous step's optimizer.zero_grad() after its update: of the groups the optimizer had then
        (a parameter outside them accumulates its gradient, as in eager, also where a group added since holds
        it)."""
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = groups[:self._groups]
        try:
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.optimizer.param_groups = groups

    def _keep_grads(self) -> None:
        """Hold the gradients the verdict may redo the update from (on a rank before the last), and their
        versions: the user's loop may clear .grad between two steps (opt.zero_grad(), as after a synchronous
        step)."""
        self._grads = [(n, p, p.grad, grads.local(p.grad)._version) for n, p in zip(self.names, self.params)
                       if p.grad is not None]
        self._weights = [(n, p, grads.local(p.detach())._version) for n, p in zip(self.names, self.params)]
        self._marks = state_marks(self.optimizer)

    def reclaim_grads(self) -> None:
        """Before anything of the next call runs: put the pending step's gradients back where .grad was set to
        None or rebound since, and refuse (UsageError, nothing run) where one was changed in place, by the
        optimizer's own step or since, or where a parameter was changed in place since."""
        if self._written:
            raise UsageError(
                f"{type(self.optimizer).__name__}.step() changed the gradient of {self._written[0]} in place (a "
                "weight decay added into .grad?), but a post-validated step may have to redo its update from the "
                "step's gradients, and they are lost. Use post_validate=False with this optimizer, or one that "
                "leaves .grad alone (torch's own optimizers do). Resume from a checkpoint")
        for name, p, version in self._weights:
            if grads.local(p.detach())._version != version:
                raise UsageError(
                    f"{name} was changed in place after a post-validated step (a clamp, a weight constraint?), but "
                    "the step's verdict, made during the next step, may undo and redo its update, which would "
                    "lose the change or apply the update to the changed values. Call pipe.settle() before changing "
                    "parameters between post-validated steps (it validates the step now). Resume from a "
                    "checkpoint")
        self._check_state()
        for name, p, g, version in self._grads:
            if grads.local(g)._version != version:
                raise UsageError(
                    f"the gradient of {name} was changed in place after a post-validated step "
                    "(opt.zero_grad(set_to_none=False), clipping or a hook of your own?), but the step's verdict, "
                    "made during the next step, may redo its update from those gradients, and they are lost. "
                    "Between post-validated steps leave .grad alone: step() clears it after the verdict "
                    "(opt.zero_grad() with set_to_none=True only lets go of it, which is harmless); to clip, "
                    "pass max_norm= to step(). Resume from a checkpoint")
            if p.grad is not g:
                p.grad = g

    def _check_state(self) -> None:
        """UsageError where the optimizer's state was changed since the step (cleared, an entry rebound or reset in
        place): a rollback or a deferred update at the verdict would write the step over it."""
        changed = None if self._marks is None else state_change(self.optimizer, self._marks)
        if changed is not None:
            what = "the optimizer's state" if isinstance(changed, str) else "the optimizer's state of " + \
                next((n for n, p in zip(self.names, self.params) if p is changed), "a parameter")
            raise UsageError(
                f"{what} was changed after a post-validated step (opt.state cleared or reset?), but the step's "
                "verdict, made during the next step, may undo and redo its update, which would write it over "
                "the change. Call pipe.settle() before changing the optimizer between post-validated steps "
                "(opt.load_state_dict() does that itself). Resume from a checkpoint")

    def _verdict(self, values: torch.Tensor) -> tuple[str, torch.Tensor | None]:
        return verdict(values.tolist(), self.p, self.max_norm, self.dtype, self.device)

    def _apply(self, kind: str, norm: torch.Tensor | None) -> list[str]:
        """`apply`; the names of the gradients the optimizer's step changed in place."""
        if kind == "clip":
            grads.clip_grads(self.params, self.max_norm, norm)
        return self._step() if kind != "skip" else []

    def _step(self) -> list[str]:
        """optimizer.step(); the names of the gradients it changed in place (a redo would read them changed)."""
        versions = [grads.local(p.grad)._version if p.grad is not None else None for p in self.params]
        self.optimizer.step()
        return [n for n, p, v in zip(self.names, self.params, versions)
                if v is not None and p.grad is not None and grads.local(p.grad)._version != v]

    # ---- loss scaling (GradScaler semantics) -------------------------------------------------------------
    def _unscale(self) -> float:
        """This rank's gradients unscaled as torch.amp.GradScaler.unscale_ does, without the pipeline-wide
        exchange of PipelineGradScaler (the prefix chain carries the flag); 1.0 where one is not finite."""
        torch.amp.GradScaler.unscale_(self.scaler, self.optimizer)
        found = self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        return float(sum(float(v) for v in found.values()) > 0)

    def _update_scale(self, bad: float) -> None:
        """scaler.update() with the pipeline's verdict as every rank's found-inf, then the backward's new seed."""
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        found = state["found_inf_per_device"]
        for v in found.values():
            v.fill_(bad)
        if not found:   # a rank without gradients: the verdict all the same
            found[self.device] = torch.full((1,), bad, dtype=torch.float32, device=self.device)
        self.scaler.update()
        self.reseed(self.scaler.seed(self.m))

    def _undo(self) -> None:
        """Undo the optimistic update: in closed form (rollback="inverse") or from the snapshot."""
        self._inverse.undo() if self._inverse is not None else self._snapshot.restore()


def _nbytes(value) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    local = grads.local(value)
    return local.numel() * local.element_size()


def key(optimizer, max_norm, norm_type, scaler, rollback) -> tuple:
    """What a Boundary is made for: other arguments make another (after the pending step is settled)."""
    return id(optimizer), max_norm, norm_type, id(scaler), rollback


ROLLBACKS = {True: "snapshot", "snapshot": "snapshot", "inverse": "inverse"}


class PostValidated:
    """The two runtimes of a post-validated step (passes/lower/step_boundary.py: `first`, `validating`) over this
    rank's parameters, and their Boundary. Made by PipelineModule on the first post-validated step."""

    def __init__(self, pipe, optimizer: torch.optim.Optimizer, max_norm: float | None, norm_type: float,
                 scaler=None, rollback: str = "snapshot"):
        from zbcompile.compiler import compile_boundary

        if pipe.compiled.options.capture:
            raise UsageError("step(post_validate=True) decides on the host between steps (optimistic update, "
                             "rollback, the step run again), which a captured CUDA graph cannot do: compile "
                             "without cuda_graphs, or step synchronously (post_validate=False)")
        first, validating, self.tags = compile_boundary(pipe.compiled)
        self.programs = validating
        self.first, self.validating = pipe._runtime_for(first), pipe._runtime_for(validating)
        self.rank, self.ranks = pipe.rank, len(first)
        self._buffers_written = any(op.kind is OpKind.COPY_BUFFER for op in validating[pipe.rank].ops)
        self._buffers = [b for b in pipe.buffers()]
        self.boundary, self._hooks = None, ()
        self.reset(pipe, optimizer, max_norm, norm_type, scaler, rollback)

    def reset(self, pipe, optimizer, max_norm, norm_type, scaler=None, rollback: str = "snapshot") -> None:
        """A Boundary for these arguments (after the pending step was settled)."""
        dp = pipe._dp
        mine = torch.tensor(step_arguments(max_norm, norm_type, rollback, scaler), dtype=torch.float64)
        rows = pipe._gather(mine.to(self.first.device), "the arguments of a post-validated step()").tolist()
        check_step_arguments(rows, pipe.rank)   # once per new arguments
        self.key = key(optimizer, max_norm, norm_type, scaler, rollback)
        self.reseed(pipe._seed_for(scaler))
        named = list(pipe.named_parameters())
        self.boundary = Boundary(
            rank=self.rank, ranks=self.ranks, microbatches=pipe.schedule.num_microbatches, optimizer=optimizer,
            params=[p for _, p in named], names=[n for n, _ in named], counted=pipe._counted_grads,
            max_norm=max_norm, norm_type=norm_type,
            dtype=norm_dtype(pipe), device=self.first.device,
            shards=dp.reduce if pipe._sharded else None,
            mean_loss=(lambda loss: loss) if dp is None else (lambda loss: dp.mean(loss, self.first.device)),
            scaler=scaler, reseed=self.reseed, rollback=rollback, trains=pipe._traced.trains_here)
        self.first.ctx.boundary = self.validating.ctx.boundary = self.boundary
        for hook in self._hooks:
            hook.remove()
        self._hooks = watch_pending(pipe, optimizer)

    def reseed(self, seed: float) -> None:
        """The seed of the next backward (1 / microbatches, times the loss scale), in both programs' input."""
        for runtime in (self.first, self.validating):
            runtime.grad_loss.fill_(seed)

    def step(self, batch) -> StepResult:
        b = self.boundary
        b.reclaim_grads()
        result = StepResult(self.settle)
        self.last = self.first if b.pending is None else self.validating   # whose timing slots this step fills
        if b.pending is None:
            self.first.run_step(batch)
        else:
            rng, buffers = self._rng_state(), self._buffer_state()
            try:
                self.validating.run_step(batch)
            except abi.Redo:   # rolled back and drained: the step again, on the right parameters
                self._restore_state(rng, buffers)
                self.last = self.first
                self.first.run_step(batch)
        b.after_step(result)
        return result

    def settle(self) -> None:
        """Validate the pending step now: the totals passed down the chain outside any program (every rank
        calls it at the same point: PipelineModule does before anything else it runs)."""
        b = self.boundary
        if b is None or b.pending is None:
            return
        b.reclaim_grads()
        ctx, r, tag = self.first.ctx, self.rank, self.tags.totals
        if r < self.ranks - 1:
            totals = abi.wait_recv(ctx, abi.recv(ctx, r + 1, tag, VALUES.shape, VALUES.dtype, "the step's totals"))
        else:
            totals = b.kept_totals()
        if r > 0:
            abi.wait_send(ctx, abi.send(ctx, (r - 1,), (tag,), "the step's totals", totals))
        b.validate(totals)   # no warm-up ran: nothing to run again

    def memory_plan(self):
        """The memory plan of the validating step, with what post-validation holds from the step's start to each
        rank's VALIDATE: the last step's gradients (as many bytes as the rank's parameters) and, on every rank
        but the last (which updates rightly at once), the snapshot of its optimistic update: its parameters and
        their optimizer state, as many bytes per parameter byte as this rank's last snapshot held (or its
        optimizer holds now), the same optimizer assumed on every rank."""
        from zbcompile.passes.analysis.memory import memory_plan

        b = self.boundary
        params = [p for group in b.optimizer.param_groups for p in group["params"]]
        mine = sum(_nbytes(p) for p in params) or 1
        snapshot = 0 if b._inverse is not None else b.snapshot_bytes or mine + sum(
            _nbytes(v) for p in params for v in b.optimizer.state.get(p, {}).values())
        plain = memory_plan(self.programs)
        held = [{"grads": r.resident["parameters"],
                 "params": round(r.resident["parameters"] * snapshot / mine) if r.rank < self.ranks - 1 else 0}
                for r in plain.ranks]
        return memory_plan(self.programs, held)

    def _rng_state(self):
        cuda = self.first.device.type == "cuda"
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.first.device) if cuda else None

    def _restore_state(self, rng, buffers) -> None:
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], self.first.device)
        with torch.no_grad():
            for b, saved in zip(self._buffers, buffers or ()):
                b.copy_(saved)

    def _buffer_state(self):
        """The buffers the warm-up may update (BatchNorm's running statistics), to put back before a redo."""
        return [b.detach().clone() for b in self._buffers] if self._buffers_written else None
