"""order_p2p_by_pair: post each rank's receives from a peer in the order that peer posts its sends.

gloo matches a send to a receive by (source, destination, tag). NCCL ignores tags: between one source and
one destination it pairs the k-th send posted with the k-th receive posted. insert_p2p posts a receive
`recv_lookahead` actions before its consumer, i.e. in the *receiver's* order, which on V placements and
DualPipe differs from the sender's: rank 0 of ZB-V sends rank 1 both stage 0's activations and stage 3's
gradients, interleaved in rank 0's order, while rank 1 wants them in its own. Under NCCL the tensors would
be swapped silently (same shapes) or the ranks would hang.

This pass runs once over all ranks' finished programs (it needs the peers' send order, which the
per-rank passes do not see). For every ordered pair (a -> b) the send order is rank a's SEND ops in
program order, each batch in its listed order; rank b's RECV ops from a are re-posted so that they come in
that order. A receive only ever moves *earlier*, to just before the receive that must follow it:

    ZB-V, pp=2, rank 0 sends rank 1:   s0.mb1.act (tag 8), s0.mb2.act (tag 16), s3.mb0.grad (tag 7)
    rank 1 before:  irecv(tag 8) [2F0] [1F1] irecv(tag 7) [2F1] [2B0] irecv(tag 16) [2W0] [1F2]
    rank 1 after:   irecv(tag 8) [2F0] [1F1] irecv(tag 16) irecv(tag 7) [2F1] [2B0] [2W0] [1F2]

Invariants: the multiset of ops is unchanged and every non-RECV op keeps its relative order; each RECV
stays before its WAIT_RECV (it only moves up); no deadlock is introduced, because posting never blocks
and posting earlier only lets the peer's waits finish sooner. Receives from different peers keep their
own relative order wherever they do not have to move. The cost is that a moved receive allocates its
buffer a few actions earlier (at most 8 at pp=4, 2p microbatches); schedules whose orders already agree
(GPipe, 1F1B, interleaved, ZB-H1/H2, V-Min, DualPipe) come out unchanged.

It is applied on every backend (see `lower_all`): one program per schedule whatever the process group, so
what `inspect` prints and `validate_programs` checks is what NCCL runs; gloo, which matches by tag,
computes the same step from either order.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from zbcompile.errors import LoweringError
from zbcompile.ir.program import RankProgram

__all__ = ["order_p2p_by_pair", "pair_sequences", "Posted"]

Pair = tuple[int, int]


class Posted(NamedTuple):
    """One tensor of a SEND or RECV op, as it is posted: its tag, the op's index, the value it carries."""

    tag: int
    op: int
    value: str


def pair_sequences(programs: Sequence[RankProgram]) -> tuple[dict[Pair, list[Posted]], dict[Pair, list[Posted]]]:
    """(sends, recvs): for each ordered pair (source, destination), every tensor in posting order, sends as
    the source's program posts them and receives as the destination's does."""
    sends: dict[Pair, list[Posted]] = {}
    recvs: dict[Pair, list[Posted]] = {}
    for prog in programs:
        for i, op in enumerate(prog.ops):
            for k, (src, dst, tag, _) in enumerate(op.spec.posts(op, prog.rank)):
                if src == prog.rank:
                    sends.setdefault((src, dst), []).append(Posted(tag, i, op.ins[k]))
                else:
                    recvs.setdefault((src, dst), []).append(Posted(tag, i, op.outs[0].removeprefix("h:")))
    return sends, recvs


def order_p2p_by_pair(programs: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
    """Every rank's program with its receives re-posted in each peer's send order (see the module doc)."""
    sends, _ = pair_sequences(programs)
    return tuple(_order_rank(prog, sends) for prog in programs)


def _order_rank(program: RankProgram, sends: dict[Pair, list[Posted]]) -> RankProgram:
    recv_at: dict[tuple[int, int], int] = {}   # (peer, tag) -> index of its RECV op
    for i, op in enumerate(program.ops):
        for src, dst, tag, _ in op.spec.posts(op, program.rank):
            if dst == program.rank:
                recv_at[(src, tag)] = i
    # Sort key per op: (index, -1) keeps an op in place; a receive gets (index of the receive it must be
    # posted by, its place in the send order). Walking the send order backwards, each receive is posted
    # by the earlier of its own index and the next one's key: the suffix minimum. Only receives from
    # `src` carry those indices, so receives from different peers never tie.
    key = {i: (i, -1) for i in range(len(program.ops))}
    for (src, dst), order in sends.items():
        if dst != program.rank:
            continue
        post_by = len(program.ops)
        for place in reversed(range(len(order))):
            i = recv_at.pop((src, order[place].tag), None)
            if i is None:
                raise LoweringError(f"rank {src} sends rank {dst} tag {order[place].tag}, which rank {dst} never "
                                    f"receives; run validate_programs for the full picture")
            post_by = min(i, post_by)
            key[i] = (post_by, place)
    if recv_at:
        (src, tag), i = next(iter(recv_at.items()))
        raise LoweringError(f"rank {program.rank} op {i} receives tag {tag} from rank {src}, which rank {src} "
                            f"never sends\n{program.to_text(mark=i)}")
    return program.replace(ops=tuple(program.ops[i] for i in sorted(key, key=key.__getitem__)))
