"""check_streams: the rank programs cannot deadlock when every P2P op runs on a device stream (NCCL).

Gloo blocks the host in each wait and matches messages by tag; `validate_programs` checks that model.
NCCL is stricter. Posting a send or a receive enqueues it on the communicator's stream, behind everything
posted on that stream before and behind the compute posted before it (the stream waits on the compute
stream at post time). A send and its receive finish together, and a wait makes the compute stream wait on
the op. One communicator per peer pair means one stream for both directions: rank 0 waiting on a receive
of a gradient from rank 1, queued before its send of the next activation, while rank 1 has queued the
receive of that activation before its send of the gradient, is a cycle no host can break.

So the runtime gives every direction its own communicator (`channel`: 'directed', the default; 'pair'
models a single process group) and this check proves, per schedule, that the event graph is acyclic:

    nodes  one per compute op of each rank, one per message (its send and receive merged), one per
           collective (every rank's post merged), one per host copy (offload / reload) of each rank
    edges  compute i-1 -> compute i;  last compute before a post -> the message, collective or copy;
           previous message on the same (rank, channel) stream -> the message;
           previous collective of the rank -> the collective (the collective group's own stream);
           previous copy of the rank -> the copy (the rank's one copy stream);
           a waited message, collective or copy -> the next compute op after the wait

A copy involves no other rank, so it cannot close a cycle by itself; it is modelled so that a wait for it
orders the compute behind it like any other wait. A data-parallel reduction (Sync.REPLICAS) is modelled the same
way on the rank's data-parallel stream: its peers are this rank's replicas, which run this same program.

A cycle is reported as the chain of ops that wait on one another.
"""

from __future__ import annotations

from typing import Sequence

from zbcompile.errors import LoweringError
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import OpKind, Stream, Sync

__all__ = ["check_streams", "stream_cycle"]

Key = tuple[int, int, int]          # a message: (source, destination, tag)
Node = tuple                        # ("c", rank, op index), ("m", source, destination, tag), ("k", seq) or
                                    # ("x", rank, op index): work on one of the rank's own streams (copy, dp)



def _channel(src: int, dst: int, channel: str) -> tuple[int, int]:
    if channel == "directed":
        return src, dst
    if channel == "pair":
        return min(src, dst), max(src, dst)
    raise LoweringError(f"unknown channel model {channel!r}; use 'directed' or 'pair'")


def _edges(programs: Sequence[RankProgram], channel: str) -> dict[Node, set[Node]]:
    """node -> the nodes it waits for."""
    deps: dict[Node, set[Node]] = {}
    for prog in programs:
        r = prog.rank
        last_compute: Node | None = None
        last_on_stream: dict[tuple[int, int], Node] = {}
        handles: dict[str, list[Key]] = {}
        waited: list[Node] = []
        for i, op in enumerate(prog.ops):
            sync, stream = op.spec.sync, op.spec.stream
            if sync is Sync.POST:
                keys = op.messages(r)
                handles[op.outs[0]] = keys
                for key in keys:
                    _enqueue(deps, ("m",) + key, _channel(key[0], key[1], channel), last_on_stream, last_compute)
            elif sync is Sync.WAIT:
                waited += [("m",) + key for key in handles[op.ins[0]]]
            elif sync is Sync.COLLECTIVE:
                # one node per collective, joined by every rank's post; the collective group has a stream of
                # its own on each rank, so collectives queue behind each other and nothing else
                node = ("k", op.args.seq)
                handles[op.outs[0]] = [node]
                _enqueue(deps, node, "coll", last_on_stream, last_compute)
            elif sync is Sync.JOIN:
                waited += handles[op.ins[0]]
            elif (sync is Sync.NONE and stream is Stream.COPY) or sync is Sync.REPLICAS:
                waited += _copy(deps, handles, last_on_stream, last_compute, r, i, op, stream.value)
            elif sync is not Sync.NONE or stream not in (Stream.COMPUTE, Stream.HOST):
                raise LoweringError(f"rank {r} op {i} ({op}): the stream check does not model {sync.value} ops "
                                    f"on the {stream.value} stream yet; add their rule to streams._edges")
            elif stream is Stream.COMPUTE:
                node = ("c", r, i)
                before = deps.setdefault(node, set(waited))
                if last_compute is not None:
                    before.add(last_compute)
                last_compute, waited = node, []
    return deps


def _enqueue(deps: dict[Node, set[Node]], node: Node, stream, last_on_stream: dict, last_compute: Node | None) -> None:
    """Post `node` on `stream`: it waits for the compute posted before it and for the stream's previous node."""
    before = deps.setdefault(node, set())
    if last_compute is not None:
        before.add(last_compute)
    if stream in last_on_stream:
        before.add(last_on_stream[stream])
    last_on_stream[stream] = node


def _copy(deps: dict[Node, set[Node]], handles: dict[str, list], last_on_stream: dict, last_compute: Node | None,
          r: int, i: int, op, stream: str) -> list[Node]:
    """An op on one of the rank's own streams (copy, dp): one that reads the handle of an earlier op there waits
    for it (returned, for the next compute op to wait on); any other posts work behind the last compute and the
    stream's previous work."""
    copies = [n for v in op.ins for n in handles.get(v, ()) if n[0] == "x"]
    if copies:
        return copies
    node = ("x", r, i)
    _enqueue(deps, node, stream, last_on_stream, last_compute)
    for h in op.outs:
        handles[h] = [node]
    return []


def stream_cycle(programs: Sequence[RankProgram], channel: str = "directed") -> list[Node] | None:
    """A cycle of the stream event graph (each node waits for the next), or None if there is none."""
    deps = _edges(programs, channel)
    state: dict[Node, int] = {}          # 1: on the current path, 2: done
    for root in deps:
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(deps[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(deps.get(nxt, ()))))
    return None


def check_streams(programs: Sequence[RankProgram], channel: str = "directed") -> Sequence[RankProgram]:
    """Raise LoweringError, showing the ops that wait on one another, if the programs can deadlock on
    device streams; returns them unchanged."""
    cycle = stream_cycle(programs, channel)
    if cycle is None:
        return programs
    by_rank = {p.rank: p for p in programs}
    lines = [f"  {_describe(node, by_rank, channel)}" for node in cycle]
    raise LoweringError(
        "the rank programs can deadlock on device streams (NCCL): each of these waits for the next, and the "
        "last for the first:\n" + "\n".join(lines)
        + "\nfix: give each direction its own communicator (channel='directed'), or reorder the posts")


def _describe(node: Node, by_rank: dict[int, RankProgram], channel: str) -> str:
    if node[0] in ("c", "x"):
        _, r, i = node
        where = f" (on its {by_rank[r].ops[i].spec.stream.value} stream)" if node[0] == "x" else ""
        return f"rank {r} op {i}{where}: {by_rank[r].ops[i]}"
    if node[0] == "k":
        return f"collective seq {node[1]} on the collective group (every rank posts it)"
    _, src, dst, tag = node
    where = [f"rank {src} op {_op_of(by_rank[src], OpKind.SEND, dst, tag)}",
             f"rank {dst} op {_op_of(by_rank[dst], OpKind.RECV, src, tag)}"]
    a, b = _channel(src, dst, channel)
    return f"message {src} -> {dst} tag {tag} on stream {a}-{b} (posted at {' and '.join(where)})"


def _op_of(prog: RankProgram, kind: OpKind, peer: int, tag: int) -> int:
    key = (prog.rank, peer, tag) if kind is OpKind.SEND else (peer, prog.rank, tag)
    return next(i for i, op in enumerate(prog.ops) if op.kind is kind and key in op.messages(prog.rank))
