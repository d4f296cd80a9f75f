"""insert_p2p: receive what other ranks produce, send what they consume.

Rules (both sides derive everything from the schedule and the stage specs, so they agree without talking):

* A value a RUN op reads that no op on this rank defines comes from the rank holding its producing stage:
  `s0.mb1.act:h` from placement[0], `s2.mb1.grad:act:h` from placement[2].
* Its receive is posted `recv_lookahead` RUN ops before the first consumer (so the transfer overlaps that
  compute) and waited right before the consumer; the wait returns the buffer (the data edge fx needs).
* All outputs of one RUN op that other ranks read go out in one batch of isends right after it.
* A batch of sends is waited once this rank has received something its peer produced at or after the
  consumer of our data (so the peer surely holds it); failing that, at the end of the step.
* Tags: `p2p_tag(stage, microbatch, direction, k)` of the *producing* stage, identical on both sides.

    s0.mb0.act:h, s0.mb0.saved:0 = stage0.f(...)            h:s1.mb0.grad:act:h = irecv(from 1 tag 9 ...)
    h:send0 = isend(s0.mb0.act:h -> 1 tag 0)        ...    s1.mb0.grad:act:h = wait_recv(h:s1.mb0.grad:act:h)
"""

from __future__ import annotations

from zbcompile.errors import LoweringError
from zbcompile.program import Op, OpKind, RankProgram, split_value_id
from zbcompile.schedule import Action, Kind, Schedule
from zbcompile.stages import StagedModel, TensorSpec

__all__ = ["insert_p2p", "p2p_tag", "reduce_tag", "boundary_spec", "producer_action"]

FORWARD, BACKWARD = 0, 1


def _width(staged: StagedModel) -> int:
    return max([len(s.send) for s in staged.stages] + [len(s.recv) for s in staged.stages] + [1])


def p2p_tag(schedule: Schedule, staged: StagedModel, stage: int, microbatch: int, direction: int, k: int) -> int:
    """Tag of the k-th boundary tensor that `stage` produces for `microbatch` (direction 0: act, 1: grad)."""
    return ((microbatch * schedule.num_stages + stage) * 2 + direction) * _width(staged) + k


def reduce_tag(schedule: Schedule, staged: StagedModel, index: int) -> int:
    """Tag of the index-th shared parameter's gradient exchange; above every p2p_tag."""
    return schedule.num_microbatches * schedule.num_stages * 2 * _width(staged) + index


def boundary_spec(program: RankProgram, vid: str) -> tuple[TensorSpec, int, int]:
    """(spec, direction, k) of a boundary value `s{s}.mb{mb}.act:X` or `s{s}.mb{mb}.grad:act:X`."""
    s, mb, name = split_value_id(vid)
    stage = program.staged.stages[program.schedule.model_stage(s)]
    if name.startswith("act:"):
        specs, direction, key = stage.send, FORWARD, name
    elif name.startswith("grad:act:"):
        specs, direction, key = stage.recv, BACKWARD, name[len("grad:"):]
    else:
        raise LoweringError(f"rank {program.rank}: {vid!r} is needed here but produced on another rank, and "
                            f"only act:/grad:act: values cross ranks")
    for k, spec in enumerate(specs):
        if spec.name == key:
            return spec, direction, k
    raise LoweringError(f"rank {program.rank}: {vid!r} crosses ranks but stage {s} declares no boundary "
                        f"tensor {key!r} (it has {[sp.name for sp in specs]})")


def producer_action(schedule: Schedule, vid: str) -> Action:
    """The action that defines a boundary value."""
    s, mb, name = split_value_id(vid)
    if name.startswith("act:"):
        return Action(Kind.F, s, mb)
    return schedule.backward_of(s, mb)


def _needs(program: RankProgram) -> list[str]:
    """Values read here, defined nowhere here, in order of first use."""
    defined = program.defined()
    seen: dict[str, None] = {}
    for op in program.ops:
        for v in op.ins:
            if v not in defined:
                seen.setdefault(v)
    return list(seen)


def _remote_consumers(program: RankProgram) -> dict[str, list[tuple[int, Action]]]:
    """For each value this rank defines that other ranks read: (rank, first consuming action) per reader."""
    from zbcompile.passes.lower.compute import build_compute

    out: dict[str, list[tuple[int, Action]]] = {}
    for q in range(program.schedule.num_ranks):
        if q == program.rank:
            continue
        peer = build_compute(program.replace(rank=q, ops=(), inputs=()))
        defined = peer.defined()
        for op in peer.run_ops():
            for v in op.ins:
                if v in defined or split_value_id(v) is None:
                    continue
                src = program.schedule.placement[split_value_id(v)[0]]
                readers = out.setdefault(v, []) if src == program.rank else None
                if readers is not None and all(r != q for r, _ in readers):
                    readers.append((q, op.action))
    return out


def insert_p2p(program: RankProgram) -> RankProgram:
    sched, rank = program.schedule, program.rank
    ops = list(program.ops)
    run_at = [i for i, op in enumerate(ops) if op.kind is OpKind.RUN]
    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    waits_at_recv: dict[str, list[Op]] = {}
    tail: list[Op] = []

    for v in _needs(program):
        s, mb, _ = split_value_id(v)
        src = sched.placement[s]
        if src == rank:
            raise LoweringError(f"rank {rank}: {v!r} is read here and produced here, but its producer "
                                f"{producer_action(sched, v)} is not in this rank's action list")
        spec, direction, k = boundary_spec(program, v)
        consumer = next(i for i, op in enumerate(ops) if v in op.ins)
        j = run_at.index(consumer)
        post = run_at[max(0, j - program.recv_lookahead)]
        handle = f"h:{v}"
        tag = p2p_tag(sched, program.staged, s, mb, direction, k)
        before.setdefault(post, []).append(Op(OpKind.RECV, (), (handle,), peers=(src,), tags=(tag,),
                                              specs=(spec,), note=f"for {ops[consumer].action}"))
        before.setdefault(consumer, []).append(Op(OpKind.WAIT_RECV, (handle,), (v,)))

    consumers = _remote_consumers(program)
    recv_order = _needs(program)
    n_send = 0
    for i in run_at:
        op = ops[i]
        sends = [(v, q, a) for v in op.outs for q, a in consumers.get(v, ())]
        if not sends:
            continue
        handle = f"h:send{n_send}"
        n_send += 1
        tags, specs = [], []
        for v, _, _ in sends:
            s, mb, _ = split_value_id(v)
            spec, direction, k = boundary_spec(program, v)
            tags.append(p2p_tag(sched, program.staged, s, mb, direction, k))
            specs.append(spec)
        after.setdefault(i, []).append(Op(OpKind.SEND, tuple(v for v, _, _ in sends), (handle,),
                                          peers=tuple(q for _, q, _ in sends), tags=tuple(tags),
                                          specs=tuple(specs)))
        done_at = _send_done_at(sched, sends, recv_order, ops, i)
        wait = Op(OpKind.WAIT_SEND, (handle,))
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


def _send_done_at(sched: Schedule, sends, recv_order: list[str], ops: list[Op], sent_at: int) -> str | None:
    """The first received value after which every send of the batch has surely arrived, or None."""
    positions = {q: {a: i for i, a in enumerate(sched.ranks[q])} for q in {q for _, q, _ in sends}}
    first_use = {}
    for i, op in enumerate(ops):
        for v in op.ins:
            first_use.setdefault(v, i)
    best = -1
    best_v = None
    for _, q, consumer in sends:
        found = None
        for v in recv_order:
            s = split_value_id(v)[0]
            if sched.placement[s] != q or first_use[v] <= sent_at:
                continue
            if positions[q][producer_action(sched, v)] >= positions[q][consumer]:
                if found is None or first_use[v] < first_use[found]:
                    found = v
        if found is None:
            return None
        if first_use[found] > best:
            best, best_v = first_use[found], found
    return best_v
