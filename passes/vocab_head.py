"""A split pass before the vocabulary pass: the vocabulary head written otherwise, as the one linear op it is.

    Traced -> Traced

passes/shard_vocab.py finds the output layer as `linear(x, param:W[, param:b])`. Models also write it as

    h @ W.T          (matmul with the transposed parameter: a head tied to the embedding table, `h @ E.T`)
    linear(h, W) + b, h @ W.T + b, b + ...   (the bias parameter added after the product)

which compute the same logits. This pass rewrites such a head, in a copy of the traced step, into that one
linear op, keeping the node's name (the model's outputs name it); anything else is left as it is, for
find_vocab_layers to refuse naming what it found.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from zbcompile.ir.stages import Graph, Traced
from zbcompile.passes.shard_vocab import _CHECKS, _chain_end, _placeholder_name

__all__ = ["linear_head"]

_aten = torch.ops.aten
_TRANSPOSES = (_aten.t.default, _aten.permute.default, _aten.transpose.int)
_CAST = _aten._to_copy.default


def linear_head(traced: Traced) -> Traced:
    """`traced` with its vocabulary head as the one `linear(x, W[, b])` op the pattern names, where the model wrote
    it otherwise: as a matmul with the transposed parameter (`h @ W.T`, a head tied to the embedding table) or
    with the bias parameter added after (`F.linear(h, W) + b`, `h @ W.T + b`). The same logits, computed by the
    op the shards replace; the node keeps its name (the model's outputs name it). The metadata checks export adds
    for a cast written on the weight (`W.to(h.dtype)`: `_assert_tensor_metadata`) go too: the shards replace
    what they check. Unchanged where there is nothing to rewrite (find_vocab_layers then says what it found)."""
    loss = traced.graph.output_nodes().get("loss")
    if loss is None or loss.target is not _aten.cross_entropy_loss.default or not isinstance(loss.args[0], fx.Node):
        return traced
    end = _chain_end(loss.args[0])
    if end.target not in (_aten.matmul.default, _aten.add.Tensor, _aten.linear.default):
        return traced
    graph = fx.Graph()
    graph.output(graph.graph_copy(traced.gm.graph, env := {}))
    gm = fx.GraphModule(traced.gm, graph)
    g = dataclasses.replace(traced.graph, gm=gm)
    head = env[end]
    dropped = [] if head.target is _aten.linear.default else _fold_linear(g, head)
    if head.target is not _aten.linear.default:
        return traced
    checks = list(dict.fromkeys(_checks_of(_head_inputs(head) + dropped)))
    if not dropped and not checks:
        return traced
    for node in checks:
        graph.erase_node(node)
    for node in dropped:   # only these: a dead random op elsewhere must still draw, as in eager
        if not node.users:
            graph.erase_node(node)
    gm.recompile()
    return dataclasses.replace(traced, graph=g)


def _head_inputs(linear: fx.Node) -> list[fx.Node]:
    """The linear's weight and bias, and the parameters they cast."""
    args = [a for a in linear.args[1:] if isinstance(a, fx.Node)]
    return args + [a.args[0] for a in args if a.target is _CAST and isinstance(a.args[0], fx.Node)]


def _checks_of(nodes) -> list[fx.Node]:
    """The metadata checks reading `nodes`."""
    return [u for n in nodes for u in n.users if u.target in _CHECKS]


def _fold_linear(g: Graph, node: fx.Node) -> list[fx.Node]:
    """Make `node` (a matmul, or an add of a bias to one) the linear op it computes, in place; returns the nodes
    it no longer reads (the transpose, the bias-less product), in the order to erase them; [] where it is not one."""
    if node.target is _aten.matmul.default:
        weight = _transposed_param(g, node)
        if weight is None:
            return []
        dropped = _untransposed(node.args[1])
        node.target, node.args, node.kwargs = _aten.linear.default, (node.args[0], weight), {}
        return dropped
    if node.kwargs or len(node.args) != 2:   # add(z, b, alpha=...)
        return []
    for z, b in (node.args, node.args[::-1]):
        if not (isinstance(z, fx.Node) and len(_readers(z)) == 1 and _is_bias(g, b, z, node)):
            continue
        if z.target is _aten.linear.default and len(z.args) == 2 and not z.kwargs:
            node.target, node.args = _aten.linear.default, (z.args[0], z.args[1], b)
            return [z]
        weight = _transposed_param(g, z) if z.target is _aten.matmul.default else None
        if weight is not None:
            node.target, node.args = _aten.linear.default, (z.args[0], weight, b)
            return [z, *_untransposed(z.args[1])]
    return []


def _readers(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target not in _CHECKS]


def _transposed_param(g: Graph, matmul: fx.Node) -> fx.Node | None:
    """W, or autocast's cast of W, where `matmul` is `matmul(x, W.T)` (autocast: `matmul(x, cast(W.T))`) for a
    [V, d] parameter W whose transpose nothing else reads."""
    cast, t = None, matmul.args[1]
    if isinstance(t, fx.Node) and t.target is _CAST and set(t.kwargs) <= {"dtype"} and len(_readers(t)) == 1:
        cast, t = t, t.args[0]
    if not (isinstance(t, fx.Node) and t.target in _TRANSPOSES and len(_readers(t)) == 1):
        return None
    w = t.args[0]
    if _placeholder_name(g, w) is None or w.meta["val"].dim() != 2:
        return None
    if t.target is _aten.transpose.int:
        swapped = {int(d) % 2 for d in t.args[1:3]} == {0, 1}
    else:
        swapped = t.target is _aten.t.default or [int(d) % 2 for d in t.args[1]] == [1, 0]
    return (w if cast is None else cast) if swapped else None


def _untransposed(arg: fx.Node) -> list[fx.Node]:
    """The transpose `arg` is, or casts (matmul's second argument), now dead: a cast is made to cast W itself,
    as autocast casts linear's weight, and the transpose it read is returned to erase."""
    if arg.target is not _CAST:
        return [arg]
    t = arg.args[0]
    arg.args = (t.args[0],)
    arg.meta = {**arg.meta, "val": arg.meta["val"].t().contiguous()}
    return [t]


def _is_bias(g: Graph, b, z: fx.Node, add: fx.Node) -> bool:
    """`b` is a [V] parameter added to the logits `z`, all in one dtype (so linear's bias gives the same sum)."""
    if _placeholder_name(g, b) is None:
        return False
    val, out = b.meta["val"], add.meta["val"]
    return val.dim() == 1 and int(val.shape[0]) == int(out.shape[-1]) and val.dtype == out.dtype == z.meta["val"].dtype
