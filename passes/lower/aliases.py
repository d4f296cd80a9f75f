"""Which outputs of a stage graph may share memory with its inputs or with each other.

Stage graphs are aten-level fx graphs (make_fx / the partitioner), so every op carries its schema, and the
schema says which results alias which arguments: `view(Tensor(a) self, ...) -> Tensor(a)`,
`add_(Tensor(a!) self, Tensor other) -> Tensor(a!)`, a result without an annotation is fresh. Each node's
result is described by its *roots*: the placeholders and fresh results whose memory it may use. A node
fx cannot vouch for (not an aten op, a list result of unknown make-up) gets every root of its arguments and
one of its own, which only ever makes an answer more cautious.

    x = placeholder; w = placeholder          roots: {in 0}, {in 1}
    v = aten.view(x, [-1])                    {in 0}
    y = aten.mm(v, w)                         {y}
    return (y, v)                             outputs alias: (), (0,); owned: True, False

Passes use it to know when a buffer can be reused (buffers.py) and when a gradient may be summed into in
place (compute.py).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["graph_output_aliases", "graph_output_owned"]


def graph_output_aliases(gm: fx.GraphModule) -> tuple[frozenset[int], ...]:
    """For each output of `gm`, the positions of the placeholders it may share memory with."""
    return tuple(frozenset(r for r in roots if isinstance(r, int)) for roots in _output_roots(gm))


def graph_output_owned(gm: fx.GraphModule) -> tuple[bool, ...]:
    """For each output of `gm`: True when it is fresh memory that no input and no other output shares, so
    the caller may keep it and write into it."""
    roots = _output_roots(gm)
    owned = []
    for i, mine in enumerate(roots):
        others = frozenset().union(*(r for j, r in enumerate(roots) if j != i))
        owned.append(bool(mine) and not any(isinstance(r, int) for r in mine) and not mine & others)
    return tuple(owned)


def _output_roots(gm: fx.GraphModule) -> tuple[frozenset, ...]:
    cached = gm.meta.get("zb_output_roots")   # every microbatch's op asks about the same few graphs
    if cached is None:
        cached = gm.meta["zb_output_roots"] = _roots(gm)
    return cached


def _roots(gm: fx.GraphModule) -> tuple[frozenset, ...]:
    roots: dict[fx.Node, frozenset] = {}
    k = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            roots[node] = frozenset({k})
            k += 1
        elif node.op == "output":
            out = node.args[0]
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            return tuple(roots.get(o, frozenset()) if isinstance(o, fx.Node) else frozenset() for o in outs)
        elif node.op != "get_attr":
            roots[node] = _node_roots(node, roots)
        else:
            roots[node] = frozenset({node.name})
    return ()


def _node_roots(node: fx.Node, roots: dict[fx.Node, frozenset]) -> frozenset:
    target = node.target
    if node.op == "call_function" and target is operator.getitem and isinstance(node.args[0], fx.Node):
        parent, index = node.args[0], node.args[1]
        if isinstance(parent.target, torch._ops.OpOverload) and isinstance(index, int):
            rets = parent.target._schema.returns
            if index < len(rets) and not _is_list(rets[index]):
                return _schema_roots(parent, [rets[index]], roots, f"{parent.name}[{index}]")
        return roots.get(parent, frozenset())
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        rets = target._schema.returns
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
    schema_args = node.target._schema.arguments
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
