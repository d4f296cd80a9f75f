"""validate_programs: the rank programs of one schedule fit together.

Checks, over all ranks at once:
1. every receive has exactly one send with the same (source, destination, tag), shape and dtype, and
   every send is received;
2. every rank posts the same collectives in the same order (`check_collectives`);
3. the programs cannot deadlock, running them under the strictest P2P model (a wait on a receive needs
   the peer to have posted the send; a wait on a send needs the peer to have posted the receive; a wait on
   a collective needs every rank to have posted it; posting never blocks; host copies (offload / reload,
   Sync.NONE) never block: they involve no other rank, nor do data-parallel reductions (Sync.REPLICAS: every
   replica runs this same program, so the replicas of a rank reach each reduction's wait having posted it, as
   this rank did). A stuck state is reported as the ops each rank is blocked on.

`check_pair_order` adds the rule NCCL needs, which ignores tags: for every ordered pair (a -> b), rank b
posts its receives from a in the order rank a posts its sends to b (each batch in its listed order).
"""

from __future__ import annotations

from typing import Sequence

from zbcompile.errors import LoweringError
from zbcompile.passes.lower.order_p2p import pair_sequences
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Sync

__all__ = ["validate_programs", "check_pair_order", "check_collectives"]


def _endpoints(programs: Sequence[RankProgram]):
    sends: dict[tuple[int, int, int], tuple[int, int, object]] = {}
    recvs: dict[tuple[int, int, int], tuple[int, int, object]] = {}
    for prog in programs:
        for i, op in enumerate(prog.ops):
            for *key, t in op.spec.posts(op, prog.rank):
                key = tuple(key)
                table = sends if key[0] == prog.rank else recvs
                if key in table:
                    other = table[key]
                    raise LoweringError(
                        f"two {op.spec.text}s with the same (source {key[0]}, destination {key[1]}, tag {key[2]}): "
                        f"rank {other[0]} op {other[1]} and rank {prog.rank} op {i}\n"
                        f"{prog.to_text(mark=i, window=4)}")
                table[key] = (prog.rank, i, t)
    return sends, recvs


def validate_programs(programs: Sequence[RankProgram]) -> Sequence[RankProgram]:
    """Raise LoweringError if the programs do not match up or can deadlock; returns them unchanged."""
    by_rank = {p.rank: p for p in programs}
    sends, recvs = _endpoints(programs)
    for key, (r, i, spec) in recvs.items():
        if key not in sends:
            raise LoweringError(f"rank {r} op {i} receives from rank {key[0]} with tag {key[2]} but rank {key[0]} "
                                f"never sends it\n{by_rank[r].to_text(mark=i, window=4)}")
        sr, si, sspec = sends[key]
        if sspec != spec:
            raise LoweringError(
                f"rank {r} op {i} receives {list(spec.shape)} {spec.dtype} but rank {sr} op {si} sends "
                f"{list(sspec.shape)} {sspec.dtype} (tag {key[2]})\n{by_rank[r].to_text(mark=i, window=4)}\n"
                f"{by_rank[sr].to_text(mark=si, window=4)}")
    for key, (r, i, _) in sends.items():
        if key not in recvs:
            raise LoweringError(f"rank {r} op {i} sends to rank {key[1]} with tag {key[2]} but rank {key[1]} "
                                f"never receives it\n{by_rank[r].to_text(mark=i, window=4)}")
    check_collectives(programs)
    _simulate(programs, sends, recvs)
    return programs


def check_collectives(programs: Sequence[RankProgram]) -> Sequence[RankProgram]:
    """Every rank posts the same collectives (op, root, type) in the same order, numbered 0, 1, ... by seq:
    a collective group matches them by order, so anything else would mix tensors up or hang."""
    seqs = {p.rank: [(i, op.args) for i, op in enumerate(p.ops) if op.spec.sync is Sync.COLLECTIVE]
            for p in programs}
    by_rank = {p.rank: p for p in programs}
    ref_rank = min(seqs, default=0)
    ref = seqs.get(ref_rank, [])
    for r, mine in seqs.items():
        for k in range(max(len(ref), len(mine))):
            a = ref[k][1] if k < len(ref) else None
            b = mine[k][1] if k < len(mine) else None
            if a is None or b is None or a != b or b.seq != k:
                at = mine[k][0] if k < len(mine) else len(by_rank[r].ops) - 1
                raise LoweringError(
                    f"collective number {k} differs between rank {ref_rank} ({_coll(a)}) and rank {r} ({_coll(b)}); "
                    f"every rank must post the same collectives in the same order\n"
                    f"{by_rank[r].to_text(mark=at, window=4)}\n"
                    "fix: give every rank the same sequence of vocabulary actions (Schedule.validate checks it)")
    return programs


def _coll(args) -> str:
    return "none" if args is None else f"{args.op.value} root {args.root} seq {args.seq} {args.type}"


def _simulate(programs, sends, recvs) -> None:
    """Run all programs under the strict P2P model, reading each op's synchronisation off its spec."""
    pos = {p.rank: 0 for p in programs}
    posted: set[tuple[str, tuple[int, int, int]]] = set()
    handles: dict[tuple[int, str], list[tuple[str, tuple[int, int, int]]]] = {}
    joined: dict[int, int] = {}            # collective seq -> how many ranks have posted it
    collective: dict[tuple[int, str], int] = {}
    progressed = True
    while progressed:
        progressed = False
        for prog in programs:
            r = prog.rank
            while pos[r] < len(prog.ops):
                op = prog.ops[pos[r]]
                sync = op.spec.sync
                if sync is Sync.POST:
                    keys = [("send" if key[0] == r else "recv", key) for key in op.messages(r)]
                    posted.update(keys)
                    handles[(r, op.outs[0])] = keys
                elif sync is Sync.WAIT:
                    mine = handles[(r, op.ins[0])]
                    need = [("recv" if side == "send" else "send", key) for side, key in mine]
                    if not all(n in posted for n in need):
                        break
                elif sync is Sync.COLLECTIVE:
                    collective[(r, op.outs[0])] = op.args.seq
                    joined[op.args.seq] = joined.get(op.args.seq, 0) + 1
                elif sync is Sync.JOIN:
                    if joined.get(collective[(r, op.ins[0])], 0) < len(programs):
                        break
                elif sync not in (Sync.NONE, Sync.REPLICAS):
                    raise LoweringError(f"rank {r} op {pos[r]} ({op}): the deadlock check does not model "
                                        f"{sync.value} ops yet; add their rule to validate._simulate")
                pos[r] += 1
                progressed = True
    stuck = {p.rank: pos[p.rank] for p in programs if pos[p.rank] < len(p.ops)}
    if not stuck:
        return
    pictures = "\n".join(p.to_text(mark=stuck[p.rank], window=3) for p in programs if p.rank in stuck)
    by_rank = {p.rank: p for p in programs}
    what = "; ".join(f"rank {r} waits at op {i} ({by_rank[r].ops[i]})" for r, i in stuck.items())
    raise LoweringError(f"the rank programs deadlock: {what}\n{pictures}\n"
                        f"fix: post the receive earlier (recv_lookahead) or reorder the schedule")


def check_pair_order(programs: Sequence[RankProgram]) -> Sequence[RankProgram]:
    """Raise LoweringError, with both ranks' sequences side by side, if for some pair (a -> b) rank b
    posts its receives from a in another order than rank a posts its sends to b; returns them unchanged."""
    sends, recvs = pair_sequences(programs)
    for pair in sorted(set(sends) | set(recvs)):
        sent, got = sends.get(pair, []), recvs.get(pair, [])
        if [p.tag for p in sent] != [p.tag for p in got]:
            raise LoweringError(_order_picture(pair, sent, got))
    return programs


def _order_picture(pair: tuple[int, int], sent, got, window: int = 4) -> str:
    """The two ranks' sequences for one pair side by side around the first mismatch (marked >>)."""
    a, b = pair
    first = next((k for k, (x, y) in enumerate(zip(sent, got)) if x.tag != y.tag), min(len(sent), len(got)))
    cells = [[f"op {p.op:4d}  tag {p.tag:4d}  {p.value}" for p in seq] for seq in (sent, got)]
    head = f"rank {a} sends to rank {b}"
    width = max(len(c) for c in cells[0] + [head])
    rows = [f"{'':11}{head:<{width}} | rank {b} receives from rank {a}"]
    for k in range(max(0, first - window), min(max(len(sent), len(got)), first + window + 1)):
        left, right = (c[k] if k < len(c) else "-" for c in cells)
        rows.append(f"{'>>' if k == first else '  '} {k:4d}.   {left:<{width}} | {right}")
    return (f"rank {b} posts its receives from rank {a} in another order than rank {a} posts its sends to it, "
            f"first at position {first}; NCCL matches them by order, not tag, so it would swap tensors or hang:\n"
            + "\n".join(rows)
            + "\nfix: lower with order_p2p_by_pair (lower_all does unless pair_order=False)")
