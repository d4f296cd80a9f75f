"""passes/lower/step_boundary.py: the post-validated programs read as programs. Their warm-ups are the closed
forms of each schedule, nothing global runs between a rank's last backward and its update, the messages of an
abandoned warm-up are drained, and the programs print and parse back."""

from __future__ import annotations

import pytest

from support.lowered import lowered_gpt
from zbcompile.ir.actions import Kind
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import OpKind, Sync
from zbcompile.passes.lower import DataParallel
from zbcompile.passes.lower.step_boundary import boundary_programs, deadlines

CASES = [("1f1b", 2), ("1f1b", 4), ("zb-h1", 4), ("zb-h2", 4), ("zbv", 2), ("zbv", 4), ("interleaved-1f1b", 2),
         ("dualpipev", 2), ("1f1b-vocab", 2)]


def _variants(name: str, pp: int, dp=None):
    return boundary_programs(lowered_gpt(name, pp, dp))


def _validate_at(program: RankProgram) -> int:
    return next(i for i, op in enumerate(program.ops) if op.kind is OpKind.VALIDATE)


@pytest.mark.parametrize("name,pp", CASES, ids=[f"{n}-pp{p}" for n, p in CASES])
def test_the_warm_up_before_the_deadline_holds_only_forwards_fed_from_below(name, pp):
    """Before VALIDATE a rank runs only forwards whose inputs come from lower ranks and whose outputs go to higher
    ones; every send it posted there is waited there and every receive posted there is of a warm-up message
    (so that a step abandoned at VALIDATE leaves nothing open); the totals arrive from r+1 and go on to r-1."""
    first, validating, tags = _variants(name, pp)
    for q in validating:
        r, cut = q.rank, _validate_at(q)
        head = q.ops[:cut]
        assert all(op.action.kind is Kind.F for op in head if op.kind is OpKind.RUN), (r, name)
        assert not any(op.spec.sync in (Sync.COLLECTIVE, Sync.JOIN) for op in head)
        posted = {op.outs[0] for op in head if op.kind in (OpKind.SEND, OpKind.RECV)}
        waited = {op.ins[0] for op in head if op.kind in (OpKind.WAIT_SEND, OpKind.WAIT_RECV)}
        assert posted == waited, (r, sorted(posted ^ waited))
        for op in head:
            for src, dst, tag in op.messages(r):
                if tag == tags.totals:
                    assert (src, dst) in ((r + 1, r), (r, r - 1)), (r, src, dst)
                else:
                    assert (src < r and dst == r) or (src == r and dst > r), (r, name, src, dst, tag)
        assert (q.ops[cut].ins, q.ops[cut - 1 if r == 0 else cut - 2].kind) == (("pv.totals",), OpKind.WAIT_RECV
                                                                               if r == 0 else OpKind.SEND)


@pytest.mark.parametrize("name,pp,warm,drained", [
    ("1f1b", 4, lambda p, r: p - r, lambda p, r: int(r > 0)),          # p - r forwards before the first B
    ("zb-h1", 4, lambda p, r: p - r, lambda p, r: int(r > 0)),
    ("zbv", 4, lambda p, r: 2 * (p - r) - 1, lambda p, r: 2 * (r > 0)),  # chunk 0's forwards until chunk 1's
    ("zbv", 2, lambda p, r: 2 * (p - r) - 1, lambda p, r: 2 * (r > 0)),
])
def test_warm_ups_and_drains_follow_the_closed_forms(name, pp, warm, drained):
    """The warm-up of rank r is every forward before its first backward (1F1B, ZB-H1: p - r; ZB-V: the
    2(p - r) - 1 forwards of chunk 0 before chunk 1 starts), and a rank drains what its upstream's longer
    warm-up sent beyond its own (one forward's boundary tensors in 1F1B, two forwards' in ZB-V)."""
    first, validating, tags = _variants(name, pp)
    runs = [sum(op.kind is OpKind.RUN for op in q.ops[:d]) for q, d in zip(first, deadlines(first))]
    assert runs == [warm(pp, r) for r in range(pp)]
    for q in first[1:]:   # each forward's boundary tensors are one message each
        from_up = [op for op in q.ops if op.kind is OpKind.RECV and op.args.peer == q.rank - 1
                   and op.args.tag != tags.prefix]
        per_forward = len(from_up) // (q.microbatches * (2 if name == "zbv" else 1))
        assert len(validating[q.rank].ops[_validate_at(validating[q.rank])].args.drains) == \
            drained(pp, q.rank) * per_forward, q.rank


@pytest.mark.parametrize("name,pp", CASES, ids=[f"{n}-pp{p}" for n, p in CASES])
def test_no_global_collective_between_the_last_backward_and_the_update(name, pp):
    """After a rank's last action only local work and P2P follow (its gradients' sums, the prefix from r-1 and on
    to r+1): no collective over the pipeline, which would make the update wait for every rank. The prefix chain
    runs 0 -> p-1 once per step."""
    first, validating, tags = _variants(name, pp)
    for variant in (first, validating):
        for q in variant:
            last = max(i for i, op in enumerate(q.ops) if op.kind is OpKind.RUN)
            tail = q.ops[last + 1:]
            assert not any(op.spec.sync in (Sync.COLLECTIVE, Sync.JOIN) for op in tail), q.rank
            assert [op.kind for op in tail].count(OpKind.PREFIX) == 1
            prefix = [m for op in q.ops for m in op.messages(q.rank) if m[2] == tags.prefix]
            want = [(q.rank - 1, q.rank, tags.prefix)] * (q.rank > 0) + [(q.rank, q.rank + 1, tags.prefix)] * (
                q.rank < pp - 1)
            assert prefix == want


@pytest.mark.parametrize("dp", [DataParallel(), DataParallel(shard=2)], ids=["replicated", "sharded"])
def test_data_parallel_programs_take_the_boundary_too(dp):
    """With data parallelism the gradient reductions (and with sharding the gathers) stay where they were: only
    the replicas' own group, never the pipeline's, is waited on in the tail."""
    first, validating, _ = _variants("zbv", 2, dp)
    for q in validating:
        kinds = {op.kind for op in q.ops}
        assert OpKind.DP_REDUCE in kinds and OpKind.VALIDATE in kinds and OpKind.PREFIX in kinds


@pytest.mark.parametrize("name,pp", [("zbv", 4), ("1f1b-vocab", 2)])
def test_the_boundary_programs_print_and_parse_back(name, pp):
    first, validating, _ = _variants(name, pp)
    for q in (*first, *validating):
        assert RankProgram.from_text(q.to_text(), graphs=q.graphs) == q
        assert q.passes[-1] in ("add_prefix", "validate_at_deadline")
