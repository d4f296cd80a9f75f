"""Lowering the vocabulary layers (passes/lower/vocab.py) on hand-written schedules, in one process: every rank
posts the same collectives in the same order, the programs print and parse back, the checks see the
collectives (the order check, the deadlock check's join rule, the stream check), and gradients of the sharded
parameters are summed on their own rank only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.models import gpt
from zbcompile.errors import LoweringError
from zbcompile.passes.lower import lower_all
from zbcompile.passes.lower.streams import check_streams
from zbcompile.passes.lower.validate import check_collectives
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Coll, OpKind
from zbcompile.ir.schedule import Schedule
from zbcompile.split import split_model

torch.set_num_threads(1)

ONE_F_ONE_B = """# zbcompile schedule 1f1b+vocab: microbatches=2 placement=0,1 pipelines=1
rank 0: 0IF0 0IF1 0F0 0F1 0S0 0T0 0BW0 0S1 0T1 0IB0 0BW1 0IB1
rank 1: 1IF0 1IF1 1F0 1S0 1T0 1BW0 1F1 1S1 1T1 1BW1 1IB0 1IB1
"""
ZBV = """# zbcompile schedule zbv+vocab: microbatches=2 placement=0,1,1,0 pipelines=1
rank 0: 0IF0 0IF1 0F0 0F1 3F0 0S0 0T0 3B0 3F1 0S1 0T1 3B1 0B0 0IB0 3W0 0B1 0IB1 3W1 0W0 0W1
rank 1: 1IF0 1IF1 1F0 2F0 1F1 1S0 1T0 2F1 2B0 1S1 1T1 1B0 2B1 1IB0 1B1 2W0 1IB1 1W0 2W1 1W1
"""
# rank 0 runs T0 (which waits for every rank's S0) before F1, while rank 1 runs S0 only after F1 reaches it
DEADLOCK = """# zbcompile schedule stuck: microbatches=2 placement=0,1 pipelines=1
rank 0: 0IF0 0IF1 0F0 0S0 0T0 0F1 0BW0 0S1 0T1 0IB0 0BW1 0IB1
rank 1: 1IF0 1IF1 1F0 1F1 1S0 1T0 1BW0 1S1 1T1 1BW1 1IB0 1IB1
"""


@pytest.fixture(scope="module")
def staged():
    case = gpt(layers=4)
    return {n: split_model(case.model, case.loss_fn, case.example, num_stages=n, placement=placement,
                           vocab_shards=2) for n, placement in ((2, (0, 1)), (4, (0, 1, 1, 0)))}


@pytest.mark.parametrize("text", [ONE_F_ONE_B, ZBV], ids=["1f1b", "zbv"])
def test_every_rank_posts_the_same_collectives(staged, text):
    schedule = Schedule.from_text(text).validate().check_order()
    programs = lower_all(schedule, staged[schedule.num_model_stages], check_each_pass=True)
    check_streams(programs)
    seqs = [[op.args for op in p.ops if op.kind is OpKind.COLLECTIVE] for p in programs]
    assert seqs[0] == seqs[1]
    m = schedule.num_microbatches
    kinds = [a.op for a in seqs[0]]
    assert kinds.count(Coll.BROADCAST) == 2 * m and kinds.count(Coll.REDUCE) == 2 * m
    assert kinds.count(Coll.ALL_GATHER) == m
    for p in programs:   # each post is joined, once, after it
        posted = {op.outs[0]: i for i, op in enumerate(p.ops) if op.kind is OpKind.COLLECTIVE}
        joined = {op.ins[0]: i for i, op in enumerate(p.ops) if op.kind is OpKind.WAIT_COLL}
        assert posted.keys() == joined.keys() and all(posted[h] < joined[h] for h in posted)


def test_programs_print_and_parse_back(staged):
    schedule = Schedule.from_text(ZBV)
    for p in lower_all(schedule, staged[4]):
        assert RankProgram.from_text(p.to_text(), graphs=p.graphs) == p


def test_sharded_gradients_stay_on_their_rank(staged):
    """A tied embedding / head would be summed across the end ranks; its shards are not: each rank hands its
    own sum of the IB and T gradients to .grad, with no P2P for it."""
    programs = lower_all(Schedule.from_text(ONE_F_ONE_B), staged[2])
    for p in programs:
        grads = [op for op in p.ops if op.kind is OpKind.SET_GRAD and op.ins[0] == "param:wte.weight"]
        assert len(grads) == 1 and grads[0].args.owned
        assert not any(op.kind is OpKind.SUM for op in p.ops)
        assert "vocab:offset" in p.inputs


def test_a_different_collective_order_is_refused(staged):
    programs = list(lower_all(Schedule.from_text(ONE_F_ONE_B), staged[2]))
    ops = list(programs[1].ops)
    posts = [i for i, op in enumerate(ops) if op.kind is OpKind.COLLECTIVE]
    ops[posts[0]], ops[posts[1]] = ops[posts[1]], ops[posts[0]]
    programs[1] = dataclasses.replace(programs[1], ops=tuple(ops))
    with pytest.raises(LoweringError, match="collective number 0 differs between rank 0 .* and rank 1"):
        check_collectives(programs)


def test_a_collective_no_rank_can_join_is_a_deadlock(staged):
    schedule = Schedule.from_text(DEADLOCK)
    with pytest.raises(LoweringError, match="deadlock"):
        lower_all(schedule, staged[2])


def test_the_gathered_whole_table_is_freed_right_after_its_last_reader():
    """pipe(x) with vocabulary parallelism all-gathers the output layer's table whole (`vocab:whole:<fqn>`) for
    the last stage's forwards: one FREE right after its last reader (timing stamps aside), not held to the end
    of the step while keep_outputs assembles the outputs."""
    from zbcompile.compiler import compile_forward, compile_programs
    from zbcompile.options import CompileOptions

    case = gpt(layers=4, batch=8)
    x, y = case.example
    opts = CompileOptions.from_kwargs(None, schedule="zbv", microbatches=4, loss_fn=case.loss_fn,
                                      example=((x[:2],), (y[:2],)), vocab_parallel=True)
    seen = 0
    for program in compile_forward(compile_programs(case.model, opts, 2), training=False, outputs=True):
        ops = program.ops
        last = {v: i for i, op in enumerate(ops) if op.kind is not OpKind.FREE for v in op.ins
                if v.startswith("vocab:whole:")}
        for value, i in last.items():
            k = next(k for k in range(i + 1, len(ops)) if ops[k].kind is not OpKind.STAMP)
            assert ops[k].kind is OpKind.FREE and value in ops[k].ins, (program.rank, value, ops[k])
            seen += 1
    assert seen
