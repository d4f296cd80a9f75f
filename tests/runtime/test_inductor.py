"""backend="inductor": stage graphs compiled by torch inductor (passes/lower/compiled.py) train like eager.

Every schedule at pp=2 runs threaded on a small GPT (tied embedding, attention, layer norm) against eager
microbatch accumulation; every compiled graph of two programs against its aten graph on the same inputs
(outputs, in-place sums, no aliasing the aten graph does not have); one compilation per distinct graph, and
inductor's FX graph cache across compilations; an unknown backend (zbcompile.compile multi-process:
tests/distributed/test_inductor_dist.py). The threaded cases share one process-wide set of compiled graphs,
so the whole module takes about a minute on 2 cores with a warm inductor cache.

Tolerance 1e-4 relative (eager and pipelined-eager agree to 1e-5 elsewhere in the suite): inductor fuses and
vectorizes reductions (layer norm, softmax, the gradient sums over the batch), which reassociates float32
sums; the differences seen are ~4e-7 relative, the bound leaves room for other shapes and CPUs.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from support.models import convnet, eager_accumulated, gpt
from support.threaded import assert_buffers_match, max_grad_error, param_holders, run_threaded
from zbcompile.compiler import split_for
from zbcompile.errors import UsageError, ZBCompileError
from zbcompile.passes.analysis.aliases import graph_output_aliases
from zbcompile.passes.lower import compiled, emit_fx, lower_all
from zbcompile.passes.schedules import generate
from zbcompile.split import split_model

torch.set_num_threads(1)

TOL = 1e-4
MICROBATCHES = 4
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "interleaved-1f1b", "dualpipev"]


@pytest.fixture(scope="module")
def case():
    """The model, a batch of MICROBATCHES distinct microbatches, eager's loss and gradients, and one split per
    placement (the 2-stage schedules share theirs, and so do the V-shaped ones)."""
    c = gpt(layers=2)
    g = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, 64, (MICROBATCHES * t.shape[0], t.shape[1]), generator=g) for t in c.example)
    ref = copy.deepcopy(c.model)
    loss = eager_accumulated(ref, c.loss_fn, idx, tgt, MICROBATCHES)
    return dict(case=c, batch=(idx, tgt), ref=ref, loss=loss, splits={})


def _staged(case, sched):
    key = (sched.num_model_stages, sched.stage_groups())
    if key not in case["splits"]:
        c = case["case"]
        case["splits"][key] = split_for(c.model, c.loss_fn, c.example, sched)
    return case["splits"][key]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_trains_like_eager(case, schedule):
    sched = generate(schedule, 2, MICROBATCHES)
    staged = _staged(case, sched)
    losses, models, _ = run_threaded(case["case"].model, staged, sched, case["batch"], backend="inductor")
    want = case["loss"]
    assert all(abs(v - want) <= TOL * abs(want) for v in losses), (losses, want)
    holders = param_holders(sched, staged)
    owned = [[f for f, rs in holders.items() if r in rs] for r in range(2)]
    err, where = max_grad_error(case["ref"], models, owned)
    assert err <= TOL, (err, where)


def _graphs(case, schedule: str):
    sched = generate(schedule, 2, MICROBATCHES)
    programs = lower_all(sched, _staged(case, sched), backend="inductor")
    return programs, [(p.rank, k, g) for p in programs for k, g in p.graphs.items()]


def _inputs(g) -> list[torch.Tensor]:
    """Real inputs shaped as the graph was traced: floats in [0, 1) (no log / sqrt of a negative), integers
    0 or 1 (valid token ids and targets)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for node in g.gm.graph.find_nodes(op="placeholder"):
        v = node.meta["val"]
        t = (torch.rand(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point()
             else torch.randint(0, 2, v.shape, generator=gen, dtype=v.dtype))
        out.append(t.as_strided(v.shape, v.stride()) if t.is_contiguous() and v.is_contiguous() else
                   torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).copy_(t))
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (random saved statistics make some gradients
    large, so an elementwise tolerance would measure the inputs, not the compiler)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if not want.is_floating_point():
        return float(not torch.equal(got, want))
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item() if want.numel() else 0.0


def _shares(out: torch.Tensor, ins: list[torch.Tensor]) -> set[int]:
    ptr = out.untyped_storage().data_ptr()
    return {i for i, t in enumerate(ins) if t.untyped_storage().data_ptr() == ptr}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_compiled_graphs_keep_the_aten_graphs_contract(case, schedule):
    """Every compiled graph of both ranks, on the same inputs as its aten graph: equal outputs, the same
    inputs mutated the same way (the accumulating variants' sums, in place: the sum returned IS the `acc:`
    input), and no output sharing memory with an input unless the aten graph's may (aliases.py)."""
    programs, graphs = _graphs(case, schedule)
    assert any(k.endswith("_acc") for _, k, _ in graphs), "no accumulating variant to check"
    for rank, key, g in graphs:
        if g.backend is None:
            assert not any(n.op == "call_function" for n in g.gm.graph.nodes), (rank, key)
            continue
        assert g.boxed and g.backend == "inductor", (rank, key)
        ins_eager, ins_compiled = _inputs(g), _inputs(g)
        want = g.gm(*ins_eager)
        got = compiled.compiled_module(g, key).forward(list(ins_compiled))
        may = graph_output_aliases(g.gm)
        for k, (a, b) in enumerate(zip(want, got)):
            assert _rel(b, a) <= TOL, (rank, key, f"output {k}", _rel(b, a))
            assert _shares(b, ins_compiled) <= may[k], (rank, key, k, _shares(b, ins_compiled), may[k])
        for i, (a, b) in enumerate(zip(ins_eager, ins_compiled)):
            assert _rel(b, a) <= TOL, (rank, key, f"input {i} after the call", _rel(b, a))
        if key.endswith("_acc"):
            for k, name in enumerate(g.outputs):
                if ("acc:" + name) in g.inputs:
                    assert got[k] is ins_compiled[g.inputs.index("acc:" + name)], (rank, key, name, "not in place")


@pytest.mark.slow
def test_the_program_runs_the_accumulating_variants_compiled(case):
    """With several microbatches the W / BW runs after the first call `<graph>_acc`, compiled."""
    programs, _ = _graphs(case, "zb-h1")
    for p in programs:
        runs = [op.args.graph for op in p.run_ops()]
        acc = [k for k in runs if k.endswith("_acc")]
        assert acc, p.rank
        assert all(p.graphs[k].backend == "inductor" for k in acc), p.rank
        assert "boxed inductor" in p.to_text()


@pytest.mark.slow
def test_one_compilation_per_distinct_graph_and_inductors_cache(case, monkeypatch):
    """Emitting both ranks of dualpipev (each model stage on both ranks) compiles each distinct graph once;
    compiling them again in a fresh process-wide memo is served by inductor's FX graph cache."""
    from torch._dynamo.utils import counters

    programs, graphs = _graphs(case, "dualpipev")
    calls = []
    real = compiled._inductor
    monkeypatch.setattr(compiled, "_inductor", lambda gm, vals, where: calls.append(where) or real(gm, vals, where))
    monkeypatch.setattr(compiled, "_COMPILED", {})
    for p in programs:
        emit_fx(p)
    called = {(p.rank, op.args.graph) for p in programs for op in p.run_ops()}   # what the emitter compiles
    keys = {(r, k): compiled._memo_key(g, compiled._input_vals(g, k)) for r, k, g in graphs
            if g.backend and (r, k) in called}
    assert len(calls) == len(set(keys.values())) < len(keys), calls
    hits = counters["inductor"]["fxgraph_cache_hit"]
    monkeypatch.setattr(compiled, "_COMPILED", {})
    emit_fx(programs[0])
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == len({v for (r, _), v in keys.items() if r == 0})


def test_unknown_backend_says_the_choices(case):
    sched = generate("1f1b", 2, MICROBATCHES)
    with pytest.raises(UsageError, match="'inductor'.*or None") as e:
        lower_all(sched, _staged(case, sched), backend="tvm")
    assert isinstance(e.value, ZBCompileError)


def test_accumulating_graphs_compile_cold_where_ci_is_set(monkeypatch):
    """Inductor refuses to fall back on an op torch has a decomposition of (`addmm_`, the fused GEMM gradient
    sum) whenever the environment variable CI is set, which a warm FX graph cache hides: compiled here with CI
    set and the cache off, the accumulating graph decomposes it, equals its aten graph, and still sums into
    its `acc:` inputs in place."""
    import torch._inductor.config as inductor_config
    from torch.fx.experimental.proxy_tensor import make_fx

    from zbcompile.passes.lower.compute import accumulating_graph
    from zbcompile.ir.program import ProgramGraph

    def f(a, b, go, ids):
        return torch.mm(a, b).t(), torch.ops.aten.embedding_dense_backward(go, ids, 6, -1, False)

    args = (torch.randn(3, 5), torch.randn(5, 4), torch.randn(2, 3, 4), torch.tensor([[0, 2, 5], [2, 2, 1]]))
    plain = ProgramGraph(make_fx(f, tracing_mode="fake")(*args), ("a", "b", "go", "ids"),
                         ("grad:param:w", "grad:param:e"))
    acc = dataclasses.replace(accumulating_graph(plain), boxed=True, backend="inductor")
    assert "addmm_.default" in {n.target.__name__ for n in acc.gm.graph.nodes if n.op == "call_function"}
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(compiled, "_COMPILED", {})
    sums = [torch.randn(3, 4).t(), torch.randn(6, 4)]   # laid out as traced: the first is a transpose
    want = [s + o for s, o in zip(sums, f(*args))]
    with inductor_config.patch(fx_graph_cache=False):
        fn = compiled.compiled_module(acc, "hand-made stage0_w_acc").forward
    ins = [*args, *sums]
    got = fn(list(ins))
    for k in range(2):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        assert got[k] is sums[k], f"output {k} is not the acc: input summed in place"


def test_dropout_compiles_and_draws_the_aten_graphs_masks(monkeypatch):
    """A stage graph with dropout (aten.native_dropout, as F carries it; SDPA's dropout becomes aten.rand the
    same way) compiles, with CI set and the cache off as on a fresh machine, and draws its masks from torch's
    generator as the aten graph does: the same seed gives the same outputs and masks."""
    import torch._inductor.config as inductor_config
    from torch.fx.experimental.proxy_tensor import make_fx

    from zbcompile.ir.program import ProgramGraph

    def f(x, w):
        h, mask = torch.ops.aten.native_dropout(torch.mm(x, w), 0.5, True)
        return h * 2.0, mask, torch.rand(x.shape[0]) + x.sum()

    args = (torch.randn(8, 5), torch.randn(5, 16))
    g = ProgramGraph(make_fx(f, tracing_mode="fake")(*args), ("data:0", "param:w"), ("act:h", "act:m", "act:r"))
    g = dataclasses.replace(g, boxed=True, backend="inductor")
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(compiled, "_COMPILED", {})
    with inductor_config.patch(fx_graph_cache=False):
        fn = compiled.compiled_module(g, "hand-made stage0_f").forward
    torch.manual_seed(5)
    want = g.gm(*args)
    torch.manual_seed(5)
    got = fn(list(args))
    assert 0 < int(got[1].sum()) < got[1].numel(), "dropout dropped all or nothing"
    for k, (a, b) in enumerate(zip(want, got)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"output {k}")


def test_a_convolution_nets_graphs_keep_their_traced_layouts():
    """Conv2d + BatchNorm: inductor lays out a convolution's operands channels-last on CPU, and left to itself
    returns the F graph's saved activations and weights in that layout, which the B graph (compiled for the
    traced, contiguous strides) asserts against on its first call. Every compiled graph's outputs keep the
    aten graph's strides, whatever a warm FX graph cache holds from before; a step trains like eager's
    microbatches (loss, gradients, running statistics), in float64 so the comparison is tight."""
    sched = generate("zb-h1", 2, MICROBATCHES)
    model, loss_fn, (x, y), _ = convnet(blocks=4, batch=2 * MICROBATCHES)
    model = model.double()
    x = x.double()
    staged = split_model(model, loss_fn, ((x[:2],), (y[:2],)), num_stages=2)
    programs = lower_all(sched, staged, backend="inductor")
    for p in programs:
        for key, g in p.graphs.items():
            if g.backend:
                got = compiled.compiled_module(g, key).forward(_inputs(g))
                outs = [getattr(n, "meta", {}).get("val") for n in g.gm.graph.find_nodes(op="output")[0].args[0]]
                assert [t.stride() for t, v in zip(got, outs) if isinstance(v, torch.Tensor)] == \
                    [v.stride() for v in outs if isinstance(v, torch.Tensor)], (p.rank, key)
    ref = copy.deepcopy(model)
    want = eager_accumulated(ref, loss_fn, x, y, MICROBATCHES)
    losses, models, _ = run_threaded(model, staged, sched, (x, y), backend="inductor")
    assert all(abs(v - want) <= 1e-10 * abs(want) for v in losses), (losses, want)
    holders = param_holders(sched, staged)
    owned = [[f for f, rs in holders.items() if r in rs] for r in range(2)]
    err, where = max_grad_error(ref, models, owned)
    assert err <= 1e-10, (err, where)
    assert all(assert_buffers_match(ref, models, sched, staged))
