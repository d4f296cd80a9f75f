"""Run one rank's program for one training step under torch.distributed, and time it.

The lowering emits each rank's step as straight-line Python (an fx GraphModule); this module holds the
side-effecting ops that code calls (posting and waiting P2P, frees, gradient hand-off, timing stamps) and
`RankRuntime`, which feeds the program its inputs, gathers the loss and per-action times from every rank
and exports them as a Chrome trace.

Host overhead per action is kept to a few Python calls: the program is generated code (no interpreter,
no per-action dispatch tables), P2P goes straight to the ProcessGroup's send / recv, receives land in
buffers made once, and a timing stamp is one `perf_counter()` stored into a preallocated array. On gloo the
threads of the P2P groups run below the main thread (tune_io_threads), which had lost its core to them.

Failures: every wait is bounded by `timeout` seconds; a peer that dies or stalls makes the others raise
RuntimeFailure (naming the op and the peer) instead of hanging.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx

from zbcompile.errors import RuntimeFailure, ZBCompileError
from zbcompile.program import OpKind, RankProgram, split_data_id
from zbcompile.stages import StagedModel

__all__ = ["StepContext", "RankRuntime", "StepTimings", "PROGRAM_OPS", "retain_freed_cpu_memory",
           "process_threads", "tune_io_threads", "GLOO_IO_NICE", "GLOO_IO_BATCH"]


class StepContext:
    """What the generated program needs besides tensors: where to post P2P, the device, the timeout and the
    timing slots.

    row: [loss sum, then the timing slots], float64 in an array.array that RankRuntime's gather sends as is
    (a tensor over the same memory); t: a view of its timing slots, which the program's stamps
    (`stamps[k] = perf_counter()`, emitted inline) store into as cheaply as into a list.
    send_pg[q] / recv_pg[q]: the process group carrying messages to / from peer q. A device backend runs
    each group's P2P on one stream per peer pair, so both directions of a pair on one group can deadlock
    (see passes/lower/streams.py); `channels` gives each direction its own group: `up` carries messages to
    higher ranks, `down` to lower ones. Without channels everything goes through `pg` (gloo matches by tag
    and never blocks a stream, so one group is enough for it). Peers are the groups' ranks.
    bufs: the static receive buffers, by slot (see passes/lower/buffers.py).
    """

    __slots__ = ("pg", "rank", "device", "timeout", "row", "t", "send_pg", "recv_pg", "bufs", "_specs")

    def __init__(self, pg, rank: int, device: torch.device, timeout: float, slots: int, *,
                 ranks: int = 1, channels: tuple | None = None, buffers: Sequence = ()):
        self.pg = pg
        self.rank = rank
        self.device = device
        self.timeout = timedelta(seconds=timeout)
        self.row = array.array("d", bytes(8 * (1 + slots)))
        self.t = memoryview(self.row)[1:]
        up, down = channels or (pg, pg)
        self.send_pg = [up if q > rank else down for q in range(ranks)]
        self.recv_pg = [down if q > rank else up for q in range(ranks)]
        self._specs = tuple(buffers)
        self.renew_buffers()

    def renew_buffers(self) -> None:
        """Make the static receive buffers (RankProgram.buffers) afresh: at start, and after a failed step,
        whose receives may still be posted into the old ones."""
        self.bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in self._specs]


# ---- ops the generated program calls (all marked side-effecting, so dead-code elimination keeps them) ----
@fx.node.has_side_effect
def recv(ctx: StepContext, peer: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype, what: str):
    """Post an irecv into a fresh buffer; returns a handle for wait_recv."""
    return _post_recv(ctx, torch.empty(shape, dtype=dtype, device=ctx.device), peer, tag, what)


@fx.node.has_side_effect
def recv_into(ctx: StepContext, peer: int, tag: int, slot: int, what: str):
    """Post an irecv into static buffer `slot`, which nothing still uses (see passes/lower/buffers.py)."""
    return _post_recv(ctx, ctx.bufs[slot], peer, tag, what)


def _post_recv(ctx: StepContext, buf: torch.Tensor, peer: int, tag: int, what: str):
    try:
        work = ctx.recv_pg[peer].recv([buf], peer, tag)
    except Exception as e:  # a dead peer can fail the post itself
        raise RuntimeFailure(f"rank {ctx.rank}: posting the receive of {what} from rank {peer} failed: {e}") from e
    return buf, work, what, peer


@fx.node.has_side_effect
def wait_recv(ctx: StepContext, handle) -> torch.Tensor:
    """Wait for a posted receive; returns the filled buffer."""
    buf, work, what, peer = handle
    _wait(ctx, work, "receiving", what, peer)
    return buf


@fx.node.has_side_effect
def send(ctx: StepContext, peers: tuple[int, ...], tags: tuple[int, ...], what: str, *tensors: torch.Tensor):
    """Post a batch of isends; returns a handle for wait_send (it keeps the tensors alive until then)."""
    try:
        if len(tensors) == 1:  # the common case, without building the batch
            works = (ctx.send_pg[peers[0]].send([tensors[0]], peers[0], tags[0]),)
        else:
            works = tuple(ctx.send_pg[p].send([t], p, tag) for t, p, tag in zip(tensors, peers, tags))
    except Exception as e:
        raise RuntimeFailure(f"rank {ctx.rank}: posting the send of {what} to ranks {list(peers)} failed: {e}") from e
    return works, what, peers


@fx.node.has_side_effect
def wait_send(ctx: StepContext, handle) -> None:
    works, what, peers = handle
    for work in works:
        _wait(ctx, work, "sending", what, peers)


def _wait(ctx: StepContext, work, doing: str, what: str, peer) -> None:
    """Wait with the step's timeout; the message is only built when the wait fails (this is the hot path)."""
    try:
        ok = work.wait(ctx.timeout)
    except Exception as e:
        raise RuntimeFailure(f"rank {ctx.rank}: {_describe(doing, what, peer)} failed (peer dead or stalled?): "
                             f"{e}") from e
    if ok is False:
        raise RuntimeFailure(f"rank {ctx.rank}: {_describe(doing, what, peer)} did not finish within "
                             f"{ctx.timeout.total_seconds()} s")


def _describe(doing: str, what: str, peer) -> str:
    if doing == "receiving":
        return f"receiving {what} from rank {peer}"
    if doing == "sending":
        return f"sending {what} to ranks {list(peer)}"
    return f"{doing} {what}"


@fx.node.has_side_effect
def free(*tensors: torch.Tensor) -> None:
    """The last use of `tensors`: the generated code drops its references right after this call."""


@fx.node.has_side_effect
def set_grad(param: torch.Tensor, grad: torch.Tensor, owned: bool) -> None:
    """Accumulate a finished gradient into param.grad (taking the tensor when this step owns it)."""
    if param.grad is None:
        param.grad = grad if owned else grad.clone()
    else:
        param.grad.add_(grad)


@fx.node.has_side_effect
def copy_buffer(buffer: torch.Tensor, value: torch.Tensor) -> None:
    buffer.copy_(value)


# in-place gradient accumulation, called directly by the program (no wrapper frame); it mutates its first
# argument, which fx cannot see on a builtin, so dead-code elimination must be told to keep it
accumulate_ = fx.node.has_side_effect(torch._foreach_add_)


def sum_losses(*losses: torch.Tensor) -> torch.Tensor:
    """This rank's microbatch losses (0-dim), summed in one device-side reduction."""
    return torch.stack(losses).sum() if len(losses) > 1 else losses[0]


def sum_in_order(*copies: torch.Tensor) -> torch.Tensor:
    """Sum one gradient's copies from several ranks in a fixed (rank) order: every holder gets equal bits."""
    total = copies[0] + copies[1]
    for t in copies[2:]:
        total.add_(t)
    return total


PROGRAM_OPS = {
    OpKind.RECV: recv, OpKind.WAIT_RECV: wait_recv, OpKind.SEND: send, OpKind.WAIT_SEND: wait_send,
    OpKind.FREE: free, OpKind.SET_GRAD: set_grad, OpKind.COPY_BUFFER: copy_buffer,
    OpKind.SUM: sum_in_order, OpKind.ADD_LOSS: sum_losses, OpKind.ACCUM: accumulate_,
}


# ---- host memory ------------------------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters (malloc.h)
_cpu_memory_retained = False


def retain_freed_cpu_memory() -> bool:
    """Keep freed CPU tensor memory in the process for reuse instead of handing it back to the OS.

    A training step allocates and frees the same large tensors every microbatch (logits and their grads,
    dense embedding grads: megabytes each). glibc serves such sizes with mmap and unmaps them on free, so
    the next microbatch page-faults its way through fresh zeroed pages: about 8% of a CPU step on the
    benchmark GPT. Raising the mmap and trim thresholds makes malloc reuse the memory, which is what a
    caching allocator does on GPU. Process-wide and idempotent; returns False where malloc is not glibc's.
    """
    global _cpu_memory_retained
    if _cpu_memory_retained:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # 32 MiB is glibc's largest mmap threshold; 1 GiB of free heap top is kept rather than trimmed
    _cpu_memory_retained = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _cpu_memory_retained


# ---- gloo's I/O threads ------------------------------------------------------------------------------
# gloo's TCP event-loop thread reads incoming messages and answers the peer's rendezvous notes. On each
# readiness event it only try-locks the socket pair's mutex and, failing that, goes straight back to
# epoll_wait, where the unread socket is still readable: it spins while the main thread holds the pair to
# post a send or receive. Worse, the loop thread a loopback write wakes is often placed on the writer's core
# and preempts it at once, lock held or not. With 2 vCPUs, on the null model (pp=2), a rank's loop threads
# made 40-120k epoll_wait calls per second each (5 ms CPU per 13 ms step) and each main thread waited 3-4 ms
# per step for a core. So the threads zbcompile's P2P groups start get
#   * a lower priority (nice GLOO_IO_NICE): the spin yields to the threads doing the work, while real I/O
#     still gets its share (nice 10: ~10% of a core against one busy thread); steps 8-23% shorter;
#   * SCHED_BATCH where the rank computes on one thread (torchrun's default): a woken loop thread no longer
#     preempts the running main thread; it runs when a core frees up, which a one-thread rank's core does as
#     soon as its main thread waits. Steps another 39-53% shorter. With an intra-op thread pool, whose
#     threads keep the cores busy, it measured up to 11% slower (2 threads per rank on 2 cores), so not there.
# The benchmark GPT's steps (compute-bound, one thread per rank) are unchanged within 1% by either.
def _io_setting(name: str, default: str, valid) -> str:
    value = os.environ.get(name, default).strip()
    if not valid(value):
        raise ZBCompileError(f"{name}={value!r} is not a valid setting; {_IO_SETTINGS_HELP[name]}")
    return value


_IO_SETTINGS_HELP = {
    "ZBCOMPILE_GLOO_IO_NICE": "give a nice value from 0 (leave the priority alone) to 19, e.g. 10",
    "ZBCOMPILE_GLOO_IO_BATCH": "give auto (SCHED_BATCH in one-thread ranks), 1 (always) or 0 (never)",
}
GLOO_IO_NICE = int(_io_setting("ZBCOMPILE_GLOO_IO_NICE", "10", lambda v: v.isdigit() and int(v) <= 19))
GLOO_IO_BATCH = _io_setting("ZBCOMPILE_GLOO_IO_BATCH", "auto", lambda v: v in ("auto", "1", "0"))


def process_threads() -> set[int]:
    """Ids of this process's threads (Linux /proc; empty where there is none). gloo's loop threads are named
    gloo_tcp_loop only from torch 2.13 on, so callers find a group's threads as the ones its creation added."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def tune_io_threads(tids) -> int:
    """Apply the scheduling above to threads `tids` (api._p2p_channels passes the threads its P2P groups
    started: each group's loop thread and its collective workers, idle since P2P runs on the calling thread).
    Never raises a thread's priority (that would need privileges); returns how many threads it changed.
    A scheduling hint, not a requirement: threads gone meanwhile, or a system refusing, are left as they are."""
    batch = GLOO_IO_BATCH == "1" or (GLOO_IO_BATCH == "auto" and torch.get_num_threads() == 1)
    batch = batch and hasattr(os, "SCHED_BATCH")
    changed = 0
    for tid in tids:
        try:
            done = False
            if GLOO_IO_NICE > 0 and os.getpriority(os.PRIO_PROCESS, tid) < GLOO_IO_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, GLOO_IO_NICE)
                done = True
            if batch and os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                done = True
            changed += done
        except OSError:
            continue
    return changed


# ---- timings --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimings:
    """Per-action start / end (seconds from the step's first start, on a clock shared by the host's ranks)
    for every rank, and the measured bubble per rank: 1 - busy / span, span = the whole step."""

    actions: tuple[tuple[tuple[str, float, float], ...], ...]
    span: float

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(e - s for _, s, e in row) for row in self.actions)

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(1.0 - b / self.span if self.span > 0 else 0.0 for b in self.busy)

    def chrome_trace(self) -> dict:
        events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "zbcompile step"}}]
        for r, row in enumerate(self.actions):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
            for name, s, e in row:
                kind = name.lstrip("0123456789").rstrip("0123456789")
                events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": r,
                               "ts": s * 1e6, "dur": (e - s) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str) -> str:
        with open(path, "w") as fh:
            json.dump(self.chrome_trace(), fh)
        return path


# ---- the runner -----------------------------------------------------------------------------------
class RankRuntime:
    """Runs `program` (the emitted GraphModule of `ir`) once per step.

    params / buffers: canonical fqn -> live tensor for every param:/buffer: the program reads.
    pg: the pipeline's ProcessGroup (pipeline rank = its group rank); None runs a one-rank pipeline.
    channels: (up, down) groups over the same ranks for P2P, one per direction (see StepContext).
    """

    def __init__(self, ir: RankProgram, program: fx.GraphModule, *, pg, device: torch.device,
                 params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                 timeout: float = 60.0, ranks: int | None = None, max_actions: int | None = None,
                 channels: tuple | None = None):
        self.ir = ir
        self.program = program
        if device.type == "cpu":
            retain_freed_cpu_memory()
        self.pg = pg
        self.device = device
        self.timeout = timeout
        self.num_ranks = ranks or ir.schedule.num_ranks
        self.names = tuple(str(op.action) for op in ir.run_ops())
        self.max_actions = max_actions or max(len(r) for r in ir.schedule.ranks)
        if len(self.names) > self.max_actions:
            raise RuntimeFailure(f"rank {ir.rank} runs {len(self.names)} actions but max_actions={max_actions}")
        # as many slots as the busiest rank has: every rank's gathered row has the same length
        self.ctx = StepContext(pg, ir.rank, device, timeout, 2 * self.max_actions, ranks=self.num_ranks,
                               channels=channels, buffers=ir.buffers)
        self.grad_loss = torch.full((), 1.0 / ir.schedule.num_microbatches, device=device)
        self._fixed = {n: params[n[6:]] for n in ir.inputs if n.startswith("param:")}
        self._fixed.update({n: buffers[n[7:]] for n in ir.inputs if n.startswith("buffer:")})
        self._fixed["grad_loss"] = self.grad_loss
        self._data = [split_data_id(n) for n in ir.inputs]
        # which flat user arguments (model inputs, then targets) this rank's program reads
        self.data_args = tuple(sorted({d[1] for d in self._data if d is not None}))
        m = ir.schedule.num_microbatches
        # per flat argument the traced microbatch's (shape, dtype), and the whole batch's (m microbatches)
        self.data_specs = _data_specs(ir.staged)
        self.batch_specs = {i: (torch.Size((m * shape[0], *shape[1:])), dtype)
                            for i, (shape, dtype) in self.data_specs.items()}
        self._staged = self._stage_inputs(ir, device)
        # every rank's action names, for the timings record; built once, not per step
        self._names = tuple(tuple(str(a) for a in row) for row in ir.schedule.ranks)
        # the gather's buffers, made once; this rank's row is ctx.row: [loss sum, start / end of every action]
        self._row = torch.frombuffer(self.ctx.row, dtype=torch.float64)
        self._send_row = self._row if device.type == "cpu" else torch.zeros_like(self._row, device=device)
        # on CPU the gathered rows are tensors over Python arrays too: the step reads every rank's loss as a
        # float from its array, where indexing and converting a tensor per rank took ~30 us per step with the
        # caches cold after the gather's wait (2-3% of the runtime's own host time per step, null model)
        self._row_arrays = None
        if device.type == "cpu":
            self._row_arrays = [array.array("d", bytes(len(self.ctx.row) * 8)) for _ in range(self.num_ranks)]
            self._rows = [torch.frombuffer(a, dtype=torch.float64) for a in self._row_arrays]
        else:
            self._rows = [torch.zeros_like(self._send_row) for _ in range(self.num_ranks)]
        self._stepped = False

    @property
    def last_step(self) -> StepTimings | None:
        """The last step's per-action times on every rank; assembled when asked for, not on every step."""
        if not self._stepped:
            return None
        rows = self._row_arrays if self._row_arrays is not None else [r.cpu().tolist() for r in self._rows]
        t0 = min(float(r[1]) for r, names in zip(rows, self._names) if names)
        actions = tuple(
            tuple((name, float(r[1 + 2 * j]) - t0, float(r[2 + 2 * j]) - t0) for j, name in enumerate(names))
            for r, names in zip(rows, self._names))
        span = max((row[-1][2] for row in actions if row), default=0.0)
        return StepTimings(actions, span)

    def _stage_inputs(self, ir: RankProgram, device: torch.device):
        """With ir.staged_inputs: ((argument index, input buffer) pairs, the program's arguments with fixed
        microbatch views of the buffers); None runs on fresh slices of each batch."""
        if not ir.staged_inputs or any(i not in self.batch_specs for i in self.data_args):
            return None
        bufs = {i: torch.empty(self.batch_specs[i][0], dtype=self.batch_specs[i][1], device=device)
                for i in self.data_args}
        views = {i: b.chunk(ir.schedule.num_microbatches) for i, b in bufs.items()}
        args = [self._fixed[n] if d is None else views[d[1]][d[0]] for n, d in zip(ir.inputs, self._data)]
        return tuple(bufs.items()), args

    def step_batch(self, batch: Sequence[torch.Tensor]) -> float:
        """Run this rank's program on the whole batch (flat user arguments, already checked against the traced
        microbatch shapes, split on dim 0 into num_microbatches); returns the batch's mean loss."""
        if self._staged is None:
            m = self.ir.schedule.num_microbatches
            data: list = [None] * len(batch)
            for i in self.data_args:   # only what this rank's stages read: a last stage needs no inputs
                data[i] = batch[i].to(self.device, non_blocking=True).chunk(m)   # m views in one C++ call
            return self.step(data)
        bufs, args = self._staged
        for i, buf in bufs:   # one copy per argument; the microbatch views were cut when the buffers were made
            buf.copy_(batch[i])
        return self._run(args)

    def step(self, data: Sequence[Sequence[torch.Tensor] | None]) -> float:
        """Run this rank's program on `data[i][mb]`, microbatch mb of flat user argument i (None for an argument
        this rank does not read, see data_args); returns the batch's mean loss, the same on all ranks."""
        return self._run([self._fixed[n] if d is None else data[d[1]][d[0]]
                          for n, d in zip(self.ir.inputs, self._data)])

    def _run(self, args: list) -> float:
        # grad mode off by the C switch and the generated forward called directly: the no_grad object and
        # nn.Module.__call__ cost tens of microseconds per step when the caches are cold after a barrier
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            loss = self.program.forward(self.ctx, *args)  # the emitted program has no hooks to run
        except BaseException:
            self.ctx.renew_buffers()  # receives of the failed step may still land in the old buffers
            raise
        finally:
            torch._C._set_grad_enabled(grad_was)
        return self._gather(loss)

    def _gather(self, loss) -> float:
        """One all-gather per step carries every rank's loss sum and action times."""
        self._stepped = False  # the rows are rewritten in place: a failed gather leaves no stale "last step"
        self.ctx.row[0] = float(loss) if loss is not None else 0.0
        send = self._send_row
        if send is not self._row:
            send.copy_(self._row)
        if self.pg is None:
            self._rows[0].copy_(send)
        else:
            try:
                work = self.pg.allgather([self._rows], [send])
            except Exception as e:
                raise RuntimeFailure(f"rank {self.ir.rank}: gathering the step's loss failed: {e}") from e
            _wait(self.ctx, work, "gathering", "the step's loss and timings", None)
        self._stepped = True
        if self._row_arrays is not None:
            return sum(a[0] for a in self._row_arrays) / self.ir.schedule.num_microbatches
        return sum(float(r[0]) for r in self._rows) / self.ir.schedule.num_microbatches


def _data_specs(staged: StagedModel) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """Microbatch shape and dtype of each flat user argument, read off the F graphs' data placeholders."""
    specs = {}
    for stage in staged.stages:
        nodes = stage.f.input_nodes()
        for i in stage.data:   # the split's list of the flat arguments the stage reads, as placeholders data:<i>
            val = nodes[f"data:{i}"].meta.get("val")
            if val is not None:
                specs[i] = (tuple(val.shape), val.dtype)
    return specs


__all__ += ["recv", "recv_into", "wait_recv", "send", "wait_send", "free", "set_grad", "copy_buffer", "sum_in_order",
            "sum_losses"]
