"""gather_params (passes/lower/dp_shard.py): sharded data parallelism's gathers and reduce-scatters, read off the
lowered programs (one process, no groups): where each gather sits, what the stage graphs read, what the memory
plan counts, and a program run as the only replica giving the plain program's gradients bitwise.
tests/distributed/test_data_parallel.py trains with them on four processes against eager."""

from __future__ import annotations

import pytest
import torch

from support.lowered import DP_CASES, lowered_gpt
from support.models import gpt
from support.threaded import run_threaded
from zbcompile.compiler import split_for
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import OpKind, padded_shard_bytes
from zbcompile.ir.program.values import Role, parse
from zbcompile.passes.analysis.memory import CATEGORIES, memory_plan
from zbcompile.passes.lower import DataParallel
from zbcompile.passes.schedules import generate

torch.set_num_threads(1)

POLICIES = ("step", "microbatch")


def _whole_params_read(program: RankProgram) -> set[str]:
    """The parameters the stage graphs read as program inputs (not gathered)."""
    return {parse(v).key for op in program.run_ops() for v in op.ins
            if parse(v).scope == "state" and parse(v).role is Role.PARAM}


@pytest.mark.parametrize("gather", POLICIES)
@pytest.mark.parametrize("name,pp", DP_CASES, ids=[f"{n}-pp{p}" for n, p in DP_CASES])
def test_every_parameter_is_gathered_before_an_action_reads_it(name, pp, gather):
    """No stage graph reads a sharded parameter's shard: each reads the gathered whole, waited for before the
    action. "step": one gather of each parameter per rank, posted one action early; "microbatch": one per action
    that reads it, right before it. The gradients are reduce-scattered (0-dim ones all-reduced) and set on the
    shards (zero.param:, program inputs)."""
    plain = lowered_gpt(name, pp, DataParallel())
    for before, program in zip(plain, lowered_gpt(name, pp, DataParallel(shard=2, gather=gather))):
        defined = {v: i for i, op in enumerate(program.ops) for v in op.outs}
        gathers = program.of_kind(OpKind.DP_GATHER)
        assert [op.args.bucket for op in gathers] == list(range(len(gathers)))
        read = {}
        for i, op in enumerate(program.ops):
            if op.kind is not OpKind.RUN:
                continue
            for v in op.ins:
                if parse(v).scope == "gather":
                    wait = program.ops[defined[v]]
                    assert wait.kind is OpKind.WAIT_GATHER and defined[v] < i
                    read.setdefault(parse(v).key, []).append(parse(v).index)
        assert _whole_params_read(program) == set(), program.rank   # gpt has no 0-dim parameter
        counts = {fqn: len(set(ks)) for fqn, ks in read.items()}
        if gather == "step":
            assert set(counts.values()) == {1}, counts
        else:   # a gather per action: as many as the actions reading the parameter
            assert max(counts.values()) > 1, counts
        assert set(read) == _whole_params_read(before)
        set_grads = program.of_kind(OpKind.SET_GRAD)
        assert {parse(op.ins[0]).scope for op in set_grads} == {"zero"}
        assert all(op.args.scatter == 2 for op in program.of_kind(OpKind.DP_REDUCE))
        assert {op.ins[0] for op in set_grads} <= set(program.inputs)
        assert not any(parse(v).scope == "state" and parse(v).role is Role.PARAM for v in program.inputs)


def test_the_resident_parameters_are_the_padded_shards():
    """The memory plan counts each rank's resident parameters as its shards (ceil(rows / dp) rows each, half of
    the replicated program's here) and the gathered ones in the "params" category while they live."""
    replicated = memory_plan(lowered_gpt("zbv", 2, DataParallel()))
    sharded_programs = lowered_gpt("zbv", 2, DataParallel(shard=2))
    sharded = memory_plan(sharded_programs)
    params = CATEGORIES.index("params")
    for whole, shard, program in zip(replicated, sharded, sharded_programs):
        want = sum(padded_shard_bytes(t, 2) for op in program.of_kind(OpKind.DP_GATHER) for t in op.args.types)
        assert shard.resident["parameters"] == want
        assert 0.45 * whole.resident["parameters"] <= want <= 0.55 * whole.resident["parameters"]
        assert max(s.after[params] for s in shard.samples) >= whole.resident["parameters"]
        assert shard.samples[-1].after[params] == 0   # dropped after their last reader


def test_microbatch_gathers_hold_no_whole_parameter_between_actions():
    """gather="microbatch": after every action no gathered parameter is live (the forward's saved views of the
    weights are redone in the backward from its own gather); "step" holds them from the first action to the
    last."""
    params = CATEGORIES.index("params")
    for policy, held in (("microbatch", False), ("step", True)):
        programs = lowered_gpt("zbv", 2, DataParallel(shard=2, gather=policy))
        for program, rank in zip(programs, memory_plan(programs)):
            runs = [i for i, op in enumerate(program.ops) if op.kind is OpKind.RUN]
            between = [rank.samples[i].after[params] for i in runs[:-1]]
            assert (max(between) > 0) is held, (policy, program.rank, between)
    for program in lowered_gpt("zbv", 2, DataParallel(shard=2, gather="microbatch")):
        assert any(k.endswith("_rv0") for k in program.graphs), "a backward reads the weights again"


def test_a_sharded_program_prints_and_parses_back():
    program = lowered_gpt("zbv", 2, DataParallel(shard=2))[0]
    text = program.to_text()
    assert "dp_gather(zero.param:" in text and "scatter over 2" in text and "wait_gather(h:ag0; bucket 0" in text
    assert RankProgram.from_text(text, graphs=program.graphs) == program


@pytest.mark.parametrize("gather", POLICIES)
def test_a_sharded_program_as_one_replica_gives_the_plain_gradients(gather):
    """Run as the only replica, the gathers hand back the whole parameters and the reduce-scatters the whole
    gradients: bitwise the gradients of the program without data parallelism."""
    case = gpt(layers=4, batch=4)
    sched = generate("zbv", 2, 4)
    staged = split_for(case.model, case.loss_fn, case.example, sched)
    batch = tuple(torch.cat([t] * 4) for t in case.example)
    _, plain, _ = run_threaded(case.model, staged, sched, batch)
    _, sharded, _ = run_threaded(case.model, staged, sched, batch, replicas=2, dp_shard=True, dp_gather=gather)
    for a, b in zip(plain, sharded):
        ga = {n: p.grad for n, p in a.named_parameters() if p.grad is not None}
        gb = {n: p.grad for n, p in b.named_parameters() if p.grad is not None}
        assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("gather", POLICIES)
def test_sharded_programs_offload_activations_too(gather):
    """Activation offload runs after the gathers are placed: the offloaded and reloaded saved tensors (the
    forward's saved weight views among them, where "step" keeps them) give the plain gradients bitwise."""
    from zbcompile.passes.lower import OffloadChoice

    case = gpt(layers=4, batch=4)
    sched = generate("zb-h1", 2, 4)
    staged = split_for(case.model, case.loss_fn, case.example, sched)
    batch = tuple(torch.cat([t] * 4) for t in case.example)
    _, plain, _ = run_threaded(case.model, staged, sched, batch)
    _, sharded, runtimes = run_threaded(case.model, staged, sched, batch, replicas=2, dp_shard=True,
                                        dp_gather=gather, offload=OffloadChoice(min_bytes=0))
    assert all(rt.ir.of_kind(OpKind.OFFLOAD) for rt in runtimes)
    for a, b in zip(plain, sharded):
        ga = {n: p.grad for n, p in a.named_parameters() if p.grad is not None}
        gb = {n: p.grad for n, p in b.named_parameters() if p.grad is not None}
        assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_step_gathers_are_posted_one_action_before_the_action_they_serve():
    """dp_shard with gather="step": each gather is posted one action early, so that the action before the one it
    serves hides it; a wait with no action between it and its post (after the rank's first action, which nothing
    can precede) would leave the step waiting on that gather."""
    for program in lowered_gpt("zbv", 2, DataParallel(shard=2, gather="step")):
        ops = program.ops
        first_run = next(i for i, op in enumerate(ops) if op.kind is OpKind.RUN)
        posted = {op.outs[0]: i for i, op in enumerate(ops) if op.kind is OpKind.DP_GATHER}
        exposed = [i for i, op in enumerate(ops) if op.kind is OpKind.WAIT_GATHER and i > first_run
                   and not any(ops[k].kind is OpKind.RUN for k in range(posted[op.ins[0]], i))]
        assert posted and not exposed, (program.rank, exposed)
