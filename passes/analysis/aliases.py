"""Which values of an aten graph may share memory: one analysis for the split, the report and the lowering.

Two levels of answer, for two kinds of question.

Whole-graph, read off the op schemas (the lowering: may a buffer be reused, may a gradient be summed into in
place). Stage graphs are aten-level fx graphs (export / make_fx / the partitioner), so every op carries its
schema, and the schema says which results alias which arguments: `view(Tensor(a) self, ...) -> Tensor(a)`,
`add_(Tensor(a!) self, Tensor other) -> Tensor(a!)`, a result without an annotation is fresh. Each node's
result is described by its *roots*: the placeholders and fresh results whose memory it may use. A node
fx cannot vouch for (not an aten op, a list result of unknown make-up) gets every root of its arguments and
one of its own, which only ever makes an answer more cautious; so does an op whose schema calls its result fresh
although it holds its arguments' memory (`_unsafe_view`, a sparse tensor built on given indices and values).

    x = placeholder; w = placeholder          roots: {in 0}, {in 1}
    v = aten.view(x, [-1])                    {in 0}
    y = aten.mm(v, w)                         {y}
    return (y, v)                             graph_output_aliases: (), (0,)   graph_output_owned: True, False

Per node, by the op alone (the split side, which asks about one node at a time):

    is_view(node)          the op's schema makes its result a view of an argument (aten.view, t, slice, ...)
    view_base(node)        the node its chain of views starts from (the node itself if it is no view)
    may_alias_input(node)  a placeholder or a view (also an element of a viewing split/unbind): such a value
                           cannot be a graph output of aot's joint tracing without a clone
    moves_no_data(node)    a view, a getitem, or an aten op that in practice returns its input's memory
                           (_unsafe_view, alias, lift_fresh, _reshape_alias): the cost model charges nothing

And one question of writes: written_inputs(gm), the placeholder positions an op writes in place, directly or
through a view (`b.mul_(0.9)`, `w[0].zero_()`).

Every function here is pure: it reads the graph and writes nothing into it (nor into `gm.meta`).
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import fx

from zbcompile._torch_private import OpOverload, op_schema

__all__ = ["graph_output_aliases", "graph_output_owned", "node_roots", "written_inputs", "is_view", "view_base",
           "may_alias_input", "moves_no_data"]

# aten ops whose schema calls the result fresh but that return (a view of) their input's memory
_NO_COPY = frozenset({"_unsafe_view", "alias", "lift_fresh", "_reshape_alias"})
# ... and those whose result holds its arguments by reference: a sparse tensor built on the indices and values
# it is given (an nn.Embedding(sparse=True) gradient's values are the received output gradient itself)
_HOLDS_ARGUMENTS = _NO_COPY | frozenset({
    "_sparse_coo_tensor_with_dims_and_tensors", "_sparse_coo_tensor_unsafe", "sparse_coo_tensor",
    "_sparse_compressed_tensor_unsafe", "sparse_compressed_tensor", "_sparse_csr_tensor_unsafe",
    "sparse_csr_tensor", "_sparse_csc_tensor_unsafe", "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe"})


def graph_output_aliases(gm: fx.GraphModule) -> tuple[frozenset[int], ...]:
    """For each output of `gm`, the positions of the placeholders it may share memory with."""
    return tuple(frozenset(r for r in roots if isinstance(r, int)) for roots in _output_roots(gm))


def graph_output_owned(gm: fx.GraphModule) -> tuple[bool, ...]:
    """For each output of `gm`: True when it is fresh memory that no input and no other output shares, so
    the caller may keep it and write into it; False too for an output whose elements overlap (an expand: the
    gradient of a parameter read through p.sum() is its output gradient expanded, and adding into it in place
    raises)."""
    roots = _output_roots(gm)
    overlapping = _outputs_overlap(gm)
    owned = []
    for i, mine in enumerate(roots):
        others = frozenset().union(*(r for j, r in enumerate(roots) if j != i))
        owned.append(bool(mine) and not any(isinstance(r, int) for r in mine) and not mine & others
                     and not overlapping[i])
    return tuple(owned)


def _outputs_overlap(gm: fx.GraphModule) -> tuple[bool, ...]:
    """Per output of `gm`, whether its traced value (meta["val"]) has elements sharing memory: a dimension of
    stride 0 and size over 1. (A value fx did not record counts as not overlapping, as the graph made it.)"""
    vals = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in _outputs(gm)]
    return tuple(isinstance(v, torch.Tensor) and v.layout is torch.strided
                 and any(st == 0 and n > 1 for n, st in zip(v.shape, v.stride())) for v in vals)


# The lowering asks about the same few stage graphs once per microbatch and op (thousands of times), and
# walking a graph is linear in its size: remember each graph's answer for as long as the graph lives. Keyed
# weakly by the GraphModule so the memo neither keeps graphs alive nor writes into them; a graph edited in place
# after a first question would keep its old answer, so passes copy graphs instead (as every zbcompile pass does).
_ROOTS_MEMO: weakref.WeakKeyDictionary[fx.GraphModule, tuple[frozenset, ...]] = weakref.WeakKeyDictionary()


def _output_roots(gm: fx.GraphModule) -> tuple[frozenset, ...]:
    roots = _ROOTS_MEMO.get(gm)
    if roots is None:
        roots = _ROOTS_MEMO[gm] = _roots(gm)
    return roots


def _roots(gm: fx.GraphModule) -> tuple[frozenset, ...]:
    roots = node_roots(gm)
    return tuple(roots.get(o, frozenset()) if isinstance(o, fx.Node) else frozenset() for o in _outputs(gm))


def _outputs(gm: fx.GraphModule) -> tuple:
    """What `gm`'s graph returns, as a tuple (empty without an output node)."""
    out = next(iter(gm.graph.find_nodes(op="output")), None)
    if out is None:
        return ()
    outs = out.args[0]
    return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def node_roots(gm: fx.GraphModule) -> dict[fx.Node, frozenset]:
    """Every node's roots: the placeholder positions (ints) and fresh results (node names, `name[i]` for the
    i-th result of a multi-result op) whose memory it may use. The memory plan reads this to count each
    fresh result once, however many views of it a graph makes."""
    roots: dict[fx.Node, frozenset] = {}
    k = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            roots[node] = frozenset({k})
            k += 1
        elif node.op == "get_attr":
            roots[node] = frozenset({node.name})
        elif node.op != "output":
            roots[node] = _node_roots(node, roots)
    return roots


def written_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """The positions of the placeholders whose memory an op writes in place (a `Tensor(a!)` argument)."""
    roots = node_roots(gm)
    written: set = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, OpOverload):
            for schema_arg, value in _bound_args(node):
                if schema_arg.alias_info is not None and schema_arg.alias_info.is_write:
                    fx.node.map_arg(value, lambda n: written.update(roots.get(n, ())))
    return frozenset(r for r in written if isinstance(r, int))


def _node_roots(node: fx.Node, roots: dict[fx.Node, frozenset]) -> frozenset:
    target = node.target
    if node.op == "call_function" and target is operator.getitem and isinstance(node.args[0], fx.Node):
        parent, index = node.args[0], node.args[1]
        if isinstance(parent.target, OpOverload) and isinstance(index, int):
            rets = op_schema(parent.target).returns
            if index < len(rets) and not _is_list(rets[index]):
                return _schema_roots(parent, [rets[index]], roots, f"{parent.name}[{index}]")
        return roots.get(parent, frozenset())
    if node.op == "call_function" and isinstance(target, OpOverload):
        if target.overloadpacket.__name__ in _HOLDS_ARGUMENTS:   # the schema says fresh; the memory is theirs
            return _all_roots(node, roots) | {node.name}
        rets = op_schema(target).returns
        if rets and not any(map(_is_list, rets)):
            return _schema_roots(node, rets, roots, node.name)
    return _all_roots(node, roots) | {node.name}


def _schema_roots(node: fx.Node, rets, roots: dict[fx.Node, frozenset], fresh: str) -> frozenset:
    """Roots of results `rets` of aten op `node`: a fresh one of its own for an unannotated result, else the
    roots of the arguments that share its alias set (`Tensor(a)` results alias `Tensor(a)` arguments)."""
    sets = [r.alias_info.before_set for r in rets if r.alias_info is not None]
    if not sets:
        return frozenset({fresh})
    wanted = set().union(*sets)
    out: set = set()
    for schema_arg, value in _bound_args(node):
        info = schema_arg.alias_info
        if info is not None and (info.before_set & wanted or not wanted):
            fx.node.map_arg(value, lambda n: out.update(roots.get(n, ())))
    return frozenset(out)


def _bound_args(node: fx.Node):
    schema_args = op_schema(node.target).arguments
    for schema_arg, value in zip(schema_args, node.args):
        yield schema_arg, value
    by_name = {a.name: a for a in schema_args}
    for name, value in node.kwargs.items():
        if name in by_name:
            yield by_name[name], value


def _all_roots(node: fx.Node, roots: dict[fx.Node, frozenset]) -> frozenset:
    return frozenset().union(*(roots.get(n, frozenset()) for n in node.all_input_nodes))


def _is_list(ret) -> bool:
    """A list or optional result: which element aliases what, the schema's annotation does not say."""
    return isinstance(ret.type, (torch.ListType, torch.OptionalType))


# ---------------------------------------------------------------------------------------------------------------
# Per node


def is_view(node: fx.Node) -> bool:
    """True when `node` calls an op whose schema makes its result a view of an argument (aten.view, t, ...)."""
    return isinstance(node.target, OpOverload) and node.target.is_view


def view_base(node: fx.Node) -> fx.Node:
    """The node a chain of views `node = view(view(...(base)))` starts from; `node` itself if it is no view."""
    while is_view(node):
        node = node.args[0]
    return node


def may_alias_input(node: fx.Node) -> bool:
    """True for a placeholder, a view, or an element (getitem) of a viewing op such as split or unbind."""
    if node.op == "placeholder":
        return True
    if node.target is operator.getitem:
        node = node.args[0]
    return is_view(node)


def moves_no_data(node: fx.Node) -> bool:
    """True for a getitem, an aten view, or an aten op in _NO_COPY: nodes that read and write no tensor data."""
    if node.target is operator.getitem:
        return True
    target = node.target
    if not (isinstance(target, OpOverload) and target.namespace == "aten"):
        return False
    return target.is_view or target.overloadpacket.__name__ in _NO_COPY
