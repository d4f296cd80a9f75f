"""box_graphs: every graph of the program in fx's boxed calling convention, calling ops directly.

A finishing pass over the program's graph table (a graph variant is a pass that replaces or adds entries;
nothing else rewrites graphs once they are in a program). It marks each entry boxed: the program calls it
with its inputs in one list that the graph empties on entry (the convention AOTAutograd's compiled backward
uses), so the tensors the program hands over are freed inside the graph at their last use there (see
emit.Emitter.run). The emitter realizes the mark with `boxed_module`, a copy of the graph whose generated
code also calls each aten op's C++ entry point instead of `torch.ops.aten.<op>.<overload>(...)`. It builds
that copy only for the program it emits: every rank lowers every rank's program, but emits only its own, and
generating Python for each graph is the most expensive step of the lowering at large pp.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from zbcompile._torch_private import BoxedCodeGen, op_entry_point
from zbcompile.ir.program import RankProgram

__all__ = ["box_graphs", "boxed_module"]


def box_graphs(program: RankProgram) -> RankProgram:
    return program.replace(graphs={k: dataclasses.replace(g, boxed=True) for k, g in program.graphs.items()})


def boxed_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` that takes its inputs as one list it clears and calls ops through their entry points."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_DirectOpsCodeGen())
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


class _DirectOpsCodeGen(BoxedCodeGen):
    """fx's boxed calling convention, with every dispatcher op called through its C++ entry point.

    fx writes `torch.ops.aten.mm.default(a, b)`: four attribute lookups and OpOverload.__call__, a Python
    frame whose whole body is `return self._op(*args, **kwargs)`. This codegen binds each op's entry point to
    a global and calls that (`aten_mm_default(a, b)`): the same C++ call, about 1 us less per op, a quarter
    of a small op's host time (stage graphs of small models are hundreds of such ops per step). Only text
    fx itself emitted is replaced, on its own line, so the line numbers fx maps errors by stay valid.
    """

    def _gen_python_code(self, nodes, root_module, namespace, **kwargs):
        code = super()._gen_python_code(nodes, root_module, namespace, **kwargs)
        src, bound = code.src, dict(code.globals)
        for target in dict.fromkeys(n.target for n in nodes if n.op == "call_function"):
            entry = op_entry_point(target)
            if entry is None:
                continue
            call = f" = {fx.node._get_qualified_name(target)}("
            if call in src:
                alias = namespace.create_name(f"{target.namespace}_{target._opname}_{target._overloadname}", entry)
                bound[alias] = entry
                src = src.replace(call, f" = {alias}(")
        return dataclasses.replace(code, src=src, globals=bound)
