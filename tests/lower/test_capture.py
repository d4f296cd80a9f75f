"""CUDA-graph capture of the whole step, checked without a GPU (passes/analysis/capture.py): every schedule's
program passes the lint once lowered with capture_ready, and programs made unsafe on purpose fail it, each with
the op or graph node and a reason."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import re

import pytest
import torch
from torch import fx

import zbcompile as zb
from support.models import gpt
from support.threaded import assert_graded_where_eager_is, max_grad_error, param_holders, run_threaded
from zbcompile.errors import CaptureError, ZBCompileError
from zbcompile.passes.analysis.capture import capture_problems, check_capture, node_problem
from zbcompile.passes.lower import CAPTURE_FINISHING, emit_fx, lower_all
from zbcompile.passes.schedules import GENERATORS, generate
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import SAFE, SPECS, Op, OpKind
from zbcompile.split import split_model
from zbcompile.ir.stages import StagedModel

torch.set_num_threads(1)

WAITS = {OpKind.WAIT_RECV, OpKind.WAIT_SEND, OpKind.WAIT_COLL}


@functools.lru_cache(maxsize=None)
def _gpt_split(stages: int, dropout: float = 0.0) -> StagedModel:
    model, loss_fn, (x, y), _ = gpt(layers=4, batch=4, dropout=dropout)
    return split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=stages)


@functools.lru_cache(maxsize=None)
def _lowered(name: str, pp: int, capture: bool) -> tuple[RankProgram, ...]:
    sched = generate(name, pp, 2 * pp)
    staged = _gpt_split(sched.num_model_stages)
    return lower_all(sched, staged, finishing=CAPTURE_FINISHING) if capture else lower_all(sched, staged)


def _kinds(program: RankProgram) -> set[OpKind]:
    return {program.ops[p.op].kind for p in capture_problems(program) if p.node is None and p.op is not None}


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_every_schedule_is_capture_safe_after_capture_ready(name, pp):
    programs = _lowered(name, pp, capture=True)
    check_capture(programs)   # raises CaptureError with the table otherwise
    for p in programs:
        assert not p.wait_timeout and all(op.args.slot is not None for op in p.of_kind(OpKind.RECV))
        assert not any(op.args.owned for op in p.of_kind(OpKind.SET_GRAD)) and p.staged_inputs


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipe"])
def test_todays_programs_are_blocked_only_by_timed_waits_owned_grads_and_host_stamps(name):
    """The finding: the default lowering slots every receive and stages the batch, but every wait is timed
    (work.wait(timeout)), SET_GRAD takes ownership of a multi-microbatch sum and the stamps read the host clock."""
    programs = _lowered(name, 2, capture=False)
    with pytest.raises(CaptureError, match="timed wait"):
        check_capture(programs)
    for p in programs:
        assert _kinds(p) <= WAITS | {OpKind.SET_GRAD, OpKind.STAMP} and _kinds(p) & WAITS and OpKind.STAMP in _kinds(p)
        for problem in capture_problems(p):
            op = p.ops[problem.op]
            assert op.kind is not OpKind.SET_GRAD or (op.args.owned and "ownership" in problem.reason)


def test_a_receive_without_a_slot_is_reported_at_its_op():
    program = _lowered("1f1b", 2, capture=True)[1]
    i = next(i for i, op in enumerate(program.ops) if op.kind is OpKind.RECV)
    ops = list(program.ops)
    ops[i] = ops[i]._replace(args=ops[i].args._replace(slot=None))
    problems = capture_problems(program.replace(ops=tuple(ops)))
    assert [(p.op, p.node) for p in problems] == [(i, None)]
    assert "fresh buffer" in problems[0].reason and "irecv" in problems[0].reason
    assert "static_recv_buffers" in problems[0].fix


def test_a_batch_not_staged_is_reported_for_the_program():
    program = _lowered("1f1b", 2, capture=True)[0].replace(staged_inputs=False)
    problems = capture_problems(program)
    assert [(p.op, p.node, p.where) for p in problems] == [(None, None, "program")]
    assert "not staged" in problems[0].reason


def test_an_item_in_a_stage_graph_is_reported_at_its_node():
    program = _lowered("1f1b", 2, capture=True)[0]
    run = program.run_ops()[0]
    g = program.graph(run)
    graph = copy.deepcopy(g.gm.graph)
    x = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_after(x):
        item = graph.call_function(torch.ops.aten._local_scalar_dense.default, (x,))
    bad = program.replace(graphs={**program.graphs, run.args.graph: dataclasses.replace(g, gm=fx.GraphModule(
        g.gm, graph))})
    problems = capture_problems(bad)
    assert [p.node for p in problems] == [f"{run.args.graph}:{item.name}"]
    assert problems[0].op == program.ops.index(run) and ".item()" in problems[0].reason
    with pytest.raises(CaptureError, match=r"rank\(s\) \[0\]") as e:
        check_capture([bad, _lowered("1f1b", 2, capture=True)[1]])
    assert item.name in str(e.value) and "_local_scalar_dense" in str(e.value)


def test_a_timed_wait_shows_in_the_ir_and_the_emitted_code():
    """RankProgram.wait_timeout: True (today's default) calls work.wait(timeout); capture_ready makes it False,
    printed in the header, read back, and emitted as the waits' timed=False argument."""
    program = _lowered("1f1b", 2, capture=True)[0]
    assert program.header().endswith(", untimed waits, event timing")
    assert RankProgram.from_text(program.to_text(), graphs=program.graphs) == program
    calls = _wait_calls(program)
    assert calls and all(c.endswith(", False)") for c in calls)
    timed = program.replace(wait_timeout=True)
    problems = capture_problems(timed)
    assert problems and {timed.ops[p.op].kind for p in problems} <= WAITS
    assert all("timed wait" in p.reason and "wait_timeout=False" in p.fix for p in problems)
    assert not any(c.endswith(", False)") for c in _wait_calls(timed))


def _wait_calls(program: RankProgram) -> list[str]:
    return re.findall(r"abi_wait_(?:recv|send)\(ctx, [^)]*\)", emit_fx(program).code)


def test_dropout_passes_and_a_random_op_with_its_own_generator_is_reported():
    """torch registers the default CUDA generator with every captured graph (each replay draws afresh); a
    generator of the model's own is not registered, so an op given one would replay the captured draw."""
    staged = _gpt_split(2, dropout=0.1)
    programs = lower_all(generate("1f1b", 2, 4), staged, finishing=CAPTURE_FINISHING)
    assert any(n.target == torch.ops.aten.native_dropout.default
               for p in programs for g in p.graphs.values() if g.gm is not None for n in g.gm.graph.nodes)
    check_capture(programs)
    graph = fx.Graph()
    x = graph.placeholder("x")
    default = graph.call_function(torch.ops.aten.bernoulli.p, (x, 0.5))
    own = graph.call_function(torch.ops.aten.bernoulli.p, (x, 0.5), {"generator": torch.Generator()})
    assert node_problem(default) is None
    assert "Generator of its own" in node_problem(own)


def test_every_op_kind_decides_capture_and_an_undecided_kind_is_reported():
    for kind, spec in SPECS.items():
        assert spec.capture == SAFE or callable(spec.capture) or (isinstance(spec.capture, str) and spec.capture), kind
    undecided = dataclasses.replace(SPECS[OpKind.FREE], capture=None)
    program = _lowered("1f1b", 2, capture=True)[0]
    assert "not been checked" in undecided.capture_problem(Op(OpKind.FREE, ("x",)), program)


def test_cuda_graphs_without_a_cuda_device_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, loss_fn, (x, y), _ = gpt(layers=2, batch=2)
    with pytest.raises(CaptureError, match="CUDA graphs need a CUDA device") as e:
        zb.compile(model, schedule="1f1b", microbatches=2, loss_fn=loss_fn, example=((x[:1],), (y[:1],)), pp=2,
                   cuda_graphs=True)
    assert isinstance(e.value, ZBCompileError)


def test_inspect_capture_check_prints_each_rank(capsys):
    from zbcompile.inspect import add_arguments, run
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zb-h1",
                              "--capture-check"])
    assert run(args) == 0
    assert capsys.readouterr().out.splitlines() == ["rank 0: capture-safe", "rank 1: capture-safe"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--vocab-parallel"]])
def test_inspect_replay_check_runs_the_steps_and_reports_each_rank(capsys, extra):
    from zbcompile.inspect import add_arguments, run
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
                              "--capture-check", "--replay-check", "3", *extra])
    assert run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["rank 0: capture-safe", "rank 1: capture-safe"]
    for r, line in enumerate(lines[2:]):
        assert re.fullmatch(rf"rank {r}: replay check: steps 2-3 identical \(\d+ static storages, \d+ messages, "
                            r"no escapes\)", line), line
    with pytest.raises(ZBCompileError, match="at least 3 steps"):
        run(parser.parse_args(["zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
                               "--capture-check", "--replay-check", "2"]))


def test_inspect_replay_check_reports_a_rank_whose_step_breaks_replay(capsys, monkeypatch):
    """A receive whose buffer outlives the step (kept by a patched runtime) fails the check on the rank that
    receives, with the reason; the command exits 1."""
    from zbcompile.inspect import add_arguments, run
    from zbcompile.runtime import abi
    kept = []

    def recv_keeping(ctx, peer, tag, slot, what):
        buf = torch.empty_like(ctx.bufs[slot])
        kept.append(buf)
        return abi._post_recv(ctx, buf, peer, tag, what)
    monkeypatch.setattr(abi, "recv_into", recv_keeping)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "1f1b",
                              "--capture-check", "--replay-check", "3"])
    assert run(args) == 1
    out = capsys.readouterr().out
    assert "outlive it" in out and "rank 0: replay check:" in out


def test_a_node_of_symbolic_size_is_reported():
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.ones(4, 8))
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    assert "symbolic" in node_problem(mul)
    fixed = make_fx(lambda x: x * 2)(torch.ones(4, 8))
    assert all(node_problem(n) is None for n in fixed.graph.nodes)


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_capture_ready_programs_train_like_the_reference_when_run_eagerly(name):
    """Untimed waits and accumulating SET_GRADs, run on the loopback world for three steps (the gradients
    accumulate into .grad across them): the same gradients as the single-process model, each on the ranks that
    hold its parameter and nowhere else."""
    model, loss_fn, (x, y), _ = gpt(layers=2, batch=4)
    sched = generate(name, 2, 4)
    staged = split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=sched.num_model_stages)
    ref = copy.deepcopy(model)
    batches = [(x, y), (x.flip(0), y.flip(0)), (x.roll(1, 0), y)]
    for bx, by in batches:
        loss_fn(ref(bx), by).backward()
    _, models, runtimes = run_threaded(model, staged, sched, batches[0], then=batches[1:], capture=True)
    assert all(not rt.ir.wait_timeout for rt in runtimes)
    eager = {n for n, p in ref.named_parameters() if p.grad is not None}
    owned = assert_graded_where_eager_is(eager, param_holders(sched, staged),
                                         [{n for n, p in m.named_parameters() if p.grad is not None} for m in models])
    err, where = max_grad_error(ref, models, owned)
    assert err <= 1e-5, where
