"""insert_p2p: receive what other ranks produce, send what they consume. A cross-rank pass: it reads every
rank's program, so each side derives the same messages without talking.

Rules:

* A value a RUN op reads that no op of its rank defines comes from the rank whose RUN op defines it.
* Its receive is posted `lookahead` RUN ops before the first consumer (so the transfer overlaps that
  compute) and waited right before the consumer; the wait returns the buffer (the data edge fx needs).
* All outputs of one RUN op that other ranks read go out in one batch of sends right after it.
* A batch of sends is waited once this rank has received something its peer produced at or after the
  consumer of our data (so the peer surely holds it); failing that, at the end of the step.
* Tags: `p2p_tag` of the value's (stage, microbatch, direction, place among its graph's boundary outputs),
  identical on both sides.

    [0F0] s0.mb0.act:h, s0.mb0.saved:0 = stage0_f(...)      h:s1.mb0.grad:act:h = irecv(from 1 tag 9 ...)
    h:send0 = isend(s0.mb0.act:h -> 1 tag 0 ...)      ...   s1.mb0.grad:act:h = wait_recv(h:s1.mb0.grad:act:h)

Cost: linear in the ops of all ranks, plus a log factor for the send waits (a segment tree per peer).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from zbcompile.errors import LoweringError
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Message, Op, OpKind, RecvArgs, SendArgs, TensorType
from zbcompile.ir.program.values import Role, handle, parse, role_of

__all__ = ["insert_p2p", "p2p_tag", "Boundary", "TagSpace"]

FORWARD, BACKWARD = 0, 1


class TagSpace(NamedTuple):
    """The numbers tags are built from, read off all programs: stages, boundary tensors per graph and
    direction at most (`width`), microbatches. P2P tags lie below `end`; later exchanges number from there."""

    num_stages: int
    width: int
    microbatches: int

    @staticmethod
    def of(programs: Sequence[RankProgram]) -> TagSpace:
        stages = 1 + max((op.args.action.stage for p in programs for op in p.run_ops()), default=0)
        width = max([1] + [sum(role_of(n) in (Role.ACT, Role.GRAD_ACT) for n in g.outputs)
                           for p in programs for g in p.graphs.values()])
        return TagSpace(stages, width, max((p.microbatches for p in programs), default=1))

    @property
    def end(self) -> int:
        return 2 * self.width * self.num_stages * self.microbatches


class Boundary:
    """What every rank's programs say about values that cross ranks: who produces each (rank, RUN position,
    type, tag) and who reads it (per rank, the RUN position of its first reader)."""

    def __init__(self, programs: Sequence[RankProgram]):
        space = TagSpace.of(programs)
        self.num_stages, self.width = space.num_stages, space.width
        self.producer: dict[str, tuple[int, int, TensorType | None, int]] = {}   # value -> rank, run, type, k
        for p in programs:
            for j, op in enumerate(p.run_ops()):
                g = p.graph(op)
                k = {FORWARD: 0, BACKWARD: 0}
                for v, name, t in zip(op.outs, g.outputs, g.types or (None,) * len(g.outputs)):
                    role = parse(v).role
                    if role in (Role.ACT, Role.GRAD_ACT):
                        d = FORWARD if role is Role.ACT else BACKWARD
                        self.producer[v] = (p.rank, j, t, k[d])
                        k[d] += 1
        self.readers: dict[str, dict[int, int]] = {}   # value -> {reader rank: RUN position of first reader}
        for p in programs:
            defined = set(p.inputs)
            for j, op in enumerate(p.run_ops()):
                for v in op.ins:
                    if v not in defined and parse(v).scope == "stage":
                        self.readers.setdefault(v, {}).setdefault(p.rank, j)
                defined.update(op.outs)

    def tag(self, vid: str) -> int:
        value = parse(vid)
        d = FORWARD if value.role is Role.ACT else BACKWARD
        return p2p_tag(self.num_stages, self.width, value.stage, value.microbatch, d, self.producer[vid][3])

    def source(self, rank: int, vid: str) -> tuple[int, TensorType]:
        found = self.producer.get(vid)
        if found is None:
            raise LoweringError(f"rank {rank}: {vid!r} is read here but no rank's program produces it "
                                f"(only act:/grad:act: values cross ranks); check the schedule's actions")
        src, _, t, _ = found
        if src == rank:
            raise LoweringError(f"rank {rank}: {vid!r} is read before the op that produces it on this rank")
        if t is None:
            raise LoweringError(f"rank {rank}: {vid!r} crosses ranks but its producing graph declares no type "
                                f"for it (the stage's boundary tensors lack it)")
        return src, t


def p2p_tag(num_stages: int, width: int, stage: int, microbatch: int, direction: int, k: int) -> int:
    """Tag of the k-th boundary tensor that `stage` produces for `microbatch` (direction 0: act, 1: grad)."""
    return ((microbatch * num_stages + stage) * 2 + direction) * width + k


def insert_p2p(programs: Sequence[RankProgram], *, lookahead: int = 4) -> tuple[RankProgram, ...]:
    """Every program with its receives, sends and waits (see the module docstring)."""
    boundary = Boundary(programs)
    run_actions = {p.rank: [op.args.action for op in p.run_ops()] for p in programs}
    return tuple(_insert(p, boundary, run_actions, lookahead) for p in programs)


def _insert(program: RankProgram, boundary: Boundary, run_actions, lookahead: int) -> RankProgram:
    rank, ops = program.rank, program.ops
    run_at = [i for i, op in enumerate(ops) if op.kind is OpKind.RUN]
    run_index = {i: j for j, i in enumerate(run_at)}
    first_use: dict[str, int] = {}
    for i, op in enumerate(ops):
        for v in op.ins:
            first_use.setdefault(v, i)
    defined = program.defined()
    needs = [v for v in first_use if v not in defined]   # in order of first use
    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    waits_at_recv: dict[str, list[Op]] = {}
    tail: list[Op] = []
    received: dict[int, list[tuple[int, int, str]]] = {}   # peer -> (first use, producer's RUN position, value)
    for v in needs:
        src, t = boundary.source(rank, v)
        consumer = first_use[v]
        post = run_at[max(0, run_index[consumer] - lookahead)]
        h = handle(v)
        before.setdefault(post, []).append(
            Op(OpKind.RECV, (), (h,), RecvArgs(src, boundary.tag(v), t), note=f"for {ops[consumer].action}"))
        before.setdefault(consumer, []).append(Op(OpKind.WAIT_RECV, (h,), (v,)))
        received.setdefault(src, []).append((consumer, boundary.producer[v][1], v))
    done = {q: _FirstAtOrAfter(rows) for q, rows in received.items()}
    n_send = 0
    for i in run_at:
        op = ops[i]
        sends = [(v, q, j) for v in op.outs for q, j in boundary.readers.get(v, {}).items() if q != rank]
        if not sends:
            continue
        h = handle(f"send{n_send}")
        n_send += 1
        messages = tuple(Message(q, boundary.tag(v), boundary.producer[v][2]) for v, q, _ in sends)
        after.setdefault(i, []).append(Op(OpKind.SEND, tuple(v for v, _, _ in sends), (h,), SendArgs(messages)))
        done_at = _send_done_at(sends, done, i)
        wait = Op(OpKind.WAIT_SEND, (h,))
        if done_at is None:
            tail.append(wait)
        else:
            waits_at_recv.setdefault(done_at, []).append(wait)
    new: list[Op] = []
    for i, op in enumerate(ops):
        for extra in sorted(before.get(i, ()), key=lambda o: o.kind is OpKind.WAIT_RECV):
            new.append(extra)
            if extra.kind is OpKind.WAIT_RECV:
                new.extend(waits_at_recv.get(extra.outs[0], ()))
        new.append(op)
        new.extend(after.get(i, ()))
    return program.replace(ops=tuple(new + tail))


def _send_done_at(sends, done: dict, sent_at: int) -> str | None:
    """The received value after whose wait every send of the batch has surely arrived, or None: per peer,
    the first value (by first use here, after the send) that the peer produced at or after consuming ours."""
    best, best_v = -1, None
    for _, q, consumer in sends:
        found = done[q].query(sent_at, consumer) if q in done else None
        if found is None:
            return None
        if found[0] > best:
            best, best_v = found
    return best_v


class _FirstAtOrAfter:
    """Rows (first use, producer position, value) sorted by first use; query(after, at_least): the first
    row with first use > after and producer position >= at_least, in O(log n) (a max segment tree)."""

    def __init__(self, rows: list[tuple[int, int, str]]):
        self.rows = sorted(rows)
        n = 1
        while n < len(self.rows):
            n *= 2
        self.n = n
        self.tree = [-1] * (2 * n)
        for k, (_, pos, _) in enumerate(self.rows):
            self.tree[n + k] = pos
        for k in range(n - 1, 0, -1):
            self.tree[k] = max(self.tree[2 * k], self.tree[2 * k + 1])
        self.uses = [u for u, _, _ in self.rows]

    def query(self, after: int, at_least: int) -> tuple[int, str] | None:
        from bisect import bisect_right

        k = self._first(bisect_right(self.uses, after), at_least)
        return None if k is None else (self.rows[k][0], self.rows[k][2])

    def _first(self, lo: int, at_least: int) -> int | None:
        """The first leaf index >= lo whose value >= at_least."""
        if lo >= len(self.rows):
            return None
        node, tree, n = lo + self.n, self.tree, self.n
        # climb until the node's right part (from lo on) can hold a match
        if tree[node] >= at_least:
            return node - n
        while True:
            while node & 1:          # a right child: go up until we can step right
                node >>= 1
                if node == 0:
                    return None
            node += 1                # the right sibling covers the next range
            if tree[node] >= at_least:
                break
        while node < n:              # descend to the leftmost leaf that matches
            node = 2 * node if tree[2 * node] >= at_least else 2 * node + 1
        return node - n
