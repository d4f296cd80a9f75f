"""B / W (step 3 of the split): the fused backward cut by dependency analysis into B, what the input grads need,
and W, the rest of the parameter grads' work, reading what it needs of B as wsaved:*."""

from __future__ import annotations

import operator

from torch import fx

from zbcompile.ir.names import Role, role_of
from zbcompile.ir.stages import Graph
from zbcompile.passes.graph_walk import ancestors, not_placeholder
from zbcompile.passes.split_fbw.common import _aten, _identifier

__all__ = ["_split_b_w"]


def _split_b_w(bw: Graph) -> tuple[Graph, Graph]:
    """Cut the fused backward into B (what grad:act:* needs) and W (the remaining param-grad work)."""
    gm = _split_conv_backward(bw.gm)
    graph = gm.graph
    outputs = list(zip(bw.outputs, graph.output_node().args[0]))
    b_roots = [n for name, n in outputs if role_of(name) is not Role.GRAD_PARAM]
    w_roots = [n for name, n in outputs if role_of(name) is Role.GRAD_PARAM]
    b_nodes = _with_fused_siblings(ancestors(b_roots, through=not_placeholder))
    w_nodes = ancestors(w_roots, through=not_placeholder, stop=b_nodes)
    # values W reads from B (or that W returns straight from B)
    w_reads = {i for n in w_nodes for i in n.all_input_nodes if i not in w_nodes}
    w_reads |= {n for n in w_roots if n not in w_nodes}
    placeholders = list(graph.find_nodes(op="placeholder"))
    name_of = dict(zip(placeholders, bw.inputs))
    wsaved = [n for n in graph.nodes if n in w_reads and n.op != "placeholder"]
    w_inputs = [(name_of[n], n) for n in placeholders if n in w_reads] + [(f"wsaved:{n.name}", n) for n in wsaved]
    b_reads = {i for n in b_nodes for i in n.all_input_nodes} | set(b_roots)
    b_inputs = [(name_of[n], n) for n in placeholders if n in b_reads]
    b_outputs = [(name, n) for name, n in outputs if role_of(name) is not Role.GRAD_PARAM]
    b_outputs += [(f"wsaved:{n.name}", n) for n in wsaved]
    w_outputs = [(name, n) for name, n in outputs if role_of(name) is Role.GRAD_PARAM]
    b = _extract(gm, b_nodes, b_inputs, b_outputs, "B")
    w = _extract(gm, w_nodes, w_inputs, w_outputs, "W")
    return b, w


def _with_fused_siblings(nodes: set[fx.Node]) -> set[fx.Node]:
    """Add every getitem of a multi-output node in `nodes`: the fused op's other results are free there."""
    extra = {u for n in nodes for u in n.users if u.target is operator.getitem}
    return nodes | extra


def _split_conv_backward(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` where each convolution_backward computing both dX and dW/db becomes two calls."""
    convs = gm.graph.find_nodes(op="call_function", target=_aten.convolution_backward.default)
    if not any(_needs_split(n) for n in convs):
        return gm
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.target is _aten.convolution_backward.default and _needs_split(node):
            mask = list(node.args[10])
            val = node.meta.get("val")
            args = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
            dx = g.call_function(node.target, tuple(args[:10]) + ([mask[0], False, False],))
            dw = g.call_function(node.target, tuple(args[:10]) + ([False, mask[1], mask[2]],))
            if isinstance(val, (tuple, list)):
                dx.meta["val"] = (val[0], None, None)
                dw.meta["val"] = (None, val[1], val[2])
            env[node] = (dx, dw)
            continue
        if node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            dx, dw = env[node.args[0]]
            src = dx if node.args[1] == 0 else dw
            env[node] = g.call_function(operator.getitem, (src, node.args[1]))
            env[node].meta = dict(node.meta)
            continue
        env[node] = g.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, g, class_name=type(gm).__name__)


def _needs_split(node: fx.Node) -> bool:
    mask = node.args[10] if len(node.args) > 10 else None
    return mask is not None and bool(mask[0]) and (bool(mask[1]) or bool(mask[2]))


def _extract(gm: fx.GraphModule, nodes: set[fx.Node], inputs, outputs, kind: str) -> Graph:
    """A graph computing `outputs` from `inputs` ((value name, node) pairs) with the `nodes` of gm."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name, node in inputs:
        env[node] = g.placeholder(_identifier(name))
        env[node].meta = dict(node.meta)
    for node in gm.graph.nodes:
        if node in nodes and node not in env:
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(tuple(env[n] for _, n in outputs))
    g.eliminate_dead_code()
    g.lint()
    class_name = type(gm).__name__.replace("BW", kind)
    return Graph(fx.GraphModule(gm, g, class_name=class_name), tuple(n for n, _ in inputs),
                 tuple(n for n, _ in outputs))
