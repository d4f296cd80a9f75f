"""The replay-identity check: would a CUDA graph of this step replay correctly? Checked on any backend, gloo
and the loopback world included, by running the capture-ready program step after step eagerly.

A captured graph replays the device work of one step on the same memory. So a step can be captured only if
every step touches the same memory outside its own allocations and posts the same messages in the same order:

    static memory   every storage an op of the step reads or writes that the step did not allocate itself
                    (parameters, buffers, .grad, static receive slots, staged inputs, the host pool), by
                    address, in first-touch order: identical step after step (a .grad rebound, a fresh
                    receive buffer, a new input slice would differ)
    messages        every send, receive and collective each rank posts, in order, with peer, tag, shape and
                    dtype (and, for receives, the buffer's address): identical step after step
    escapes         nothing the step allocated may outlive it except what it returns: in a graph that memory
                    belongs to the graph's pool, which the next replay overwrites

`StepFootprint` records one step; `ReplayCheck` runs steps on a RankRuntime and raises CaptureError with the
first difference. tests/support/graph_standin.py uses the same footprint to emulate capture and replay on a CPU.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zbcompile.errors import CaptureError

__all__ = ["StepFootprint", "ReplayCheck", "record_messages", "first_difference"]


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


def _key(t: torch.Tensor) -> int:
    s = _storage(t)
    return s.data_ptr() if s.nbytes() else id(s)


class StepFootprint(TorchDispatchMode):
    """The aten ops of one step (this thread): the storages they touched that the step did not allocate, in
    first-touch order (`static`: address -> the op that first touched it, `written`: those some op wrote), and
    weak references to what the step allocated (`escaped()` after the step: those still alive).
    snapshot=True also keeps a copy of each static storage before its first write, which `restore()` puts back
    (a capture stand-in undoes the step it ran: a real capture does not run the device work)."""

    def __init__(self, snapshot: bool = False):
        super().__init__()
        self.static: dict[int, str] = {}
        self.written: set[int] = set()
        self._allocated: dict[int, weakref.ref] = {}
        self._snapshot = snapshot
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = _written_args(func, args, kwargs)
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                key = _key(t)
                if key not in self._allocated:
                    self.static.setdefault(key, str(func))
                    if key not in self.written and any(w is t for w in writes):
                        self.written.add(key)
                        if self._snapshot:
                            flat = _bytes_of(t)
                            self._saved.append((flat, flat.clone()))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = _key(t)
                known = self._allocated.get(key)
                # a dead entry is memory the step freed: a new storage at its address is a new allocation
                if key not in self.static and (known is None or known() is None):
                    self._allocated[key] = weakref.ref(_storage(t))
        return out

    def restore(self) -> None:
        """Put back every static storage written under this footprint (snapshot=True) as it was before."""
        for flat, saved in reversed(self._saved):
            flat.copy_(saved)
        self._saved.clear()

    def escaped(self, keep: Sequence[torch.Tensor] = ()) -> list[int]:
        """Addresses of storages the step allocated that are still alive, other than those of `keep`."""
        kept = {_key(t) for t in keep if isinstance(t, torch.Tensor)}
        return [k for k, ref in self._allocated.items() if ref() is not None and k not in kept]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(_storage(t))


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for k, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


# ---- messages --------------------------------------------------------------------------------------------
class _Recorder:
    """A process group whose posts are logged (kind, peer, tag, shape, dtype[, receive buffer address])."""

    def __init__(self, pg, log: list):
        self._pg, self._log = pg, log

    def send(self, tensors, dst, tag):
        t = tensors[0]
        self._log.append(("send", dst, tag, tuple(t.shape), t.dtype))
        return self._pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        t = tensors[0]
        self._log.append(("recv", src, tag, tuple(t.shape), t.dtype, t.data_ptr()))
        return self._pg.recv(tensors, src, tag)

    def broadcast(self, tensors, options):
        self._log.append(("broadcast", options.rootRank, tuple(tensors[0].shape), tensors[0].dtype))
        return self._pg.broadcast(tensors, options)

    def reduce(self, tensors, options):
        self._log.append(("reduce", options.rootRank, tuple(tensors[0].shape), tensors[0].dtype))
        return self._pg.reduce(tensors, options)

    def allgather(self, outputs, inputs):
        self._log.append(("all_gather", tuple(inputs[0].shape), inputs[0].dtype))
        return self._pg.allgather(outputs, inputs)

    def __getattr__(self, name):
        return getattr(self._pg, name)


@contextlib.contextmanager
def record_messages(ctx, log: list):
    """Log every post the program makes through the step context `ctx` (runtime.abi.StepContext) into `log`."""
    saved = ctx.send_pg, ctx.recv_pg, ctx.coll_pg
    wrap = {}

    def rec(pg):
        if pg is None:
            return None
        return wrap.setdefault(id(pg), _Recorder(pg, log))

    ctx.send_pg, ctx.recv_pg, ctx.coll_pg = [rec(p) for p in saved[0]], [rec(p) for p in saved[1]], rec(saved[2])
    try:
        yield log
    finally:
        ctx.send_pg, ctx.recv_pg, ctx.coll_pg = saved


# ---- the check ---------------------------------------------------------------------------------------------
class ReplayCheck:
    """Run a RankRuntime's steps with their footprint recorded; from step `warmup` + 1 on, each step's static
    memory, messages and escapes must equal the first such step's (CaptureError with the first difference).
    The program should be lowered for capture (CAPTURE_FINISHING); one ReplayCheck per rank, every rank
    stepping, as in training. From that step on .grad is kept in persistent buffers as the capture runtime
    keeps it (runtime/graphs.py: GradBuffers), whatever the caller does to .grad between steps."""

    def __init__(self, runtime, warmup: int = 1):
        from zbcompile.runtime.graphs import GradBuffers, accumulated_params

        self.runtime, self.warmup = runtime, warmup
        self.steps = 0
        self.reference: tuple | None = None
        self.grads = GradBuffers(accumulated_params(runtime.ir, runtime._fixed))

    def step(self, batch) -> float:
        """runtime.step_batch(batch), the program's run recorded (not the batch's copy into the static input
        buffers, nor the loss gather: both stay outside a captured graph)."""
        log: list = []
        footprint = StepFootprint()
        out: list = []
        program = self.runtime.program
        forward = program.forward

        def recorded(ctx, *args):
            with record_messages(ctx, log), footprint:
                result = forward(ctx, *args)
            out.append(result)   # what the step returns may outlive it: the graph's output
            return result

        program.forward = recorded
        if self.steps == self.warmup:
            self.grads.own()
        elif self.steps > self.warmup:
            self.grads.bind()
        try:
            loss = self.runtime.step_batch(batch)
        finally:
            del program.forward
        escaped = footprint.escaped(tree_leaves(out))
        self.steps += 1
        if self.steps > self.warmup:
            self._compare((tuple(footprint.static), tuple(log), len(escaped)))
        return loss

    def _compare(self, seen: tuple) -> None:
        rank = self.runtime.ir.rank
        if seen[2]:
            raise CaptureError(f"rank {rank}, step {self.steps}: {seen[2]} storage(s) the step allocated outlive it "
                               "(besides its output): in a CUDA graph they would be the graph pool's memory, "
                               "overwritten by the next replay. Lower with CAPTURE_FINISHING (no owned .grad, no "
                               "unslotted receive)")
        if self.reference is None:
            self.reference, self.names = seen, self._names()
            return
        ref = self.reference
        if seen[1] != ref[1]:
            raise CaptureError(f"rank {rank}, step {self.steps}: the messages differ from step {self.warmup + 1}'s "
                               f"({first_difference(ref[1], seen[1])}); a graph replays one order of posts")
        if seen[0] != ref[0]:
            raise CaptureError(f"rank {rank}, step {self.steps}: the step touched other memory than step "
                               f"{self.warmup + 1} did ({first_difference(ref[0], seen[0], self.names, self._names())}"
                               "); a graph replays the captured addresses")

    def _names(self) -> dict[int, str]:
        """Address -> a name, for the static tensors the runtime knows."""
        rt = self.runtime
        names = {}
        for n, t in rt._fixed.items():
            if isinstance(t, torch.Tensor):
                names[_key(t)] = n
                if t.grad is not None:
                    names[_key(t.grad)] = f"{n}.grad"
        for k, b in enumerate(rt.ctx.bufs):
            names[_key(b)] = f"receive slot {k}"
        return names


def first_difference(a: Sequence, b: Sequence, then: dict | None = None, now: dict | None = None) -> str:
    """The first entry where a and b differ; addresses shown by name (then: a's names, now: b's)."""
    def show(x, names):
        return names.get(x, hex(x)) if names is not None and isinstance(x, int) else str(x)
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {k}: {show(x, then)} then, {show(y, now)} now"
    return f"{len(a)} entries then, {len(b)} now"
