"""Data-parallel gradient reductions placed by the lowering (passes/lower/dp_reduce.py), read off the programs.

Every gradient a rank hands to .grad is averaged over the replicas exactly once; each bucket's all-reduce is
posted before any compute op that follows its gradients' last update (so it overlaps the rest of the step), and
waited only after the rank's last compute op; buckets hold one dtype and respect the size cap; dp_overlap=False
posts them all at the end. A program lowered for dp runs as a single replica with the gradients of the program
without dp, and the memory plan counts the buckets as a run measures them. Across processes, equality with
eager training is tests/distributed/test_data_parallel.py's.
"""

from __future__ import annotations

import pytest
import torch

from support.lowered import DP_CASES, lowered_gpt
from support.models import gpt
from support.threaded import run_threaded
from zbcompile.compiler import split_for
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import OpKind
from zbcompile.ir.program.values import parse
from zbcompile.options import CompileOptions
from zbcompile.passes.analysis.memory import memory_plan
from zbcompile.passes.lower import LOWERING, DataParallel
from zbcompile.passes.schedules import generate

torch.set_num_threads(1)


def _runs(program: RankProgram) -> list[int]:
    return [i for i, op in enumerate(program.ops) if op.kind is OpKind.RUN]


@pytest.mark.parametrize("name,pp", DP_CASES, ids=[f"{n}-pp{p}" for n, p in DP_CASES])
def test_every_gradient_is_averaged_once_where_it_is_final(name, pp):
    plain = lowered_gpt(name, pp, None)
    placed = lowered_gpt(name, pp, DataParallel(bucket_mb=0.01))
    for before, after in zip(plain, placed):
        assert "reduce_over_replicas" in after.passes and "reduce_over_replicas" not in before.passes
        want = sorted(op.ins[0] for op in before.of_kind(OpKind.SET_GRAD))
        set_grads = after.of_kind(OpKind.SET_GRAD)
        # the same parameters get a gradient, each from its averaged value
        assert sorted(op.ins[0] for op in set_grads) == want
        assert all(parse(op.ins[1]).scope == "dp" for op in set_grads)
        defined = {v: i for i, op in enumerate(after.ops) for v in op.outs}
        posts = [(i, op) for i, op in enumerate(after.ops) if op.kind is OpKind.DP_REDUCE]
        reduced = [v for _, op in posts for v in op.ins]
        assert len(reduced) == len(set(reduced)) == len(want), "each gradient in exactly one bucket"
        assert [op.args.bucket for _, op in posts] == list(range(len(posts)))
        runs = _runs(after)
        for i, op in posts:
            # posted before the next compute op after its gradients' last update
            last_update = max(defined[v] for v in op.ins)
            assert not [j for j in runs if last_update < j < i], (after.rank, str(op))
        waits = [i for i, op in enumerate(after.ops) if op.kind is OpKind.WAIT_DP]
        assert len(waits) == len(posts) and min(waits) > runs[-1], "waited only after the last compute op"


def test_a_rank_with_two_stages_posts_the_first_stages_reductions_before_its_last_compute():
    """zbv: each rank's first-finished stage's gradients are reduced while its other stage still computes."""
    for program in lowered_gpt("zbv", 2, DataParallel(bucket_mb=0.01)):
        first_post = min(i for i, op in enumerate(program.ops) if op.kind is OpKind.DP_REDUCE)
        assert first_post < _runs(program)[-1]


def test_buckets_respect_the_cap_and_overlap_false_posts_at_the_end():
    cap = DataParallel(bucket_mb=8192 / 2**20)
    for program in lowered_gpt("zb-h1", 2, cap):
        for op in program.of_kind(OpKind.DP_REDUCE):
            sizes = [_grad_bytes(program, v) for v in op.ins]
            assert len(op.ins) == 1 or sum(sizes) <= cap.bucket_bytes, str(op)
    for program in lowered_gpt("zb-h1", 2, DataParallel(overlap=False)):
        posts = [i for i, op in enumerate(program.ops) if op.kind is OpKind.DP_REDUCE]
        assert posts and min(posts) > _runs(program)[-1]


def _grad_bytes(program: RankProgram, value: str) -> int:
    fqn = parse(value).key
    for g in program.graphs.values():
        for name, t in zip(g.outputs, g.types):
            if t is not None and name.endswith(f"grad:param:{fqn}"):
                return t.nbytes
    raise AssertionError(value)


def test_without_replicas_the_pass_list_is_unchanged():
    assert "reduce_over_replicas" not in [p.__name__ for p in LOWERING]
    assert all("reduce_over_replicas" not in p.passes for p in lowered_gpt("zbv", 2, None))


def test_a_dp_program_prints_and_parses_back():
    program = lowered_gpt("zbv", 2, DataParallel(bucket_mb=0.01))[1]
    text = program.to_text()
    assert "dp_reduce(" in text and "wait_dp(h:dp0)" in text
    assert RankProgram.from_text(text).to_text() == text


@pytest.mark.parametrize("name", ["zbv", "zb-h1"])
def test_a_dp_program_as_one_replica_gives_the_plain_gradients_and_the_planned_memory(name):
    """Run as the only replica, the reductions copy into buckets and hand back views: the gradients are bitwise
    those of the program without dp, and the memory plan's peak is within 10% of the measured one."""
    case = gpt(layers=4, batch=4)
    sched = generate(name, 2, 4)
    staged = split_for(case.model, case.loss_fn, case.example, sched)   # the example: one microbatch
    batch = tuple(torch.cat([t] * 4) for t in case.example)
    _, plain, _ = run_threaded(case.model, staged, sched, batch)
    _, averaged, runtimes = run_threaded(case.model, staged, sched, batch, then=(batch,), replicas=2,
                                         measure="tracker")
    for a, b in zip(plain, averaged):
        ga = {n: p.grad for n, p in a.named_parameters() if p.grad is not None}
        gb = {n: p.grad / 2 for n, p in b.named_parameters() if p.grad is not None}   # two steps accumulated
        assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    options = CompileOptions(schedule=sched, microbatches=4)
    from zbcompile.compiler import compile_staged

    plan = memory_plan(compile_staged(staged, sched, options, replicas=2).programs)
    for r, rt in enumerate(runtimes):
        planned, measured = plan[r].peak_dynamic_bytes, rt.measured.peak
        assert abs(planned - measured) <= 0.10 * measured, (r, planned, measured, plan.table())


def test_buckets_split_by_dtype_and_at_the_cap():
    from zbcompile.ir.program.ops import Op, SetGradArgs, TensorType
    from zbcompile.passes.lower.dp_reduce import _buckets

    types = {"a": TensorType((100,), torch.float32), "b": TensorType((100,), torch.bfloat16),
             "c": TensorType((100,), torch.float32), "d": TensorType((300,), torch.float32)}
    ops = [Op(OpKind.SET_GRAD, (f"param:{n}", f"acc1.grad:param:{n}"), args=SetGradArgs(True)) for n in "abcd"]
    choice = DataParallel(bucket_mb=800 / 2**20)
    got = [[parse(op.ins[0]).key for op in b] for b, _ in _buckets(0, ops, types, choice)]
    assert got == [["a", "c"], ["d"], ["b"]]   # float32 a + c = 800 bytes; d alone exceeds the cap


def test_sharded_buckets_keep_whole_parameters_apart():
    """Sharded, a 0-dim parameter stays whole (all-reduced), every other one is reduce-scattered; they never
    share a bucket, whose collective is one or the other."""
    from zbcompile.ir.program.ops import Op, SetGradArgs, TensorType
    from zbcompile.passes.lower.dp_reduce import _buckets

    types = {"a": TensorType((4, 3), torch.float32), "s": TensorType((), torch.float32),
             "b": TensorType((5,), torch.float32)}
    ops = [Op(OpKind.SET_GRAD, (f"param:{n}", f"acc1.grad:param:{n}"), args=SetGradArgs(True)) for n in "asb"]
    got = [([parse(op.ins[0]).key for op in b], sharded) for b, sharded in _buckets(0, ops, types,
                                                                                    DataParallel(shard=2))]
    assert got == [(["a", "b"], True), (["s"], False)]


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "dualpipev"])
def test_the_trailing_ws_finish_in_groups(name):
    """finish_grads_in_groups: the compute actions before a rank's trailing W's keep their order; the trailing
    W's are split into pieces whose gradients together are the W's (each once); so most gradient bytes are
    reduced while the tail still computes, and what is posted after the last compute op is at most half."""
    plain, placed = lowered_gpt(name, 2, None), lowered_gpt(name, 2, DataParallel(bucket_mb=0))
    for before, after in zip(plain, placed):
        assert after.passes[0] == "finish_grads_in_groups"
        old, new = [str(op.action) for op in before.run_ops()], [str(op.action) for op in after.run_ops()]
        k = len(old)
        while old[k - 1].count("W") and "BW" not in old[k - 1]:
            k -= 1
        assert new[:k] == old[:k] and sorted(set(new[k:])) == sorted(old[k:])
        tail = after.run_ops()[k:]
        originals = {str(op.action): op for op in before.run_ops()[k:]}
        for action, original in originals.items():
            pieces = [op for op in tail if str(op.action) == action]
            if len(original.outs) >= 2:
                assert 2 <= len(pieces) <= 4 and all("_p" in op.args.graph for op in pieces)
            grads = [parse(v).local for op in pieces for v in op.outs if parse(v).local.startswith("grad:param:")]
            assert sorted(grads) == sorted(parse(v).local for v in original.outs) and len(grads) == len(set(grads))
        total = sum(_grad_bytes(after, v) for op in after.of_kind(OpKind.DP_REDUCE) for v in op.ins)
        last_run = max(i for i, op in enumerate(after.ops) if op.kind is OpKind.RUN)
        exposed = sum(_grad_bytes(after, v) for i, op in enumerate(after.ops)
                      if op.kind is OpKind.DP_REDUCE and i > last_run for v in op.ins)
        assert exposed <= 0.5 * total, (after.rank, exposed, total)


def test_pieces_are_cut_into_groups_of_about_equal_bytes():
    from zbcompile.passes.lower.dp_reduce import _groups

    assert _groups([4, 4, 4, 4], 4) == [[0], [1], [2], [3]]
    assert _groups([10, 1, 1, 1, 1, 10], 2) == [[0, 1, 2], [3, 4, 5]]
    assert _groups([1, 1, 100], 3) == [[0], [1], [2]]   # every group gets one
    assert _groups([5, 5], 4) == [[0], [1]]


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_pieces_recompute_nothing(name):
    """The pieces of a split W compute each node of the W once: their call counts add up to the W's, and a
    later piece reads what an earlier one computed as a wsaved: value."""
    count = lambda gm: sum(1 for n in gm.graph.nodes if n.op == "call_function")   # noqa: E731
    split = 0
    for program in lowered_gpt(name, 2, DataParallel()):
        bases = {k.rsplit("_p", 1)[0] for k in program.graphs if "_p" in k and not k.endswith("_acc")}
        split += len(bases)
        for base in bases:
            pieces = [p for k, p in program.graphs.items() if k.startswith(base + "_p") and not k.endswith("_acc")]
            assert sum(count(p.gm) for p in pieces) == count(program.graphs[base].gm), base
    assert split == 2   # each rank's one stage


def test_a_split_graph_computes_what_the_whole_one_does():
    """A toy W graph where one output feeds another group's: the pieces, run in order with the values passed,
    return exactly the whole graph's outputs, and each node is computed once."""
    from torch import fx

    from zbcompile.ir.program import ProgramGraph
    from zbcompile.ir.program.ops import TensorType
    from zbcompile.passes.lower.dp_reduce import _split_graph

    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    t = graph.call_function(torch.mul, (a, b))          # shared by every output
    g0 = graph.call_function(torch.sin, (t,))           # an output that a later output is computed from
    g1 = graph.call_function(torch.add, (g0, b))
    g2 = graph.call_function(torch.exp, (b,))
    graph.output((g2, g0, g1))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    t4 = TensorType((4,), torch.float32)
    whole = ProgramGraph(gm, ("saved:a", "saved:b"), ("grad:param:x", "grad:param:y", "grad:param:z"),
                         types=(t4, t4, t4))
    pieces = _split_graph(whole, 3)
    assert pieces is not None and len(pieces) == 3
    x, y = torch.randn(4), torch.randn(4)
    env = {"saved:a": x, "saved:b": y}
    for piece, ins, outs in pieces:
        env.update(zip(outs, piece.gm(*(env[n] for n in ins))))
    want = gm(x, y)
    assert all(torch.equal(env[n], w) for n, w in zip(whole.outputs, want))
    count = lambda m: sum(1 for n in m.graph.nodes if n.op == "call_function")   # noqa: E731
    assert sum(count(p.gm) for p, _, _ in pieces) == count(gm)


def test_the_lowerings_defaults_are_compiles():
    """passes/ may not import the core, so DataParallel repeats CompileOptions' defaults: they must agree."""
    d = DataParallel()
    assert (d.bucket_mb, d.overlap, d.w_pieces) == (CompileOptions.dp_bucket_mb, CompileOptions.dp_overlap,
                                                    CompileOptions.dp_w_pieces)
