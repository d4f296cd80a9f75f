"""emit_fx: a RankProgram as an fx GraphModule, straight-line Python the runtime calls once per step.

    def forward(self, ctx, param_l0_weight, ..., mb0_data_0, ...):
        stamps = ctx.t
        h_s1_mb0_grad_act_h = zbcompile_runtime_recv_into(ctx, 1, 3, 0, 's1.mb0.grad:act:h (for 0B0)')
        now = time_perf_counter()
        stamps[0] = now; ...
        stage0_f_in = list([param_l0_weight, mb0_data_0]);  mb0_data_0 = None
        stage0_f = self.stage0_f
        stage0_f_out = stage0_f.forward(stage0_f_in);  stage0_f = stage0_f_in = None
        s0_mb0_act_h = stage0_f_out[0]; ...
        h_send0 = zbcompile_runtime_send(ctx, (1,), (0,), 's0.mb0.act:h', s0_mb0_act_h)
        ...

Stage graphs are submodules (`stage{model_stage}_{f|b|w|bw}[_acc]`) whose forward the program calls directly
(boxed: inputs in one list the graph empties, see _run); P2P, frees and gradient hand-off are calls of the
side-effecting functions in zbcompile.runtime, timing stamps are inline. fx's code generator drops each
variable after its last use: a FREE op whose values a stage graph read last happens inside that graph, the
others are free(...) calls where the IR puts them.
"""

from __future__ import annotations

import dataclasses
import operator
from time import perf_counter

import torch
from torch import fx

from zbcompile.errors import LoweringError
from zbcompile.program import Op, OpKind, RankProgram, python_name
from zbcompile.runtime import PROGRAM_OPS, recv_into

__all__ = ["emit_fx"]

_STAMPS = "<ctx.t>"   # env key of the program's handle on the step's timing slots


def emit_fx(program: RankProgram) -> fx.GraphModule:
    graph = fx.Graph()
    root: dict[str, torch.nn.Module] = {}
    env: dict[str, fx.Node] = {}
    ctx = graph.placeholder("ctx")
    for name in program.inputs:
        env[name] = graph.create_node("placeholder", python_name(name), name=python_name(name))
    used = program.used()
    env[_STAMPS] = _call(graph, getattr, (ctx, "t"), "stamps")
    handed = _handed_over(program)
    gone = {v for vs in handed.values() for v in vs}
    for i, op in enumerate(program.ops):
        if op.kind is OpKind.RUN:
            _run(graph, env, root, op, program, used, handed.get(i, ()))
        elif op.kind is OpKind.FREE:
            _free(graph, env, op, gone)
        else:
            _EMIT[op.kind](graph, env, root, ctx, op, program, used)
    graph.output(env[program.output] if program.output else None)
    graph.lint()
    gm = fx.GraphModule(root, graph, class_name=f"Rank{program.rank}Program")
    for name, stage_gm in root.items():  # after the GraphModule is built
        # `self.stage0_f` in the generated code: a plain instance attribute instead of nn.Module.__getattr__'s
        # search of _modules on every call (the module stays registered in _modules too)
        object.__setattr__(gm, name, stage_gm)
    gm.meta["zb_program"] = program
    return gm


def _call(graph: fx.Graph, fn, args, name: str | None = None) -> fx.Node:
    return graph.create_node("call_function", fn, tuple(args), {}, name=python_name(name) if name else None)


def _handed_over(program: RankProgram) -> dict[int, tuple[str, ...]]:
    """Per RUN op (by index), the values it is the last reader of (FREE ops aside): the program hands those
    to the stage graph and keeps no reference of its own, so the graph frees each at its own last use."""
    last: dict[str, int] = {}
    for i, op in enumerate(program.ops):
        if op.kind is not OpKind.FREE:
            for v in op.ins:
                last[v] = i
    out: dict[int, list[str]] = {}
    for v, i in last.items():
        if program.ops[i].kind is OpKind.RUN and v != program.output:
            out.setdefault(i, []).append(v)
    return {i: tuple(vs) for i, vs in out.items()}


def _run(graph, env, root, op: Op, program: RankProgram, used, handed: tuple[str, ...]) -> None:
    """`self.stage0_b(stage0_b_in)`: the inputs go in one list that the (boxed) stage graph empties on entry.

    `handed` (the values this op is the last reader of) appear in no later node, so fx's code drops the
    program's names for them right after the list is built: the graph's locals then hold the only
    references and fx frees each tensor inside the graph after its last use there. A B graph thus releases
    F's saved tensors as it goes instead of all at once after it returns (lower peak memory), as autograd
    does, and that release counts as the stage's compute time, as it does for autograd.
    """
    from zbcompile.passes.lower.compute import ACCUMULATING, run_graph

    gm = run_graph(program, op)
    name = op.graph + ("_acc" if op.arg == ACCUMULATING else "")
    boxed = root.get(name)
    if boxed is None:
        boxed = root[name] = _boxed(gm)
    elif boxed.meta.get("zb_unboxed") is not gm:
        raise LoweringError(f"rank {program.rank}: two different graphs named {name}")
    args = _call(graph, list, ([env[v] for v in op.ins],), f"{name}_in")
    # `self.stage0_f.forward(...)`, not `self.stage0_f(...)`: nn.Module's call machinery (hooks, fx's
    # error-reporting wrapper) is four Python frames per call, stage graphs carry no hooks, and every frame
    # counts right after a gloo wait, when the caches are cold
    mod = graph.get_attr(name)
    node = graph.create_node("call_method", "forward", (mod, args), {}, name=f"{name}_out")
    for i, v in enumerate(op.outs):
        if v in used:
            env[v] = _call(graph, operator.getitem, (node, i), v)


def _boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of stage graph `gm` that takes its inputs as one list and clears it (fx's boxed calling
    convention, as AOTAutograd's compiled backward uses); `gm` itself keeps its positional signature."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_DirectOpsCodeGen())
    boxed = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    boxed.meta["zb_unboxed"] = gm
    return boxed


class _DirectOpsCodeGen(fx.graph._BoxedCodeGen):
    """fx's boxed calling convention, with every dispatcher op called through its C++ entry point.

    fx writes `torch.ops.aten.mm.default(a, b)`: four attribute lookups and OpOverload.__call__, a Python
    frame whose whole body is `return self._op(*args, **kwargs)`. This codegen binds each op's `_op` to a
    global and calls that (`aten_mm_default(a, b)`): the same C++ call, about 1 us less per op, a quarter
    of a small op's host time (stage graphs of small models are hundreds of such ops per step). Only text
    fx itself emitted is replaced, on its own line, so the line numbers fx maps errors by stay valid.
    """

    def _gen_python_code(self, nodes, root_module, namespace, **kwargs):
        code = super()._gen_python_code(nodes, root_module, namespace, **kwargs)
        src, bound = code.src, dict(code.globals)
        for target in dict.fromkeys(n.target for n in nodes if n.op == "call_function"):
            if not isinstance(target, torch._ops.OpOverload):
                continue
            call = f" = {fx.node._get_qualified_name(target)}("
            if call in src:
                alias = namespace.create_name(f"{target.namespace}_{target._opname}_{target._overloadname}",
                                              target._op)
                bound[alias] = target._op
                src = src.replace(call, f" = {alias}(")
        return dataclasses.replace(code, src=src, globals=bound)


def _recv(graph, env, root, ctx, op, program, used) -> None:
    """recv_into(ctx, peer, tag, slot, what) for a static buffer, recv(ctx, peer, tag, shape, dtype, what)
    for a fresh one."""
    (peer,), (tag,), (spec,) = op.peers, op.tags, op.specs
    what = f"{op.outs[0][2:]} ({op.note})"
    if op.arg is not None:
        env[op.outs[0]] = _call(graph, recv_into, (ctx, peer, tag, op.arg, what), op.outs[0])
    else:
        env[op.outs[0]] = _call(graph, PROGRAM_OPS[OpKind.RECV],
                                (ctx, peer, tag, tuple(spec.shape), spec.dtype, what), op.outs[0])


def _wait_recv(graph, env, root, ctx, op, program, used) -> None:
    env[op.outs[0]] = _call(graph, PROGRAM_OPS[OpKind.WAIT_RECV], (ctx, env[op.ins[0]]), op.outs[0])


def _send(graph, env, root, ctx, op, program, used) -> None:
    what = ", ".join(dict.fromkeys(op.ins))
    env[op.outs[0]] = _call(graph, PROGRAM_OPS[OpKind.SEND],
                            (ctx, op.peers, op.tags, what, *(env[v] for v in op.ins)), op.outs[0])


def _wait_send(graph, env, root, ctx, op, program, used) -> None:
    _call(graph, PROGRAM_OPS[OpKind.WAIT_SEND], (ctx, env[op.ins[0]]))


def _free(graph, env, op, gone: set[str]) -> None:
    """free(...) of what the program still holds; values handed to a stage graph were released in it."""
    kept = [env[v] for v in op.ins if v not in gone]
    if kept:
        _call(graph, PROGRAM_OPS[OpKind.FREE], kept)


def _stamp(graph, env, root, ctx, op, program, used) -> None:
    """`stamps[slot] = perf_counter()` (the runtime's StepContext.t): two C calls, no Python frame."""
    _call(graph, operator.setitem, (env[_STAMPS], op.arg, _call(graph, perf_counter, (), "now")), "stamp")


def _accum(graph, env, root, ctx, op, program, used) -> None:
    """first: the outs are the microbatch gradients themselves; add: one out-of-place foreach sum (fresh
    storage); add_: one in-place foreach sum into the running sums, whose names the outs become."""
    n = len(op.outs)
    grads = [env[v] for v in op.ins[-n:]]
    if op.arg == "first":
        env.update(zip(op.outs, grads))
        return
    sums = [env[v] for v in op.ins[:n]]
    if op.arg == "add":
        node = _call(graph, torch._foreach_add, (sums, grads), f"sum_{op.outs[0]}")
        for i, v in enumerate(op.outs):
            env[v] = _call(graph, operator.getitem, (node, i), v)
    else:
        _call(graph, PROGRAM_OPS[OpKind.ACCUM], (sums, grads))
        env.update(zip(op.outs, sums))


def _sum(graph, env, root, ctx, op, program, used) -> None:
    env[op.outs[0]] = _call(graph, PROGRAM_OPS[OpKind.SUM], tuple(env[v] for v in op.ins), op.outs[0])


def _set_grad(graph, env, root, ctx, op, program, used) -> None:
    _call(graph, PROGRAM_OPS[OpKind.SET_GRAD], (env[op.ins[0]], env[op.ins[1]], bool(op.arg)))


def _add_loss(graph, env, root, ctx, op, program, used) -> None:
    env[op.outs[0]] = _call(graph, PROGRAM_OPS[OpKind.ADD_LOSS], tuple(env[v] for v in op.ins), op.outs[0])


def _copy_buffer(graph, env, root, ctx, op, program, used) -> None:
    _call(graph, PROGRAM_OPS[OpKind.COPY_BUFFER], (env[op.ins[0]], env[op.ins[1]]))


_EMIT = {
    OpKind.RECV: _recv, OpKind.WAIT_RECV: _wait_recv, OpKind.SEND: _send,
    OpKind.WAIT_SEND: _wait_send, OpKind.STAMP: _stamp, OpKind.ACCUM: _accum,
    OpKind.SUM: _sum, OpKind.SET_GRAD: _set_grad, OpKind.ADD_LOSS: _add_loss, OpKind.COPY_BUFFER: _copy_buffer,
}
