"""Static receive buffers (passes/lower/buffers.py): the alias analysis of stage graphs, and, at run time,
that no buffer is posted into while a tensor sharing its memory is still needed, and that a buffer whose
contents may outlive the step (a gradient that *is* the received tensor) is not reused. Static input
buffers: the batch is staged only where nothing aliasing it outlives the step, and a staged batch is the
one each step computes on."""

from __future__ import annotations

import copy
import enum
import functools
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from support.models import gpt
from support.threaded import max_grad_error, param_holders, run_threaded
from zbcompile.passes.lower import lower_all
from zbcompile.passes.lower.buffers import static_input_buffers
from zbcompile.passes.analysis.aliases import graph_output_aliases, graph_output_owned

from zbcompile.passes.schedules import generate
from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops import Op, OpKind, SetGradArgs
from zbcompile.split import split_model

torch.set_num_threads(1)


def test_aliases_are_read_off_aten_schemas():
    def f(x, w):
        top, _ = torch.max(x, 0)             # multi-output op, fresh results
        a, b = torch.split(x, 2)             # list of views
        return x.view(-1), w.t(), x * 2, x, top, b, x.transpose(0, 1).contiguous(), w.t().t()

    gm = make_fx(f)(torch.randn(4, 3), torch.randn(3, 3))
    assert graph_output_aliases(gm) == (frozenset({0}), frozenset({1}), frozenset(), frozenset({0}), frozenset(),
                                        frozenset({0}), frozenset(), frozenset({1}))
    assert graph_output_owned(gm) == (False, False, True, False, True, False, True, False)


def test_in_place_results_alias_what_they_write_and_unknown_calls_alias_everything():
    def f(x, w):
        y = x.clone()
        y.add_(w)                            # writes y: the result is y's memory, not w's
        z = torch.ops.aten.add_(x, 1.0)      # writes input 0
        s = x * 3
        return y, z, s, s.view(-1)           # s and its view share memory: neither is owned

    gm = make_fx(f)(torch.randn(3), torch.randn(3))
    assert graph_output_aliases(gm) == (frozenset(), frozenset({0}), frozenset(), frozenset())
    assert graph_output_owned(gm) == (True, False, False, False)
    opaque = torch.fx.symbolic_trace(lambda x, w: torch.nn.functional.relu(x) + w)
    assert graph_output_aliases(opaque) == (frozenset({0, 1}),)   # not aten: assume the worst
    assert graph_output_owned(opaque) == (False,)


@functools.lru_cache(maxsize=None)
def _gpt(stages: int):
    model, loss_fn, (x, y), _ = gpt(layers=4, batch=4)
    return model, loss_fn, (x, y), split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=stages)


def _needed_after(program) -> dict[int, set[str]]:
    """op index -> the values some op at or after it still reads (FREE ops aside)."""
    last = {v: i for i, op in enumerate(program.ops) if op.kind is not OpKind.FREE for v in op.ins}
    return {i: {v for v, j in last.items() if j >= i} for i in range(len(program.ops))}


@pytest.mark.parametrize("name,pp", [("1f1b", 2), ("zbv", 2), ("zb-h1", 4), ("dualpipev", 2)])
def test_no_buffer_is_reused_while_its_memory_is_needed(name, pp):
    """Every tensor the program gets (stage-graph outputs, receives) is remembered; whenever a receive is
    posted into a static buffer, no value still to be read may share that buffer's memory."""
    sched = generate(name, pp, 2 * pp)
    model, loss_fn, (x, y), staged = _gpt(sched.num_model_stages)
    x, y = x.repeat(pp, 1)[: 2 * pp], y.repeat(pp, 1)[: 2 * pp]
    programs = lower_all(sched, staged)
    assert all(op.args.slot is not None for p in programs for op in p.of_kind(OpKind.RECV) if "act:" in op.outs[0])
    assert sum(len(p.buffers) for p in programs) < sum(len(p.of_kind(OpKind.RECV)) for p in programs)
    clashes, posts = [], []

    def patch(rank, gm):
        prog = programs[rank]
        needed = _needed_after(prog)
        recv_ops = [i for i, op in enumerate(prog.ops) if op.kind is OpKind.RECV and op.args.slot is not None]
        waits = {op.ins[0]: op.outs[0] for op in prog.ops if op.kind is OpKind.WAIT_RECV}
        runs = [op for op in prog.ops if op.kind is OpKind.RUN]
        made: dict[str, torch.Tensor] = {}
        at = {"recv": 0, "run": 0}
        glb = gm.forward.__globals__
        for gname, fn in list(glb.items()):
            if getattr(fn, "__name__", "") == "recv_into":
                def recv_into(ctx, peer, tag, slot, what, fn=fn):
                    i = recv_ops[at["recv"]]
                    at["recv"] += 1
                    ptr = ctx.bufs[slot].untyped_storage().data_ptr()
                    posts.append(ptr)
                    clashes.extend((rank, str(prog.ops[i]), v) for v, t in made.items()
                                   if v in needed[i] and t.untyped_storage().data_ptr() == ptr)
                    handle = fn(ctx, peer, tag, slot, what)
                    made[waits[prog.ops[i].outs[0]]] = handle[0]
                    return handle
                glb[gname] = recv_into
        for child, mod in list(gm.named_children()):
            def call(args, mod=mod):
                op = runs[at["run"]]
                at["run"] += 1
                outs = mod(args)
                made.update((v, t) for v, t in zip(op.outs, outs) if isinstance(t, torch.Tensor))
                return outs
            # the program looks its stage graphs up as plain attributes and calls their forward
            gm.__dict__[child] = types.SimpleNamespace(forward=call)
        step = gm.forward

        def forward(*args):   # each step starts with nothing made
            made.clear()
            at.update(recv=0, run=0)
            return step(*args)
        gm.forward = forward

    ref = copy.deepcopy(model)
    batches = [(x, y), (x.roll(1, 0), y.roll(1, 0))]
    for bx, by in batches:
        loss_fn(ref(bx), by).backward()
    losses, models, _ = run_threaded(model, staged, sched, batches[0], patch=patch, then=batches[1:])
    assert len(posts) > len(set(posts)) and not clashes, clashes[:5]
    holders = param_holders(sched, staged)
    err, where = max_grad_error(ref, models, [[f for f, rs in holders.items() if r in rs] for r in range(pp)])
    assert err <= 1e-5, where


class _FullBias(torch.nn.Module):
    """tanh(Linear(x)) + b with b of the activation's whole per-microbatch shape: d loss / d b is the incoming
    gradient itself, so the received gradient tensor becomes (part of) the parameter's .grad."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.b = torch.nn.Parameter(torch.randn(1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.b


def test_a_gradient_that_is_the_received_tensor_keeps_its_buffer_until_summed():
    """Rank 0's W returns the received gradient itself as 0.b's gradient; for microbatch 0 that tensor becomes
    the running sum until microbatch 1's gradient is added out of place, so its buffer must stay unused until
    then, though the receive's own last reader is long done."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_FullBias(4), _FullBias(4), torch.nn.Linear(4, 3))
    loss_fn = torch.nn.functional.cross_entropy
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    staged = split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=2)
    sched = generate("1f1b", 2, 4)
    r0, _ = lower_all(sched, staged)
    ops = r0.ops
    first = next(i for i, op in enumerate(ops) if op.kind is OpKind.RECV and ".mb0.grad:" in op.outs[0])
    summed = next(i for i, op in enumerate(ops) if op.kind is OpKind.ACCUM and op.args.mode.value == "add"
                  and any("grad:param:0.b" in v for v in op.ins))
    assert ops[first].args.slot is not None
    assert all(op.args.slot != ops[first].args.slot for op in ops[first + 1: summed] if op.kind is OpKind.RECV)
    # that sum is fresh memory: from microbatch 2 on the W graph adds into it in place
    bws = [op for op in ops if op.kind is OpKind.RUN and op.action.kind.value == "BW"]
    assert [op.args.graph.endswith("_acc") for op in bws] == [False, False, True, True]
    ref = copy.deepcopy(model)
    batches = [(x, y), (-x, y.flip(0)), (x.roll(1, 0), y)]
    for bx, by in batches:
        loss_fn(ref(bx), by).backward()
    _, models, _ = run_threaded(model, staged, sched, batches[0], then=batches[1:])
    holders = param_holders(sched, staged)
    err, where = max_grad_error(ref, models, [[f for f, rs in holders.items() if r in rs] for r in range(2)])
    assert err <= 1e-5, where


def test_the_batch_is_staged_in_static_input_buffers_unless_it_may_outlive_the_step():
    sched = generate("zb-h1", 4, 4)
    model, loss_fn, (x, y), staged = _gpt(4)
    programs = lower_all(sched, staged)
    # ranks 1 and 2 read no data at all; ranks 0 and 3 read the tokens / the targets
    assert all(p.staged_inputs for p in programs)
    assert "batch staged in static input buffers" in programs[0].to_text().splitlines()[0]
    first = programs[0]
    assert not static_input_buffers(first.replace(output="mb1.data:0")).staged_inputs
    # an op kind without a spec is refused, not guessed at
    keep = Op(_Unknown.KEEP, ins=("mb0.data:0",))
    with pytest.raises(LoweringError, match="has no OpSpec"):
        static_input_buffers(first.replace(ops=first.ops + (keep,)))
    # a SET_GRAD that takes ownership keeps its tensor beyond the step
    owned = Op(OpKind.SET_GRAD, ("param:wte.weight", "mb0.data:0"), args=SetGradArgs(True))
    assert not static_input_buffers(first.replace(ops=first.ops + (owned,))).staged_inputs
    assert static_input_buffers(first).staged_inputs


class _Unknown(enum.Enum):
    KEEP = "keep"   # stands for an op kind a later pass adds


@pytest.mark.parametrize("staged_inputs", [True, False])
def test_staged_and_fresh_batches_give_the_eager_gradients(staged_inputs):
    """Three different batches in a row through the same input buffers (or fresh slices of each): the
    gradients summed over the steps match eager, so no step reads a stale or half-overwritten batch."""
    sched = generate("1f1b", 2, 4)
    model, loss_fn, (x, y), staged = _gpt(2)
    batches = [(x, y), (x, y.roll(1, 0)), (x.roll(1, 0), y)]
    ref = copy.deepcopy(model)
    for bx, by in batches:
        loss_fn(ref(bx), by).backward()
    _, models, runtimes = run_threaded(model, staged, sched, batches[0], then=batches[1:],
                                       staged_inputs=staged_inputs)
    assert all((rt._staged is not None) == staged_inputs for rt in runtimes)
    holders = param_holders(sched, staged)
    err, where = max_grad_error(ref, models, [[f for f, rs in holders.items() if r in rs] for r in range(2)])
    assert err <= 1e-5, where
