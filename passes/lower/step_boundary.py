"""Post-validation's step boundary: the prefix chain and the deadline where a step validates the last one.

A synchronous optimizer step waits for the whole pipeline (an all-reduce of the gradient norm and the inf
flag) before any rank may update, and the next step's warm-up waits for that update. Post-validation (the
Zero Bubble paper's last step) removes the wait: every step ends with a prefix chain (rank 0 -> p-1) of
three values, and each rank updates at once on what its prefix proves (zbcompile/post_validation.py); the
totals travel back (p-1 -> 0) while the next step's warm-up forwards run, and are checked at a deadline.
From finished programs this pass makes two variants per rank:

    first, validating = boundary_programs(programs)

first[r]        the step, then PREFIX: this rank's values added to the prefix from r-1, sent on to r+1. It runs
                after a synchronous step, and again after a rollback.

                    h:pv.up = irecv(from r-1 ...)          (after the other receives from r-1: pair order)
                    ...  the step  ...
                    pv.up = wait_recv(h:pv.up)
                    pv.prefix = prefix(pv.up, loss)
                    h:pv.send = isend(pv.prefix -> r+1 ...)
                    ...  the step's last waits for its sends, then wait_send(h:pv.send)

validating[r]   the same step, which at its deadline (before its first action that is not a warm-up forward)
                reads the totals of the step before, sends them on to r-1 and validates:

                    h:pv.totals = irecv(from r+1 ...)      (rank p-1: pv.totals = totals())
                    ...  warm-up forwards, their receives and sends waited  ...
                    pv.totals = wait_recv(h:pv.totals);  isend(pv.totals -> r-1); wait_send
                    validate(pv.totals; drain ...)
                    ...  the rest of the step, its receives posted from here  ...

A warm-up forward is an F whose received inputs come from lower ranks and whose outputs go to higher ones,
so that the messages of the warm-ups flow one way: a forward whose input the upstream sends after its own
deadline cannot be one (the deadlines are cut back until no warm-up waits for a message sent after its
sender's deadline). Nothing posted before the deadline is left unmatched there: receives that the warm-up
does not wait for are posted after it, sends it makes are waited before it. So when the verdict is that the
last step's update was wrong, every rank (the verdict is the same everywhere) rolls it back, receives and drops
the messages its upstream's warm-up sent that its own did not take (`drain`), and runs `first` from the
start: no message of the abandoned warm-ups is left on the wire.
"""

from __future__ import annotations

from typing import Sequence

from zbcompile.errors import LoweringError
from zbcompile.ir.actions import Kind
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Message, Op, OpKind, RecvArgs, SendArgs, Sync, ValidateArgs
from zbcompile.ir.program.ops.step_boundary import PREFIX, TOTALS, UP, VALUES
from zbcompile.ir.program.values import LOSS, handle

__all__ = ["boundary_programs", "deadlines", "BoundaryTags"]

Programs = tuple[RankProgram, ...]


class BoundaryTags(tuple):
    """(prefix tag, totals tag): the two tags after every tag the programs use."""

    @property
    def prefix(self) -> int:
        return self[0]

    @property
    def totals(self) -> int:
        return self[1]


def boundary_programs(programs: Sequence[RankProgram]) -> tuple[Programs, Programs, BoundaryTags]:
    """(first, validating, tags) for finished `programs` (see the module docstring); checked like lower_all's."""
    from zbcompile.passes.lower.streams import check_streams
    from zbcompile.passes.lower.validate import check_pair_order, validate_programs

    tags = free_tags(programs)
    first = tuple(_with_prefix(q, len(programs), tags.prefix) for q in programs)
    sent_at = _sent_at(first)
    cut = deadlines(first, sent_at)
    validating = tuple(_validating(q, len(programs), cut, sent_at, tags.totals) for q in first)
    for variant in (first, validating):
        for q in variant:
            q.check(q.passes[-1])
        validate_programs(variant)
        check_pair_order(variant)
        check_streams(variant)
    return first, validating, tags


def free_tags(programs: Sequence[RankProgram]) -> BoundaryTags:
    used = [tag for q in programs for op in q.ops for _, _, tag in op.messages(q.rank)]
    top = max(used, default=-1)
    return BoundaryTags((top + 1, top + 2))


# ---- first: the prefix chain at the end of the step --------------------------------------------------------
def _with_prefix(q: RankProgram, ranks: int, tag: int) -> RankProgram:
    r, ops = q.rank, list(q.ops)
    end = len(ops)
    while end and ops[end - 1].kind is OpKind.WAIT_SEND:   # the step's last waits go after the prefix is sent on
        end -= 1
    block, tail = [], []
    if r > 0:
        block.append(Op(OpKind.WAIT_RECV, (handle(UP),), (UP,)))
    ins = ((UP,) if r > 0 else ()) + ((LOSS,) if q.output == LOSS else ())
    block.append(Op(OpKind.PREFIX, ins, (PREFIX,), note="post-validation: norm partial, inf flag, loss"))
    if r < ranks - 1:
        block.append(Op(OpKind.SEND, (PREFIX,), (handle("pv.send"),), SendArgs((Message(r + 1, tag, VALUES),))))
        tail.append(Op(OpKind.WAIT_SEND, (handle("pv.send"),)))
    ops = ops[:end] + block + ops[end:] + tail
    if r > 0:   # posted after every other receive from r-1, whose sends all precede the prefix
        last = max((i for i, op in enumerate(ops) if op.kind is OpKind.RECV and op.args.peer == r - 1), default=-1)
        ops.insert(last + 1, Op(OpKind.RECV, (), (handle(UP),), RecvArgs(r - 1, tag, VALUES),
                                note="post-validation prefix"))
    return q.replace(ops=tuple(ops), passes=(*q.passes, "add_prefix"))


# ---- the deadlines ---------------------------------------------------------------------------------------------
def deadlines(programs: Sequence[RankProgram], sent_at: dict | None = None) -> list[int]:
    """Per rank, the index of the first op that is not part of its warm-up (see the module docstring). sent_at:
    _sent_at(programs), where the caller has it."""
    cut = [_natural_deadline(q) for q in programs]
    sent_at = _sent_at(programs) if sent_at is None else sent_at
    waits = [_waited_messages(q) for q in programs]
    changed = True
    while changed:   # a warm-up may only wait for what its sender sends before the sender's own deadline
        changed = False
        for q in programs:
            r = q.rank
            for i, message in waits[r]:
                if i >= cut[r]:
                    break
                if sent_at[message] >= cut[message[0]]:
                    cut[r], changed = i, True
                    break
    return cut


def _natural_deadline(q: RankProgram) -> int:
    """The first op that is a collective, or a RUN other than a forward fed from below and feeding upward."""
    r = q.rank
    source, posted, sent_to = {}, {}, {}
    for op in q.ops:
        if op.kind is OpKind.RECV:
            posted[op.outs[0]] = op.args.peer
        elif op.kind is OpKind.WAIT_RECV:
            source[op.outs[0]] = posted.get(op.ins[0], -1)
        elif op.kind is OpKind.SEND:
            for v, m in zip(op.ins, op.args.messages):
                sent_to.setdefault(v, set()).add(m.peer)
    for i, op in enumerate(q.ops):
        if op.spec.sync in (Sync.COLLECTIVE, Sync.JOIN):
            return i
        if op.kind is OpKind.RUN:
            warm = (op.action.kind is Kind.F and all(source[v] < r for v in op.ins if v in source)
                    and all(peer > r for v in op.outs for peer in sent_to.get(v, ())))
            if not warm:   # the action's start stamp (right before it) goes after the deadline with it
                return i - 1 if i and q.ops[i - 1].kind is OpKind.STAMP else i
    return len(q.ops)


def _sent_at(programs: Sequence[RankProgram]) -> dict[tuple[int, int, int], int]:
    """(source, destination, tag) -> the index of the SEND that posts it in the source's program."""
    return {m: i for q in programs for i, op in enumerate(q.ops) if op.kind is OpKind.SEND
            for m in op.messages(q.rank)}


def _waited_messages(q: RankProgram) -> list[tuple[int, tuple[int, int, int]]]:
    """(index of the WAIT_RECV, its message) in program order."""
    posted = {op.outs[0]: (op.args.peer, q.rank, op.args.tag) for op in q.ops if op.kind is OpKind.RECV}
    return [(i, posted[op.ins[0]]) for i, op in enumerate(q.ops) if op.kind is OpKind.WAIT_RECV]


# ---- validating: the verdict at the deadline -----------------------------------------------------------------
def _validating(q: RankProgram, ranks: int, cut: list[int], sent_at: dict, tag: int) -> RankProgram:
    r, ops, d = q.rank, q.ops, cut[q.rank]
    waited = {op.ins[0]: i for i, op in enumerate(ops) if op.kind in (OpKind.WAIT_RECV, OpKind.WAIT_SEND)}
    head, later_recvs, early_waits = [], [], set()
    for i, op in enumerate(ops[:d]):
        if op.kind is OpKind.RECV and waited.get(op.outs[0], len(ops)) >= d:
            later_recvs.append(op)   # its message comes after the deadline (or is drained): post it there
            continue
        if op.kind is OpKind.SEND and waited.get(op.outs[0], -1) >= d:
            early_waits.add(waited[op.outs[0]])   # nothing posted before the deadline stays open at it
        head.append(op)
    head += [ops[i] for i in sorted(early_waits)]
    boundary = []
    if r < ranks - 1:
        head.insert(0, Op(OpKind.RECV, (), (handle(TOTALS),), RecvArgs(r + 1, tag, VALUES),
                          note="post-validation totals"))
        boundary.append(Op(OpKind.WAIT_RECV, (handle(TOTALS),), (TOTALS,)))
    else:
        boundary.append(Op(OpKind.TOTALS, (), (TOTALS,)))
    if r > 0:
        boundary += [Op(OpKind.SEND, (TOTALS,), (handle("pv.down"),), SendArgs((Message(r - 1, tag, VALUES),))),
                     Op(OpKind.WAIT_SEND, (handle("pv.down"),))]
    drains = tuple(Message(op.args.peer, op.args.tag, op.args.type) for op in later_recvs
                   if sent_at.get((op.args.peer, r, op.args.tag), len(ops)) < cut[op.args.peer])
    boundary.append(Op(OpKind.VALIDATE, (TOTALS,), (), ValidateArgs(drains),
                       note=f"after {sum(op.kind is OpKind.RUN for op in head)} warm-up action(s)"))
    body = [op for i, op in enumerate(ops[d:], d) if i not in early_waits]
    new = (*head, *boundary, *later_recvs, *body)
    if len(new) != len(ops) + len(boundary) + (r < ranks - 1):
        raise LoweringError(f"rank {r}: validate_at_deadline lost or duplicated ops")
    return q.replace(ops=new, passes=(*q.passes, "validate_at_deadline"))
