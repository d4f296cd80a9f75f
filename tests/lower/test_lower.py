"""Lowering, single process: schedules in, rank-program structure out; then all ranks run as threads.

Models come from tests/support/models.py and are split with zbcompile.split.split_model; schedules from
zbcompile.passes.schedules.generate. The eager model's autograd is the reference for the threaded runs.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import re
import types
import warnings
import functools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from support.models import convnet, gpt, mlp
from support.threaded import assert_buffers_match, max_grad_error, param_holders, run_threaded
from zbcompile.errors import LoweringError
from zbcompile.passes.lower import LOWERING, build_compute, emit_fx, lower_all, validate_programs
from zbcompile.passes.lower.reduce import grad_holders
from zbcompile.passes.schedules import generate
from zbcompile.ir.program.ops import OpKind
from zbcompile.ir.program.values import parse
from zbcompile.ir.schedule import Action, Schedule
from zbcompile.split import split_model

torch.set_num_threads(1)


@functools.lru_cache(maxsize=None)
def _mlp_split(stages: int):
    model, loss_fn, (x, y), _ = mlp(layers=8, batch=4)
    return model, loss_fn, (x, y), split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=stages)


@functools.lru_cache(maxsize=None)
def _gpt_split(stages: int):
    model, loss_fn, (x, y), _ = gpt(layers=4, batch=4)
    return model, loss_fn, (x, y), split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=stages)


def _count(program, kind):
    return sum(len(op.messages(program.rank)) if kind in (OpKind.SEND, OpKind.RECV) else 1
               for op in program.ops if op.kind is kind)


def test_passes_are_named_and_pure():
    assert [p.__name__ for p in LOWERING] == ["insert_p2p", "accumulate_grads", "reduce_shared_grads",
                                             "insert_frees", "insert_stamps", "order_p2p_by_pair"]
    *_, staged = _mlp_split(2)
    sched = generate("1f1b", 2, 4)
    before = tuple(build_compute(sched, staged, r) for r in range(2))
    texts = [p.to_text() for p in before]
    programs = before
    for p in LOWERING:
        programs = p(programs)
    assert [p.to_text() for p in before] == texts  # the input programs are not mutated
    assert all(p.rank == r for r, p in enumerate(programs))


def test_1f1b_p2p_counts_and_tags_match():
    *_, staged = _mlp_split(2)
    sched = generate("1f1b", 2, 4)
    r0, r1 = lower_all(sched, staged)
    assert (_count(r0, OpKind.SEND), _count(r0, OpKind.RECV)) == (4, 4)  # 4 activations out, 4 grads in
    assert (_count(r1, OpKind.SEND), _count(r1, OpKind.RECV)) == (4, 4)
    assert _count(r0, OpKind.WAIT_RECV) == 4 and _count(r0, OpKind.WAIT_SEND) == 4
    sent = {key for op in r0.of_kind(OpKind.SEND) for key in op.messages(0)}
    recv = {key for op in r1.of_kind(OpKind.RECV) for key in op.messages(1)}
    assert sent == recv
    assert len(r0.of_kind(OpKind.STAMP)) == 2 * len(sched.ranks[0])


def test_same_rank_neighbours_need_no_p2p():
    *_, staged = _mlp_split(4)
    sched = generate("zbv", 2, 4)  # rank 1 holds stages 1 and 2: their boundary stays local
    r0, r1 = lower_all(sched, staged)
    assert not any(parse(v.removeprefix("h:")).stage == 1 and "act:" in v
                   for op in r1.of_kind(OpKind.RECV) for v in op.outs)
    # rank 0 -> 1: act of stage 0 and grad of stage 3, per microbatch
    assert _count(r0, OpKind.SEND) == 8 and _count(r1, OpKind.SEND) == 8


@pytest.mark.slow
def test_tied_weights_are_summed_across_ranks_and_accumulated_on_one():
    *_, staged = _gpt_split(2)
    r0, r1 = lower_all(generate("1f1b", 2, 4), staged)
    assert len(r0.of_kind(OpKind.SUM)) == 1 and "wte" in r0.of_kind(OpKind.SUM)[0].outs[0]
    *_, staged4 = _gpt_split(4)
    v0, _ = lower_all(generate("zbv", 2, 4), staged4)  # stages 0 and 3 both on rank 0
    assert not v0.of_kind(OpKind.SUM)
    assert grad_holders(lower_all(generate("zbv", 2, 4), staged4))["wte.weight"] == (0,)


def test_gradients_are_summed_inside_the_stage_graphs():
    """The first microbatch's gradients are fresh tensors (taken as the sums); from the second on, the
    W / BW graph's accumulating variant adds into them: no ACCUM adds, no per-microbatch gradient values."""
    *_, staged = _mlp_split(2)
    for name in ("1f1b", "zb-h1"):
        for prog in lower_all(generate(name, 2, 4), staged):
            grads = [op for op in prog.run_ops() if op.action.kind.value in ("W", "BW")]
            assert [op.args.graph.endswith("_acc") for op in grads] == [False] + [True] * 3, name
            assert [op.args.mode.value for op in prog.of_kind(OpKind.ACCUM)] == ["first"]
            later = [v for op in grads[1:] for v in op.outs if "grad:param:" in v]
            assert later and all(v.startswith("acc") for v in later)
    gm = emit_fx(lower_all(generate("zb-h1", 2, 4), staged)[0])
    assert "self.stage0_w_acc\n" in gm.code and "add_" in gm.stage0_w_acc.code


def test_last_gradient_is_sent_before_the_hand_off_to_grad():
    """The last B of a stage sends its input gradient before setting .grad: the peer waits on that message
    (its own last B), the hand-off is host time only this rank needs."""
    *_, staged = _mlp_split(2)
    for name in ("1f1b", "zb-h1"):
        _, r1 = lower_all(generate(name, 2, 4), staged)
        kinds = [op.kind for op in r1.ops]
        last_send = max(i for i, k in enumerate(kinds) if k is OpKind.SEND)
        first_set = min(i for i, k in enumerate(kinds) if k is OpKind.SET_GRAD)
        assert last_send < first_set, name
        # and nothing but the sends of that RUN (and frees, stamps) sits between it and the hand-off
        run = max(i for i, k in enumerate(kinds[:first_set]) if k is OpKind.RUN)
        assert set(kinds[run + 1:first_set]) <= {OpKind.SEND, OpKind.STAMP, OpKind.FREE}, kinds[run + 1:first_set]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["ZBCOMPILE_GLOO_IO_NICE=abc", "ZBCOMPILE_GLOO_IO_NICE=25",
                                     "ZBCOMPILE_GLOO_IO_BATCH=yes"])
def test_bad_gloo_thread_settings_say_what_is_valid(setting):
    name, value = setting.split("=")
    env = dict(os.environ, **{name: value})
    # read on use, not at import: the whole runtime imports with the bad setting, and its first use refuses it
    code = ("import zbcompile.runtime, zbcompile.runtime.host as h; print('imported', flush=True); "
            "h.tune_io_threads(set())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout == "imported\n", out.stderr[-500:]
    assert out.returncode != 0
    assert f"ZBCompileError: {name}={value!r} is not a valid setting; give " in out.stderr, out.stderr[-500:]


def test_accumulating_graphs_add_exactly_the_gradients():
    """A W / BW graph's accumulating variant, with its fusions (addmm_ for GEMM gradients, index_add_ for the
    embedding's), leaves acc + the gradient the plain graph computes and the same other outputs; fed the
    inputs a real step gave the plain graphs (GPT: embedding, Linear layers, tied head)."""
    from zbcompile.passes.lower.compute import accumulating_graph
    from zbcompile.ir.program import ProgramGraph

    model, loss_fn, (x, y), staged = _gpt_split(2)
    seen: dict = {}

    def patch(rank, gm):
        for child, mod in list(gm.named_children()):
            if child.endswith(("_w", "_bw")) and child not in seen:
                def record(args, mod=mod, child=child):
                    seen.setdefault(child, [a.clone() for a in args])
                    return mod(args)
                gm.__dict__[child] = types.SimpleNamespace(forward=record)

    for name in ("zb-h1", "1f1b"):   # W graphs, then BW graphs
        run_threaded(model, staged, generate(name, 2, 4), (x, y), patch=patch)
    assert len(seen) == 4
    fused = []
    for child, args in seen.items():
        stage = staged.stages[int(child[5])]
        g = getattr(stage, child.split("_")[1])
        plain = g.gm(*args)
        sums = [torch.randn_like(plain[i]) for i, n in enumerate(g.outputs) if n.startswith("grad:param:")]
        acc = accumulating_graph(ProgramGraph(g.gm, g.inputs, g.outputs)).gm
        got = acc(*args, *[t.clone() for t in sums])
        fused += [n.target.__name__ for n in acc.graph.nodes if n.op == "call_function"]
        k = 0
        for i, name in enumerate(g.outputs):
            want = plain[i] + sums[k] if name.startswith("grad:param:") else plain[i]
            k += name.startswith("grad:param:")
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6, msg=f"{child} {name}")
    assert "addmm_.default" in fused and "index_add_.default" in fused
    assert "embedding_dense_backward.default" not in fused


def test_boxed_stage_graphs_call_ops_directly(monkeypatch):
    """The rank program's stage graphs call each op's C++ entry point (OpOverload._op), not
    OpOverload.__call__: same values, no Python frame per op, and code that still reads op by op."""
    from zbcompile.passes.lower.variants import boxed_module

    x, w, b = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    gm = make_fx(lambda x, w, b: (torch.addmm(b, x, w).relu().sum(0, keepdim=True), x.t()))(x, w, b)
    want = gm(x, w, b)
    boxed = boxed_module(gm)
    assert "torch.ops." not in boxed.code and " = aten_addmm_default(b_1, x_1, w_1)" in boxed.code

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{self} went through OpOverload.__call__")

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", refuse)
    args = [x, w, b]
    got = boxed.forward(args)
    assert args == []   # boxed: the graph emptied its input list
    for g, e in zip(got, want):
        assert torch.equal(g, e)
    with pytest.raises(AssertionError, match="OpOverload.__call__"):
        gm(x, w, b)   # the plain graph does use __call__: the check above can fail


def test_accumulating_fusions_on_hand_made_graphs():
    """The fusion cases real stage graphs may not hit: a GEMM gradient under one transpose, a GEMM another
    output also reads (not fused: it must stay), an embedding with a padding row (not fused: the padding row
    gets no gradient)."""
    from zbcompile.passes.lower.compute import accumulating_graph
    from zbcompile.ir.program import ProgramGraph

    def f(a, b, go, ids):
        m = torch.mm(a, b)
        emb = torch.ops.aten.embedding_dense_backward(go, ids, 6, -1, False)
        padded = torch.ops.aten.embedding_dense_backward(go, ids, 6, 2, False)
        return torch.mm(a, b).t(), m, m * 2, emb, padded

    args = (torch.randn(3, 5), torch.randn(5, 4), torch.randn(2, 3, 4), torch.tensor([[0, 2, 5], [2, 2, 1]]))
    names = ("grad:param:t", "grad:param:m", "wsaved:m2", "grad:param:e", "grad:param:p")
    g = ProgramGraph(make_fx(f)(*args), ("a", "b", "go", "ids"), names)
    acc = accumulating_graph(g).gm
    called = [n.target.__name__ for n in acc.graph.nodes if n.op == "call_function"]
    assert called.count("addmm_.default") == 1 and called.count("index_add_.default") == 1
    assert called.count("embedding_dense_backward.default") == 1   # the padded one stays
    plain = g.gm(*args)
    sums = [torch.randn_like(plain[i]) for i in (0, 1, 3, 4)]
    got = acc(*args, *[t.clone() for t in sums])
    for i, want in zip(range(5), (plain[0] + sums[0], plain[1] + sums[1], plain[2], plain[3] + sums[2],
                                  plain[4] + sums[3])):
        torch.testing.assert_close(got[i], want, msg=names[i])


def test_frees_come_right_after_last_use():
    *_, staged = _mlp_split(4)
    for prog in lower_all(generate("zb-h1", 4, 8), staged):
        freed = {}
        for i, op in enumerate(prog.ops):
            if op.kind is OpKind.FREE:
                for v in op.ins:
                    assert v not in freed, f"{v} freed twice"
                    freed[v] = i
                    assert not any(v in later.ins for later in prog.ops[i + 1:])
        saved = {v for op in prog.run_ops() for v in op.outs if ".saved:" in v or ".wsaved:" in v}
        used = {v for op in prog.ops for v in op.ins}
        assert saved & used <= set(freed)
        # a B frees what its W does not need
        for i, op in enumerate(prog.ops):
            if op.kind is OpKind.RUN and op.action.kind.value == "W":
                assert all(parse(v).microbatch == op.action.microbatch for v in op.ins if parse(v).scope == "stage")


def test_frees_really_release_memory():
    """Run rank 0 of 1f1b; at every stage-graph call, every tensor the IR has freed before it is gone (the
    program's own free() calls and the values it hands to a boxed stage graph as that graph's last reader),
    and when a stage graph returns, the inputs it was the last reader of are already gone (freed inside it)."""
    model, loss_fn, (x, y), staged = _mlp_split(2)
    sched = generate("1f1b", 2, 4)
    prog = lower_all(sched, staged)[0]
    runs = [i for i, op in enumerate(prog.ops) if op.kind is OpKind.RUN]
    freed_by = [{v for op in prog.ops[:i] if op.kind is OpKind.FREE for v in op.ins} for i in runs]
    last = {v: i for i, op in enumerate(prog.ops) if op.kind is not OpKind.FREE for v in op.ins}
    last_reader = [{v for v in prog.ops[i].ins if last[v] == i} for i in runs]
    waits = [op.outs[0] for op in prog.ops if op.kind is OpKind.WAIT_RECV]
    made: dict[str, weakref.ref] = {}   # value name -> the tensor the program got for it (stage outputs, receives)
    sent: set[int] = set()
    pooled: set[int] = set()
    checked, alive = [], []

    def check(k: int, gone: set[str], keep=()) -> None:
        live = {id(r()) for v, r in made.items() if v not in gone and r() is not None} | {id(t) for t in keep}
        for v in gone & set(made):
            t = made[v]()
            checked.append(v)
            # a sent tensor lives on in its send handle until wait_send; a view (a microbatch slice of the
            # user's batch, a transposed parameter) shares storage the program does not own; a tensor that is
            # also a still-live value (an F graph saving its input as is) is that value's memory; a static
            # receive buffer stays with the runtime (test_static_buffers checks that it is reused only when free)
            if t is not None and t._base is None and id(t) not in sent and id(t) not in live | pooled:
                alive.append((str(prog.ops[runs[k]].action), v))

    def patch(rank, gm):
        if rank != 0:
            return
        glb = gm.forward.__globals__
        send_name = next(k for k, v in glb.items() if getattr(v, "__name__", "") == "send")
        wait_name = next(k for k, v in glb.items() if getattr(v, "__name__", "") == "wait_recv")
        real_send, real_wait, calls = glb[send_name], glb[wait_name], {"run": 0, "wait": 0}
        for name, fn in list(glb.items()):
            if getattr(fn, "__name__", "") == "recv_into":
                def recv_into(ctx, *a, fn=fn):
                    pooled.update(id(b) for b in ctx.bufs)
                    return fn(ctx, *a)
                glb[name] = recv_into

        def send(ctx, peers, tags, what, *tensors):
            sent.update(id(t) for t in tensors)
            return real_send(ctx, peers, tags, what, *tensors)

        def wait_recv(ctx, handle):
            t = real_wait(ctx, handle)
            made[waits[calls["wait"]]] = weakref.ref(t)
            calls["wait"] += 1
            return t
        glb[send_name], glb[wait_name] = send, wait_recv

        for child, mod in list(gm.named_children()):
            class Check(torch.nn.Module):
                def __init__(self, inner):
                    super().__init__()
                    self.inner = inner

                def forward(self, args):
                    k = calls["run"]
                    calls["run"] += 1
                    check(k, freed_by[k])
                    outs = self.inner(args)
                    assert not args, "a stage graph left its input list uncleared"
                    check(k, freed_by[k] | last_reader[k], outs)
                    made.update((v, weakref.ref(t)) for v, t in zip(prog.ops[runs[k]].outs, outs)
                                if isinstance(t, torch.Tensor))
                    return outs
            setattr(gm, child, Check(mod))

    run_threaded(model, staged, sched, (x, y), patch=patch)
    assert len(checked) > 10 and not alive, alive


def test_dce_keeps_side_effecting_ops():
    *_, staged = _mlp_split(2)
    gm = emit_fx(lower_all(generate("1f1b", 2, 4), staged)[0])
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    assert len(gm.graph.nodes) == before
    code = gm.code
    for word in ("zbcompile_runtime_abi_recv", "zbcompile_runtime_abi_wait_recv", "zbcompile_runtime_abi_send",
                 "zbcompile_runtime_abi_free", "zbcompile_runtime_abi_set_grad", "self.stage0_f"):
        assert word in code


def test_validation_reports_unmatched_and_mismatched_p2p():
    *_, staged = _mlp_split(2)
    r0, r1 = lower_all(generate("1f1b", 2, 4), staged)
    no_send = r0.replace(ops=tuple(op for op in r0.ops if op.kind not in (OpKind.SEND, OpKind.WAIT_SEND)))
    with pytest.raises(LoweringError, match="never sends it"):
        validate_programs([no_send, r1])
    i = next(i for i, op in enumerate(r1.ops) if op.kind is OpKind.RECV)
    bad = r1.ops[i]
    t = bad.args.type
    wrong = bad._replace(args=bad.args._replace(type=t._replace(shape=(*t.shape, 2))))
    r1_bad = r1.replace(ops=r1.ops[:i] + (wrong,) + r1.ops[i + 1:])
    with pytest.raises(LoweringError, match="receives"):
        validate_programs([r0, r1_bad])


def test_validation_reports_deadlock_with_picture():
    *_, staged = _mlp_split(2)
    good = generate("1f1b", 2, 2)
    # rank 0 runs BW0 before F1, rank 1 needs F1 before its BW0: each waits on the other
    order = {0: ["0F0", "0BW0", "0F1", "0BW1"], 1: ["1F0", "1F1", "1BW0", "1BW1"]}
    rows = tuple(tuple(Action.parse(a) for a in order[r]) for r in range(2))
    bad = Schedule(good.name, good.num_microbatches, good.placement, rows)
    with pytest.raises(LoweringError, match="deadlock") as info:
        lower_all(bad, staged)
    assert ">>" in str(info.value)


@pytest.mark.parametrize("name,pp", [("1f1b", 2), ("zbv", 2), ("dualpipe", 2), ("interleaved-1f1b", 2),
                                     ("zb-h2", 4), ("dualpipev", 4)])
def test_threaded_step_matches_eager(name, pp):
    sched = generate(name, pp, 2 * pp)
    model, loss_fn, (x, y), staged = _gpt_split(sched.num_model_stages)
    x, y = x.repeat(pp, 1)[: 2 * pp], y.repeat(pp, 1)[: 2 * pp]
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(x), y)
    loss.backward()
    losses, models, runtimes = run_threaded(model, staged, sched, (x, y))
    assert all(abs(v - loss.item()) <= 1e-5 * loss.item() for v in losses)
    holders = param_holders(sched, staged)
    owned = [[f for f, rs in holders.items() if r in rs] for r in range(pp)]
    err, where = max_grad_error(ref, models, owned)
    assert err <= 1e-5, where
    timings = runtimes[0].last_step
    assert len(timings.bubble) == pp and all(0 <= b < 1 for b in timings.bubble)
    trace = timings.chrome_trace()
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == sum(len(r) for r in sched.ranks)


@pytest.mark.parametrize("name,pp", [("1f1b", 2), ("zbv", 2), ("dualpipev", 2), ("zb-h2", 4)])
def test_threaded_step_updates_buffers_as_eager_microbatches(name, pp):
    """BatchNorm running statistics after a step equal eager training over the same microbatches in order
    (each F copies its stage's buffer updates into the rank's real buffers before the next microbatch's F)."""
    sched = generate(name, pp, 2 * pp)
    model, loss_fn, (x, y), _ = convnet(blocks=2 * sched.num_model_stages, batch=2 * pp)
    staged = split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=sched.num_model_stages)
    ref = copy.deepcopy(model)
    for xm, ym in zip(x.chunk(2 * pp), y.chunk(2 * pp)):
        loss_fn(ref(xm), ym).backward()
    _, models, _ = run_threaded(model, staged, sched, (x, y))
    for r, mine in enumerate(assert_buffers_match(ref, models, sched, staged)):
        assert mine
        for n, buf in models[r].named_buffers():
            if n not in mine:
                assert torch.equal(buf, dict(model.named_buffers())[n]), f"rank {r} changed {n}, not its own"


def test_dualpipe_warns_that_mirrored_copies_update_buffers_apart():
    """DualPipe's two copies of a stage each see half of the microbatches: their BatchNorm statistics drift
    apart from eager training (gradients do not); compiling says so, and only where it happens."""
    from zbcompile import ZBCompileWarning
    from zbcompile.compiler import _warn_mirrored_buffer_updates

    sched = generate("dualpipe", 2, 4)
    model, loss_fn, (x, y), _ = convnet(blocks=4, batch=4)
    staged = split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=sched.num_model_stages)
    with pytest.warns(ZBCompileWarning, match=r"model stage 0 on ranks \[0, 1\].*features\.0\.bn\.running_mean"):
        _warn_mirrored_buffer_updates(staged, sched)
    # the warning is true: the mirrored copies' statistics are not eager's
    ref = copy.deepcopy(model)
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        loss_fn(ref(xm), ym).backward()
    _, models, _ = run_threaded(model, staged, sched, (x, y))
    name = "features.0.bn.running_mean"
    assert not torch.allclose(dict(models[0].named_buffers())[name], dict(ref.named_buffers())[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zbv = generate("zbv", 2, 4)   # no mirrored stages
        _warn_mirrored_buffer_updates(split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=4), zbv)
        _warn_mirrored_buffer_updates(_gpt_split(2)[3], generate("dualpipe", 2, 4))   # no buffers


class _Stalled:
    """A Work whose wait fails (raises `error`) or times out (returns False, as some backends do)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self, timeout) -> bool:
        if self.error is not None:
            raise self.error
        return False


class _Posting:
    """A process group stand-in whose posts return `work`, or raise."""

    def __init__(self, work=None) -> None:
        self.work = work

    def send(self, tensors, peer, tag):
        return self.work

    def recv(self, tensors, peer, tag):
        if self.work is None:
            raise RuntimeError("connection reset")
        return self.work


@pytest.mark.parametrize("error", [RuntimeError("peer closed"), None])
def test_failed_waits_name_the_op_and_the_peer(error):
    from zbcompile.errors import RuntimeFailure
    from zbcompile.ir.program.ops import TensorType
    from zbcompile.runtime.abi import StepContext, recv_into, send, wait_recv, wait_send

    pg = _Posting(_Stalled(error))
    ctx = StepContext(pg, 1, torch.device("cpu"), 2.0, 4, ranks=3, buffers=(TensorType((2,), torch.float32),))
    want = "failed (peer dead or stalled?): peer closed" if error else "did not finish within 2.0 s"
    h = recv_into(ctx, 0, 7, 0, "s0.mb3.act:h")
    with pytest.raises(RuntimeFailure, match=r"rank 1: receiving s0\.mb3\.act:h from rank 0 " + re.escape(want)):
        wait_recv(ctx, h)
    h = send(ctx, (2,), (9,), "s1.mb3.act:h", torch.zeros(2))
    with pytest.raises(RuntimeFailure, match=r"rank 1: sending s1\.mb3\.act:h to ranks \[2\] " + re.escape(want)):
        wait_send(ctx, h)
    ctx.recv_pg = [_Posting(None)] * 3
    with pytest.raises(RuntimeFailure, match="rank 1: posting the receive of x from rank 0 failed: connection reset"):
        recv_into(ctx, 0, 7, 0, "x")


class _ReadBackEMA(nn.Module):
    """An EMA of the activations updated in forward (by reassignment) and added back to them."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.a, self.head = nn.Linear(5, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.register_buffer("avg", torch.zeros(d))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        self.avg = 0.9 * self.avg + 0.1 * h.detach().mean(dim=(0, 1))
        return self.head(torch.tanh(self.a(h + self.avg)))


def test_dualpipe_refuses_a_buffer_the_forward_reads_back():
    """An EMA read back in forward, on DualPipe's mirrored stage: each copy saw half of the step's updates, so
    the loss (0.92692 against eager's 0.92666) and the gradients (12%) were off, under a warning that said they
    were not affected (fuzzing, probe 24). Refused now, naming the buffer; 1f1b (no mirrored copy) takes it."""
    from zbcompile.compiler import compile_staged
    from zbcompile.errors import UsageError
    from zbcompile.options import CompileOptions

    torch.manual_seed(0)
    model = _ReadBackEMA().double()
    x, y = torch.randn(2, 4, 5, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    staged = split_model(model, F.mse_loss, ((x,), (y,)), split_points=["a"])
    with pytest.raises(UsageError, match=r"model stage 0 on ranks \[0, 1\].*buffer\(s\) avg .*dualpipev"):
        compile_staged(staged, generate("dualpipe", 2, 4), CompileOptions(schedule="dualpipe", microbatches=4))
    compile_staged(staged, generate("1f1b", 2, 4), CompileOptions(schedule="1f1b", microbatches=4))   # no copies


def test_a_rank_holding_no_parameter_is_warned_of_at_compile():
    """Cuts between a model's few layers can leave a rank only parameter-free ops; there the usual
    `AdamW(pipe.parameters())` raised torch's "empty parameter list" with nothing said before. compile warns,
    naming the rank; a split giving every rank a layer warns nothing."""
    from zbcompile.compiler import compile_programs
    from zbcompile.errors import ZBCompileWarning
    from zbcompile.options import CompileOptions

    def compiled(split_points):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Softsign())
        opts = CompileOptions.from_kwargs(None, schedule="1f1b", microbatches=4, loss_fn=F.mse_loss,
                                          example=(torch.randn(2, 8), torch.randn(2, 8)), split_points=split_points)
        return compile_programs(model, opts, 2)

    with pytest.warns(ZBCompileWarning, match=r"rank\(s\) \[1\] hold no parameter .*empty parameter list"):
        compiled(["3"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZBCompileWarning)
        compiled(["2"])


# ---- gradient accumulation corner cases (mutation testing found them untested) ---------------------------------
class _Aliased(nn.Module):
    """h = l0(x) + p + q, with p and q shaped as h: both gradients are the very tensor received for h."""

    def __init__(self, rows: int, d: int = 4):
        super().__init__()
        self.l0 = nn.Linear(d, d)
        self.p, self.q = nn.Parameter(torch.randn(rows, d)), nn.Parameter(torch.randn(rows, d))
        self.l1 = nn.Sequential(nn.Tanh(), nn.Linear(d, d))

    def forward(self, x):
        return self.l1(self.l0(x) + self.p + self.q)


class _SharedThrice(nn.Module):
    """One Linear called in each of three stages: three ranks hold a copy of its gradient."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.l0, self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        for layer in (self.l0, self.l1, self.l2):
            x = self.shared(torch.tanh(layer(x)))
        return x


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _steps_against_eager(model, schedule: str, pp: int, m: int, split_points, steps: int) -> None:
    """`steps` pipelined steps without zero_grad (float64, ranks as threads), then every rank's every .grad
    against eager's microbatch accumulation over the same batches, at 1e-10."""
    from support.threaded import loopback_pipes, run_pipes
    from zbcompile.options import CompileOptions

    rows, d = 2, 4
    x, y = torch.randn(rows, d, dtype=torch.float64), torch.randn(rows, d, dtype=torch.float64)
    options = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=m, loss_fn=_mse,
                                         example=((x,), (y,)), split_points=split_points)
    ref = copy.deepcopy(model)
    pipes = loopback_pipes(model, options, pp)
    batches = [(torch.randn(rows * m, d, dtype=torch.float64), torch.randn(rows * m, d, dtype=torch.float64))
               for _ in range(steps)]

    def run(r):
        for xb, yb in batches:
            pipes[r].step(xb, yb)
        return {n: p.grad.clone() for n, p in pipes[r].named_parameters()}

    got = run_pipes(run, pp)
    for xb, yb in batches:
        for xm, ym in zip(xb.chunk(m), yb.chunk(m)):
            (_mse(ref(xm), ym) / m).backward()
    held = {n for grads in got for n in grads}
    assert held == {n for n, _ in ref.named_parameters()}, held
    for r, grads in enumerate(got):
        for n, g in grads.items():
            want = ref.get_parameter(n).grad
            assert (g - want).abs().max() <= 1e-10 * want.abs().max(), (schedule, m, r, n)


@pytest.mark.parametrize("schedule,m", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 3)])
def test_gradients_that_are_the_received_gradient_accumulate_over_steps_as_eager(schedule, m):
    """Two parameters whose gradient is the activation gradient the stage received (one tensor, three names):
    the first step's .grad must be a copy of its own (not the received buffer, reused by the next step), and
    summing two microbatches must not add into a tensor another parameter's sum shares. Three steps without
    zero_grad, every gradient against eager's."""
    torch.manual_seed(0)
    _steps_against_eager(_Aliased(2).double(), schedule, 2, m, ("l1",), steps=3)


def test_a_parameter_used_on_three_ranks_sums_every_copy():
    """A Linear called in three stages on three ranks: its gradient is the sum of three ranks' copies (every
    holder gets the same bits), not of the first two."""
    torch.manual_seed(0)
    _steps_against_eager(_SharedThrice().double(), "1f1b", 3, 3, ("l1", "l2"), steps=1)
