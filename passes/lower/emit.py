"""emit_fx: a RankProgram as an fx GraphModule, straight-line Python the runtime calls once per step.

    def forward(self, ctx, param_l0_weight, ..., mb0_data_0, ...):
        stamps = ctx.t
        h_s1_mb0_grad_act_h = zbcompile_runtime_abi_recv_into(ctx, 1, 3, 0, 's1.mb0.grad:act:h (for 0B0)')
        now = time_perf_counter()
        stamps[0] = now; ...
        stage0_f_in = list([param_l0_weight, mb0_data_0]);  mb0_data_0 = None
        stage0_f = self.stage0_f
        stage0_f_out = stage0_f.forward(stage0_f_in);  stage0_f = stage0_f_in = None
        s0_mb0_act_h = stage0_f_out[0]; ...
        h_send0 = zbcompile_runtime_abi_send(ctx, (1,), (0,), 's0.mb0.act:h', s0_mb0_act_h)
        ...

The program's graphs are submodules named by their keys, whose forward the program calls directly (boxed
graphs: inputs in one list the graph empties, see Emitter.run; a graph marked with a backend is that
compiler's code for it, passes/lower/compiled.py). Every other op is emitted by the Emitter
method its spec names (zbcompile.ir.program.ops), calling the runtime ABI functions the spec lists, looked up
by name in the ABI module (`abi`, zbcompile.runtime.abi by default): the compiler does not import the
runtime. fx's code generator drops each variable after its last use: a FREE op whose values a stage graph
read last happens inside that graph, the others are free(...) calls where the IR puts them.
"""

from __future__ import annotations

import importlib
import operator
from time import perf_counter
from types import ModuleType

import torch
from torch import fx

from zbcompile.errors import LoweringError
from zbcompile.passes.lower.compiled import compiled_module
from zbcompile.passes.lower.variants import boxed_module
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import AccumMode, Op, OpKind, spec
from zbcompile.ir.program.values import python_name

__all__ = ["emit_fx", "Emitter", "DEFAULT_ABI"]

DEFAULT_ABI = "zbcompile.runtime.abi"


def emit_fx(program: RankProgram, abi: ModuleType | str = DEFAULT_ABI, *, profile: bool = False) -> fx.GraphModule:
    """The GraphModule whose forward(ctx, *program.inputs) runs `program` once. profile: each action (`zb:2F0`),
    send (`zb:send`) and wait for a message (`zb:wait_recv`, `zb:wait_send`) inside a torch.profiler range, so
    that a profiler trace shows the schedule (the runtime runs this variant while a profiler records)."""
    return Emitter(program, importlib.import_module(abi) if isinstance(abi, str) else abi, profile=profile).emit()


_ENTER = torch.ops.profiler._record_function_enter_new.default
_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


class Emitter:
    """Builds one program's fx graph, op by op; one method per `OpSpec.emit` name."""

    def __init__(self, program: RankProgram, abi: ModuleType, profile: bool = False):
        self.program = program
        self.profile = profile
        self.abi = abi
        self.graph = fx.Graph()
        self.root: dict[str, torch.nn.Module] = {}
        self.env: dict[str, fx.Node] = {}
        self.used = program.used()
        self.handed = _handed_over(program)
        self.gone = {v for vs in self.handed.values() for v in vs}

    def emit(self) -> fx.GraphModule:
        graph, program = self.graph, self.program
        self.ctx = graph.placeholder("ctx")
        for name in program.inputs:
            self.env[name] = graph.create_node("placeholder", python_name(name), name=python_name(name))
        self.stamps = self.call(getattr, (self.ctx, "t"), "stamps")
        for i, op in enumerate(program.ops):
            method = getattr(self, spec(op.kind).emit, None)
            if method is None:
                raise LoweringError(f"op kind {op.kind} names emitter method {spec(op.kind).emit!r}, which "
                                    f"passes.lower.emit.Emitter does not have")
            label = _RANGES.get(op.kind)
            if label is None:
                method(i, op)
            else:
                self.ranged(label(op), lambda: method(i, op))
        graph.output(self.env[program.output] if program.output else None)
        graph.lint()
        gm = fx.GraphModule(self.root, graph, class_name=f"Rank{program.rank}Program")
        for name, stage_gm in self.root.items():  # after the GraphModule is built
            # `self.stage0_f` in the generated code: a plain instance attribute instead of nn.Module.__getattr__'s
            # search of _modules on every call (the module stays registered in _modules too)
            object.__setattr__(gm, name, stage_gm)
        return gm

    # ---- helpers ---------------------------------------------------------------------------------
    def call(self, fn, args, name: str | None = None) -> fx.Node:
        return self.graph.create_node("call_function", fn, tuple(args), {},
                                      name=python_name(name) if name else None)

    def fn(self, op: Op, k: int = 0):
        """The k-th runtime ABI function of op's spec."""
        name = spec(op.kind).runtime[k]
        found = getattr(self.abi, name, None)
        if found is None:
            raise LoweringError(f"op kind {op.kind} calls runtime function {name!r}, which the ABI module "
                                f"{self.abi.__name__} does not define")
        return found

    @property
    def untimed(self) -> tuple:
        """The waits' extra argument: () for the default timed wait, (False,) for a program without timeouts."""
        return () if self.program.wait_timeout else (False,)

    def values(self, names) -> list[fx.Node]:
        return [self.env[v] for v in names]

    def ranged(self, name: str, emit) -> None:
        """emit() inside a profiler range `name` where profiling (emit_fx's profile), else just emit()."""
        if not self.profile:
            emit()
            return
        handle = self.call(_ENTER, (name, None), "range")
        emit()
        self.call(_EXIT, (handle,))

    # ---- one method per spec.emit ------------------------------------------------------------------
    def run(self, i: int, op: Op) -> None:
        """`self.stage0_b.forward(stage0_b_in)`: a boxed graph gets its inputs in one list it empties on entry.

        The values this op is the last reader of appear in no later node, so fx's code drops the program's
        names for them right after the list is built: the graph's locals then hold the only references and fx
        frees each tensor inside the graph after its last use there. A B graph thus releases F's saved tensors
        as it goes instead of all at once after it returns (lower peak memory), as autograd does, and that
        release counts as the stage's compute time, as it does for autograd.
        """
        key = op.args.graph
        g = self.program.graph(op)
        if key not in self.root:
            if g.gm is None:
                raise LoweringError(f"rank {self.program.rank}: graph {key!r} has no GraphModule (a program read "
                                    f"from text without graphs cannot be emitted)")
            self.root[key] = (compiled_module(g, f"rank {self.program.rank}, graph {key}") if g.backend
                              else boxed_module(g.gm) if g.boxed else g.gm)
        # `.forward(...)`, not `(...)`: nn.Module's call machinery (hooks, fx's error-reporting wrapper) is
        # four Python frames per call, stage graphs carry no hooks, and every frame counts right after a gloo
        # wait, when the caches are cold
        if g.boxed:
            args = (self.call(list, (self.values(op.ins),), f"{key}_in"),)
        else:
            args = tuple(self.values(op.ins))
        mod = self.graph.get_attr(key)
        node = self.graph.create_node("call_method", "forward", (mod, *args), {}, name=f"{key}_out")
        for k, v in enumerate(op.outs):
            if v in self.used:
                self.env[v] = self.call(operator.getitem, (node, k), v)

    def recv(self, i: int, op: Op) -> None:
        """recv_into(ctx, peer, tag, slot, what) for a static buffer, recv(ctx, peer, tag, shape, dtype, what)
        for a fresh one."""
        a = op.args
        what = f"{op.outs[0][2:]} ({op.note})"
        if a.slot is not None:
            self.env[op.outs[0]] = self.call(self.fn(op, 1), (self.ctx, a.peer, a.tag, a.slot, what), op.outs[0])
        else:
            self.env[op.outs[0]] = self.call(self.fn(op, 0), (self.ctx, a.peer, a.tag, tuple(a.type.shape),
                                                              a.type.dtype, what), op.outs[0])

    def wait_recv(self, i: int, op: Op) -> None:
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, self.env[op.ins[0]], *self.untimed), op.outs[0])

    def send(self, i: int, op: Op) -> None:
        what = ", ".join(dict.fromkeys(op.ins))
        peers = tuple(m.peer for m in op.args.messages)
        tags = tuple(m.tag for m in op.args.messages)
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, peers, tags, what, *self.values(op.ins)),
                                         op.outs[0])

    def wait_send(self, i: int, op: Op) -> None:
        self.call(self.fn(op), (self.ctx, self.env[op.ins[0]], *self.untimed))

    def collective(self, i: int, op: Op) -> None:
        """collective(ctx, op, root, shape, dtype, what, *tensors): a handle for wait_coll."""
        a = op.args
        what = f"{op.ins[0] if op.ins else op.note} (collective {a.seq})"
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, a.op.value, a.root, tuple(a.type.shape),
                                                       a.type.dtype, what, *self.values(op.ins)), op.outs[0])

    def wait_coll(self, i: int, op: Op) -> None:
        node = self.call(self.fn(op), (self.ctx, self.env[op.ins[0]], *self.untimed),
                         op.outs[0] if op.outs else None)
        if op.outs:
            self.env[op.outs[0]] = node

    def dp_reduce(self, i: int, op: Op) -> None:
        """dp_reduce(ctx, bucket, scatter, what, *grads): the bucket copied and its all-reduce (scatter: its
        reduce-scatter) posted; a handle."""
        what = f"bucket {op.args.bucket} ({op.note})"
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, op.args.bucket, bool(op.args.scatter), what,
                                                       *self.values(op.ins)), op.outs[0])

    def dp_gather(self, i: int, op: Op) -> None:
        """dp_gather(ctx, bucket, what, *shards): the shards copied into one flat tensor and its all-gather
        posted; a handle."""
        what = f"parameter bucket {op.args.bucket} ({op.note})"
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, op.args.bucket, what, *self.values(op.ins)),
                                         op.outs[0])

    def wait_gather(self, i: int, op: Op) -> None:
        """wait_gather(ctx, handle): the whole parameters, each a tensor of its own."""
        node = self.call(self.fn(op), (self.ctx, self.env[op.ins[0]], *self.untimed), f"{op.ins[0]}_whole")
        for k, v in enumerate(op.outs):
            if v in self.used:
                self.env[v] = self.call(operator.getitem, (node, k), v)

    def wait_dp(self, i: int, op: Op) -> None:
        """wait_dp(ctx, handle): the averaged gradients, one view of the bucket each."""
        node = self.call(self.fn(op), (self.ctx, self.env[op.ins[0]], *self.untimed), f"{op.ins[0]}_avg")
        for k, v in enumerate(op.outs):
            if v in self.used:
                self.env[v] = self.call(operator.getitem, (node, k), v)

    def offload(self, i: int, op: Op) -> None:
        """offload(ctx, slot, *tensors): the copy of their storage into host slot `slot`; a handle that holds
        the tensors until wait_offload (the program itself frees their names right after, as after a send)."""
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, op.args.slot, *self.values(op.ins)), op.outs[0])

    def wait_offload(self, i: int, op: Op) -> None:
        self.call(self.fn(op), (self.ctx, self.env[op.ins[0]]))

    def reload(self, i: int, op: Op) -> None:
        """reload(ctx, slot): a fresh device storage of the slot's size, being filled; a handle."""
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, op.args.slot), op.outs[0])

    def wait_reload(self, i: int, op: Op) -> None:
        """wait_reload(ctx, handle, views): a tuple of views of the reloaded storage, one per output."""
        views = tuple((tuple(v.type.shape), tuple(v.type.stride), v.offset, v.type.dtype) for v in op.args.views)
        node = self.call(self.fn(op), (self.ctx, self.env[op.ins[0]], views), f"{op.ins[0]}_views")
        for k, v in enumerate(op.outs):
            if v in self.used:
                self.env[v] = self.call(operator.getitem, (node, k), v)

    def free(self, i: int, op: Op) -> None:
        """free(...) of what the program still holds; values handed to a stage graph were released in it."""
        kept = [self.env[v] for v in op.ins if v not in self.gone]
        if kept:
            self.call(self.fn(op), kept)

    def stamp(self, i: int, op: Op) -> None:
        """`stamps[slot] = perf_counter()` (the runtime's StepContext.t): two C calls, no Python frame. With
        event_timing, the runtime's stamp_event(ctx, slot): a device event a captured graph replays."""
        if self.program.event_timing:
            self.call(self.fn(op), (self.ctx, op.args.slot))
            return
        self.call(operator.setitem, (self.stamps, op.args.slot, self.call(perf_counter, (), "now")), "stamp")

    def accum(self, i: int, op: Op) -> None:
        """FIRST: the outs are the microbatch gradients themselves; ADD: one out-of-place foreach sum (fresh
        storage); ADD_: one in-place foreach sum into the running sums, whose names the outs become."""
        n = len(op.outs)
        grads = self.values(op.ins[-n:])
        mode = op.args.mode
        if mode is AccumMode.FIRST:
            self.env.update(zip(op.outs, grads))
            return
        sums = self.values(op.ins[:n])
        if mode is AccumMode.ADD:
            node = self.call(torch._foreach_add, (sums, grads), f"sum_{op.outs[0]}")
            for k, v in enumerate(op.outs):
                self.env[v] = self.call(operator.getitem, (node, k), v)
        else:
            self.call(self.fn(op), (sums, grads))
            self.env.update(zip(op.outs, sums))

    def set_grad(self, i: int, op: Op) -> None:
        self.call(self.fn(op), (*self.values(op.ins), op.args.owned))

    def prefix(self, i: int, op: Op) -> None:
        """prefix(ctx, up, loss): this rank's prefix of the post-validation values (up / loss None where the
        op reads none: rank 0 has no upstream, a rank without the loss stage no loss)."""
        from zbcompile.ir.program.ops.step_boundary import UP

        up = self.env[UP] if UP in op.ins else None
        loss = next((self.env[v] for v in op.ins if v != UP), None)
        self.env[op.outs[0]] = self.call(self.fn(op), (self.ctx, up, loss), op.outs[0])

    def boundary_call(self, i: int, op: Op) -> None:
        """The runtime function on the step context and the op's inputs; its result, if any, is outs[0]."""
        node = self.call(self.fn(op), (self.ctx, *self.values(op.ins)), op.outs[0] if op.outs else None)
        if op.outs:
            self.env[op.outs[0]] = node

    def validate(self, i: int, op: Op) -> None:
        """validate(ctx, drains, totals): raises the runtime's Redo where the step must run again."""
        drains = tuple((m.peer, m.tag, tuple(m.type.shape), m.type.dtype) for m in op.args.drains)
        self.call(self.fn(op), (self.ctx, drains, *self.values(op.ins)))

    def call_op(self, i: int, op: Op) -> None:
        """The runtime function on the op's inputs; its result, if the op defines one, is outs[0]."""
        node = self.call(self.fn(op), self.values(op.ins), op.outs[0] if op.outs else None)
        if op.outs:
            self.env[op.outs[0]] = node


# the profiler range of each op kind that gets one (emit_fx's profile)
_RANGES = {
    OpKind.RUN: lambda op: f"zb:{op.args.action}",
    OpKind.SEND: lambda op: "zb:send",
    OpKind.WAIT_RECV: lambda op: "zb:wait_recv",
    OpKind.WAIT_SEND: lambda op: "zb:wait_send",
    OpKind.WAIT_COLL: lambda op: "zb:wait_collective",
    OpKind.WAIT_DP: lambda op: "zb:wait_dp",
    OpKind.WAIT_GATHER: lambda op: "zb:wait_gather",
}


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
