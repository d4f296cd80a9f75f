"""The runtime ABI: the functions a rank program's generated code calls, and the step context it gets.

The emitter (zbcompile.passes.lower.emit) names these functions by the op specs' `runtime` field
(zbcompile.ir.program.ops); nothing else in the compiler imports this module. Each is marked side-effecting so
that fx's dead-code elimination keeps it. They are the hot path: a few Python calls per op, P2P straight to the
ProcessGroup's send / recv, receives into buffers made once, and messages for errors built only on failure.

Failures: every wait is bounded by the step's timeout; a peer that dies or stalls makes the others raise
RuntimeFailure (naming the op and the peer) instead of hanging. A program lowered for CUDA graphs
(RankProgram.wait_timeout False) calls the waits with timed=False instead: a plain work.wait(), which only
records a stream dependency, where work.wait(timeout) would block the host during capture.
"""

from __future__ import annotations

import array
import warnings
from datetime import timedelta
from time import perf_counter
from typing import Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.tensor import DTensor

from zbcompile.errors import RuntimeFailure, ZBCompileWarning
# the offload / reload copies (passes/lower/offload.py), here too: the emitter finds every ABI function on this module
from zbcompile.runtime.copies import offload, reload, wait_offload, wait_reload

__all__ = ["StepContext", "stamp_event", "recv", "recv_into", "wait_recv", "send", "wait_send", "collective",
           "wait_collective", "dp_reduce", "wait_dp", "dp_gather", "wait_gather", "wait", "offload", "wait_offload",
           "reload", "wait_reload", "free", "set_grad", "copy_buffer", "accumulate_", "sum_losses", "keep_outputs",
           "sum_in_order", "prefix", "totals", "validate", "Redo"]


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
    coll_pg: the group the vocabulary layers' collectives run on (all ranks): a group of their own, so that on a
    device they never queue behind P2P on a communicator's stream.
    dp_pg / dp_size / dp_rank: the data-parallel group (this rank in every replica) the gradient buckets are
    averaged over (passes/lower/dp_reduce.py) and sharded parameters gathered from (passes/lower/dp_shard.py),
    its size and this replica's place in it; None / 1 / 0 without data parallelism.
    host: the host pool of offloaded activations, by slot (RankProgram.host_buffers, passes/lower/offload.py):
    flat bytes, one device storage each, made once and pinned on CUDA so that copies run asynchronously.
    copy_stream: the rank's one stream for offload / reload copies on CUDA (they queue on it in program order);
    None on CPU, where the copies run at once.
    events: with event_timing on CUDA, one timing event per slot (stamp_event records them; a captured graph
    replays the records); read_events turns them into the slots' times after the step. None: host stamps.
    """

    __slots__ = ("pg", "rank", "ranks", "device", "timeout", "row", "t", "send_pg", "recv_pg", "bufs", "coll_pg",
                 "dp_pg", "dp_size", "dp_rank", "host", "copy_stream", "_specs", "events", "_start", "_t0",
                 "boundary")

    def __init__(self, pg, rank: int, device: torch.device, timeout: float, slots: int, *,
                 ranks: int = 1, channels: tuple | None = None, buffers: Sequence = (), collectives=None,
                 host_buffers: Sequence = (), event_timing: bool = False, replicas=None):
        self.pg = pg
        self.dp_pg = replicas
        self.dp_size = replicas.size() if replicas is not None else 1
        self.dp_rank = replicas.rank() if replicas is not None else 0
        self.ranks = ranks
        self.coll_pg = collectives if collectives is not None else pg
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
        cuda = device.type == "cuda"
        # made once: reused by every microbatch and step (a pinned allocation is slow and, under CUDA-graph
        # capture, not allowed)
        self.host = [torch.empty_strided(s.shape, s.stride if s.stride is not None else _contiguous(s.shape),
                                         dtype=s.dtype, pin_memory=cuda) for s in host_buffers]
        self.copy_stream = torch.cuda.Stream(device) if cuda and self.host else None
        self.events = [_timing_event() for _ in range(slots)] if cuda and event_timing else None
        self._start = _timing_event() if self.events is not None else None
        self._t0 = 0.0
        # post-validation's controller (zbcompile/post_validation.Boundary) where the program has step-boundary
        # ops (PREFIX, TOTALS, VALIDATE); None otherwise
        self.boundary = None

    def begin_events(self) -> None:
        """Before a step with event timing: an anchor event on the current stream, and the host time with it."""
        if self.events is not None:
            self._start.record()
            self._t0 = perf_counter()

    def read_events(self, used: int) -> None:
        """After the step's device work finished: slot k's time = the anchor's host time + the device time from
        the anchor to event k (the first `used` slots are this rank's)."""
        if self.events is not None and used:
            start, t0, t = self._start, self._t0, self.t
            self.events[used - 1].synchronize()
            try:
                for k in range(used):
                    t[k] = t0 + start.elapsed_time(self.events[k]) / 1e3
            except RuntimeError as e:   # a driver that cannot time events replayed in a graph: say so, once
                _warn_untimed(e)
                for k in range(used):
                    t[k] = t0

    def renew_buffers(self) -> None:
        """Make the static receive buffers (RankProgram.buffers) afresh: at start, and after a failed step,
        whose receives may still be posted into the old ones."""
        self.bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in self._specs]


_untimed_warned = False


def _warn_untimed(error: Exception) -> None:
    global _untimed_warned
    if not _untimed_warned:
        _untimed_warned = True
        warnings.warn(f"device event timing failed ({error}); the step's action timings read as zero",
                      ZBCompileWarning, stacklevel=3)


def _timing_event():
    # external: recorded inside a captured graph, the event is still a timing point on replay (a plain event
    # record in a graph only orders streams); torch < 2.6 has no such flag
    try:
        return torch.cuda.Event(enable_timing=True, external=True)
    except TypeError:
        return torch.cuda.Event(enable_timing=True)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


# ---- ops the generated program calls (all marked side-effecting, so dead-code elimination keeps them) ----
@fx.node.has_side_effect
def stamp_event(ctx: StepContext, slot: int) -> None:
    """A timing stamp in a program with event_timing: a device event (replayed with a captured graph; see
    StepContext.read_events), or the host clock where there are no events (CPU)."""
    events = ctx.events
    if events is None:
        ctx.t[slot] = perf_counter()
    else:
        events[slot].record()


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
def wait_recv(ctx: StepContext, handle, timed: bool = True) -> torch.Tensor:
    """Wait for a posted receive; returns the filled buffer."""
    buf, work, what, peer = handle
    wait(ctx, work, "receiving", what, peer, timed)
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
def wait_send(ctx: StepContext, handle, timed: bool = True) -> None:
    works, what, peers = handle
    for work in works:
        wait(ctx, work, "sending", what, peers, timed)


@fx.node.has_side_effect
def collective(ctx: StepContext, op: str, root: int, shape: tuple[int, ...], dtype: torch.dtype, what: str,
               *tensors: torch.Tensor):
    """Post a collective on ctx.coll_pg (passes/lower/vocab.py): `broadcast` of the root's tensor (a fresh buffer
    elsewhere), `reduce` (sum) onto the root in place, or `all_gather` into a fresh [ranks, *shape] tensor.
    Returns a handle for wait_collective. One rank (no group) has nothing to exchange."""
    pg = ctx.coll_pg
    if op == "all_gather":
        buf = torch.empty((ctx.ranks, *shape), dtype=dtype, device=ctx.device)
    elif tensors:
        buf = tensors[0].contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=ctx.device)
    if pg is None:
        if op == "all_gather":
            buf[0].copy_(tensors[0])
        return buf, None, what
    try:
        if op == "broadcast":
            work = pg.broadcast([buf], _root_options(dist.BroadcastOptions(), root))
        elif op == "reduce":
            options = _root_options(dist.ReduceOptions(), root)
            options.reduceOp = dist.ReduceOp.SUM
            work = pg.reduce([buf], options)
        else:
            work = pg.allgather([list(buf.unbind(0))], [tensors[0].contiguous()])
    except Exception as e:
        raise RuntimeFailure(f"rank {ctx.rank}: posting the {op} of {what} failed: {e}") from e
    return buf, work, what


def _root_options(options, root: int):
    options.rootRank = root
    return options


@fx.node.has_side_effect
def wait_collective(ctx: StepContext, handle, timed: bool = True) -> torch.Tensor:
    """Wait for a posted collective; returns its result on this rank (the buffer it posted)."""
    buf, work, what = handle
    if work is not None:
        wait(ctx, work, "joining the collective of", what, None, timed)
    return buf


# the flat-tensor collectives under their torch 2.13 names (the older ones warn there), or the older names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---- data-parallel gradient buckets (passes/lower/dp_reduce.py) --------------------------------------------
@fx.node.has_side_effect
def dp_reduce(ctx: StepContext, bucket: int, scatter: bool, what: str, *grads: torch.Tensor):
    """Copy `grads` into one fresh flat tensor and post its sum over the replicas (on NCCL, on the group's own
    stream after the compute so far); a handle for wait_dp. The copy lets the program drop the gradients.
    scatter: reduce-scatter instead (sharded data parallelism): the flat tensor holds replica 0's padded rows of
    every gradient, then replica 1's ..., and each replica gets the sum of its own rows."""
    if scatter:
        return _reduce_scatter(ctx, what, grads)
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
    views = _layout(grads)   # not the tensors: the program frees them once they are copied
    pg = ctx.dp_pg
    if pg is None:   # one replica (a program lowered for dp run without it): the average is the gradient
        return flat, None, views, what, None
    try:
        work = pg.allreduce([flat])
    except Exception as e:
        raise RuntimeFailure(f"rank {ctx.rank}: posting the data-parallel all-reduce of {what} failed: {e}") from e
    return flat, work, views, what, None


def _layout(grads) -> tuple:
    """(offset, numel, shape) of each gradient in a flat all-reduced bucket."""
    out, offset = [], 0
    for g in grads:
        out.append((offset, g.numel(), g.shape))
        offset += g.numel()
    return tuple(out)


def _reduce_scatter(ctx: StepContext, what: str, grads):
    """dp_reduce's sharded form (every gradient has dim-0 rows: passes/lower/dp_reduce.shardable)."""
    n, d = ctx.dp_size, ctx.dp_rank
    chunks = [-(-g.shape[0] // n) for g in grads]             # each replica's padded rows (torch.chunk's size)
    row_sizes = [g.numel() // g.shape[0] for g in grads]
    flat = grads[0].new_empty((n, sum(c * k for c, k in zip(chunks, row_sizes))))
    views, offset = [], 0
    for g, c, k in zip(grads, chunks, row_sizes):
        rows = g.reshape(g.shape[0], k)
        if n * c != g.shape[0]:   # zero rows pad it to n equal chunks
            rows = torch.cat([rows, rows.new_zeros((n * c - g.shape[0], k))])
        flat[:, offset:offset + c * k].copy_(rows.reshape(n, c * k))   # replica r's chunk in row r (a view,
        # or a copy where the gradient is laid out as a transposed parameter)
        mine = max(0, min(c, g.shape[0] - d * c))              # this replica's rows of the gradient
        views.append((offset, mine * k, (mine, *g.shape[1:])))
        offset += c * k
    out = flat.new_empty(flat.shape[1])
    pg = ctx.dp_pg
    if pg is None:
        return flat.view(-1), None, tuple(views), what, None
    try:
        work = _REDUCE_SCATTER(out, flat.view(-1), group=pg, async_op=True)
    except Exception as e:
        raise RuntimeFailure(f"rank {ctx.rank}: posting the data-parallel reduce-scatter of {what} failed: "
                             f"{e}") from e
    return out, work, tuple(views), what, flat   # flat: the input, kept until the collective is done


@fx.node.has_side_effect
def wait_dp(ctx: StepContext, handle, timed: bool = True) -> tuple[torch.Tensor, ...]:
    """Wait for a bucket's reduction; the averaged gradients (or this replica's rows of them), views of the
    flat result each."""
    flat, work, views, what, _ = handle
    if work is not None:
        wait(ctx, work, "averaging over the data-parallel replicas", what, None, timed)
        flat.div_(ctx.dp_size)
    return tuple(flat[offset:offset + numel].view(shape) for offset, numel, shape in views)


# ---- sharded data parallelism: whole parameters gathered from the replicas' shards (passes/lower/dp_shard.py) ----
@fx.node.has_side_effect
def dp_gather(ctx: StepContext, bucket: int, what: str, *params: torch.Tensor):
    """Copy this replica's shards of `params` (DTensor Parameters sharded on dim 0, or their local tensors),
    each padded to torch.chunk's chunk size, into one flat tensor and post its all-gather over the replicas; a
    handle for wait_gather."""
    n = ctx.dp_size
    shards = [getattr(p, "_local_tensor", p) for p in params]
    layout, width = [], 0
    for p in params:
        rows = p.shape[0]
        c = -(-rows // n)
        row = p.numel() // rows
        layout.append((width, c * row, rows, tuple(p.shape)))
        width += c * row
    flat = shards[0].new_zeros(width)
    for shard, (offset, _, _, _) in zip(shards, layout):
        flat[offset:offset + shard.numel()].copy_(shard.reshape(-1))
    pg = ctx.dp_pg
    if pg is None:
        return flat, None, layout, what, None
    out = flat.new_empty(n * width)
    try:
        work = _ALL_GATHER(out, flat, group=pg, async_op=True)
    except Exception as e:
        raise RuntimeFailure(f"rank {ctx.rank}: posting the data-parallel all-gather of {what} failed: {e}") from e
    return out, work, layout, what, flat


@fx.node.has_side_effect
def wait_gather(ctx: StepContext, handle, timed: bool = True) -> tuple[torch.Tensor, ...]:
    """Wait for a parameter bucket's all-gather; each whole parameter copied out of it into a tensor of its own
    (the replicas' rows in replica order, the padding cut off)."""
    out, work, layout, what, _ = handle
    if work is not None:
        wait(ctx, work, "gathering parameters from the data-parallel replicas", what, None, timed)
    n = ctx.dp_size if work is not None else 1
    by_replica = out.view(n, -1)
    whole = []
    for offset, width, rows, shape in layout:
        part = by_replica[:, offset:offset + width].reshape(-1, *shape[1:])
        whole.append(part[:rows] if part.shape[0] != rows else part)
    return tuple(whole)


def wait(ctx: StepContext, work, doing: str, what: str, peer, timed: bool = True) -> None:
    """Wait with the step's timeout (timed=False: without one); the message is only built when the wait fails
    (this is the hot path)."""
    try:
        ok = work.wait(ctx.timeout) if timed else work.wait()
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
    """Accumulate a finished gradient into param.grad (taking the tensor when this step owns it). A DTensor
    Parameter (sharded data parallelism) gets its replica's shard `grad` as a DTensor like itself. A parameter
    frozen since compile (requires_grad_(False)) keeps its .grad as it was, as in eager: the traced graphs still
    compute its gradient (and the replicas still average it), it just goes nowhere."""
    if not param.requires_grad:
        return
    if isinstance(param, DTensor):
        if param.grad is None:
            param.grad = DTensor.from_local(grad if owned else grad.clone(), param.device_mesh, param.placements,
                                            run_check=False, shape=param.shape, stride=param.stride())
        else:
            param.grad._local_tensor.add_(grad)
        return
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


def keep_outputs(*outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The model's outputs of every microbatch, as the program's result (PipelineModule.forward regroups them)."""
    return outputs


def sum_losses(*losses: torch.Tensor) -> torch.Tensor:
    """This rank's microbatch losses (0-dim), summed in one device-side reduction, in float32 at least: finite
    float16 losses (a loss scaled by the user) can overflow their sum, not their mean."""
    if len(losses) == 1:
        return losses[0]
    return torch.stack(losses).sum(dtype=torch.promote_types(losses[0].dtype, torch.float32))


def sum_in_order(*copies: torch.Tensor) -> torch.Tensor:
    """Sum one gradient's copies from several ranks in a fixed (rank) order: every holder gets equal bits."""
    total = copies[0] + copies[1]
    for t in copies[2:]:
        total.add_(t)
    return total


# ---- the step boundary: post-validation (zbcompile/post_validation.py) --------------------------------------
class Redo(Exception):
    """Raised by validate where the last step's optimistic update was wrong: it has been put right, the messages
    the upstream's warm-up sent were drained, and the runtime runs this step again from its start."""


@fx.node.has_side_effect
def prefix(ctx: StepContext, up: torch.Tensor | None, loss: torch.Tensor | None) -> torch.Tensor:
    """This rank's partial values added to the prefix from rank r-1 (None on rank 0); loss: this rank's loss sum
    (None where it runs no loss stage)."""
    return ctx.boundary.prefix(up, loss)


@fx.node.has_side_effect
def totals(ctx: StepContext) -> torch.Tensor:
    """The last step's totals, kept by the last rank (its prefix was the totals)."""
    return ctx.boundary.kept_totals()


@fx.node.has_side_effect
def validate(ctx: StepContext, drains: tuple, totals: torch.Tensor) -> None:
    """The verdict on the last step's optimistic update. Right: nothing to do. Wrong: the boundary has rolled it
    back and applied the right one; the messages in `drains` ((peer, tag, shape, dtype): sent by the upstream's
    warm-up, not yet received here) are received and dropped, and Redo makes the runtime run the step again."""
    if ctx.boundary.validate(totals):
        return
    for peer, tag, shape, dtype in drains:
        wait_recv(ctx, recv(ctx, peer, tag, shape, dtype, f"a dropped warm-up message (tag {tag})"))
    raise Redo()
