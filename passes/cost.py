"""Cost model: FLOPs and bytes of each fx node, estimated from the shapes in `meta["val"]`.

Inputs are graphs traced by torch.export + `run_decompositions({})` or by aot autograd, so they hold high-level
aten ops (linear, SDPA, layer_norm, convolution, embedding) and their backward ops. Every node we cost must
carry `meta["val"]`: a FakeTensor, or a tuple/list of them, whose dims may be SymInts.

    node_cost(node)   -> NodeCost(flops, bytes_read, bytes_written)
    graph_cost(gm)    -> GraphCost(flops, bytes, by_op={"aten.mm": NodeCost, ...})
    value_bytes(node) -> logical size of the node's output (sum over a tuple's tensors)

Counting rules (a multiply-add is 2 FLOPs):

    mm, bmm, matmul, mv, dot, linear    2 * numel(out) * K                 (+ numel(out) for linear's bias)
    addmm, baddbmm, _addmm_activation   2 * numel(out) * K + numel(out)
    convolution                         2 * numel(out) * prod(w.shape[1:])  (numel(input) when transposed; + bias)
    convolution_backward                the forward count once per requested grad_input / grad_weight in
                                        output_mask, + numel(grad_out) for grad_bias
    SDPA forward (every aten variant)   Q K^T and P V: 2 * rows * S * (E + Ev),  rows = B * H * L
    SDPA backward                       5 matmuls (QK^T recomputed, dP, dV, dQ, dK): 2 * rows * S * (3E + 2Ev),
                                        the FlashAttention-2 / torch.utils.flop_counter convention; masks and
                                        is_causal are ignored (dense count)
    layer/batch/group/rms norm          a few FLOPs per element (_PER_ELEMENT_FWD); backward per requested output
    softmax fwd / bwd                   a few FLOPs per element
    embedding                           0 FLOPs; reads only the gathered rows and the indices
    embedding_dense_backward            numel(grad_output) (the scatter-add)
    pointwise ops (torch.Tag.pointwise) numel(out);  reductions (torch.Tag.reduction): numel(input)
    views, getitem, placeholders        zero everything (no data moves); so do nodes that make no tensor
    anything else                       FALLBACK: numel of all tensor outputs, generic bytes

Bytes: `bytes_read` sums the logical sizes of the distinct input nodes, `bytes_written` is `value_bytes(node)`.
These are traffic estimates for ranking and balancing, not measurements.

Symbolic shapes: a SymInt dim becomes its sympy expression, so costs are `int` in the common case and a
`sympy.Expr` otherwise. `evaluate(x, {"s0": 4})` / `cost.subs(...)` substitute sizes by symbol name;
`size_hints(gm)` gives the example sizes the graph was traced with.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Mapping, Union

import sympy
import tabulate
import torch
from torch import fx

from zbcompile._format import format_bytes, format_flops
from zbcompile._torch_private import OpOverload, op_schema, tree_leaves
from zbcompile.errors import ZBCompileError
from zbcompile.passes.analysis.aliases import moves_no_data

__all__ = [
    "NodeCost",
    "GraphCost",
    "node_cost",
    "graph_cost",
    "value_bytes",
    "evaluate",
    "size_hints",
    "format_flops",
    "format_bytes",
    "format_cost",
    "format_cost_table",
]

Num = Union[int, sympy.Expr]
"""A count: a plain int when every dim is concrete, a sympy expression in the graph's size symbols otherwise."""


@dataclass(frozen=True)
class NodeCost:
    """Estimated work of one node: FLOPs, bytes read from its inputs, bytes written to its outputs."""

    flops: Num = 0
    bytes_read: Num = 0
    bytes_written: Num = 0

    @property
    def bytes(self) -> Num:
        return self.bytes_read + self.bytes_written

    def __add__(self, other: NodeCost) -> NodeCost:
        return NodeCost(*(_concrete(getattr(self, f.name) + getattr(other, f.name)) for f in fields(self)))

    def subs(self, values: Mapping[str | sympy.Symbol, int]) -> NodeCost:
        """The same cost with every size symbol replaced by its value; all fields become ints."""
        return NodeCost(*(evaluate(getattr(self, f.name), values) for f in fields(self)))


@dataclass(frozen=True)
class GraphCost:
    """Totals over a graph and the per-op breakdown (op name -> summed NodeCost), largest FLOPs first."""

    flops: Num
    bytes: Num
    by_op: Mapping[str, NodeCost]

    def subs(self, values: Mapping[str | sympy.Symbol, int]) -> GraphCost:
        """The same cost with every size symbol replaced by its value."""
        by_op = {op: cost.subs(values) for op, cost in self.by_op.items()}
        return GraphCost(evaluate(self.flops, values), evaluate(self.bytes, values), _sorted(by_op))


# ---------------------------------------------------------------------------------------------------------------
# Shapes and sizes


def _concrete(x: Num) -> Num:
    """sympy Integers back to int, so concrete costs stay plain ints."""
    if isinstance(x, sympy.Basic) and x.is_Integer:
        return int(x)
    return x


def _dim(d) -> Num:
    if isinstance(d, torch.SymInt):
        return _concrete(d.node.expr)
    return int(d)


def _prod(xs: Iterable[Num]) -> Num:
    out: Num = 1
    for x in xs:
        out = out * x
    return _concrete(out)


def _shape(t: torch.Tensor) -> tuple[Num, ...]:
    return tuple(_dim(d) for d in t.shape)


def _numel(t: torch.Tensor) -> Num:
    return _prod(_shape(t))


def _nbytes(t: torch.Tensor) -> Num:
    return _concrete(_numel(t) * t.dtype.itemsize)


def _tensors(val) -> list[torch.Tensor]:
    return [x for x in tree_leaves(val) if isinstance(x, torch.Tensor)]


def _val(node: fx.Node):
    if "val" not in node.meta:
        raise ZBCompileError(
            f"node {node.name!r} ({node.target}) has no meta['val']; the cost model reads shapes from it. "
            "Trace with torch.export / aot autograd, or run torch.fx.passes.fake_tensor_prop.FakeTensorProp first."
        )
    return node.meta["val"]


def value_bytes(node: fx.Node) -> Num:
    """Logical size in bytes of the node's output (summed over a tuple's tensors; non-tensors count 0).

    A view reports its own size although it shares storage with its base.
    """
    return _concrete(sum((_nbytes(t) for t in _tensors(_val(node))), 0))


def _aten_name(node: fx.Node) -> str | None:
    """'mm' for aten.mm.default; None for other namespaces and non-op targets."""
    t = node.target
    if isinstance(t, OpOverload) and t.namespace == "aten":
        return t.overloadpacket.__name__
    return None


def _arg(node: fx.Node, name: str, default=None):
    """The value of the schema argument `name`, an fx.Node being replaced by its meta["val"]."""
    for i, a in enumerate(op_schema(node.target).arguments):
        if a.name == name:
            v = node.kwargs[name] if name in node.kwargs else node.args[i] if i < len(node.args) else default
            return v.meta.get("val") if isinstance(v, fx.Node) else v
    return default


def _in(node: fx.Node, i: int) -> torch.Tensor:
    """The i-th positional argument's FakeTensor."""
    return _val(node.args[i])


def _out(node: fx.Node) -> torch.Tensor:
    return _tensors(_val(node))[0]


def _mask(node: fx.Node, n: int) -> list[bool]:
    mask = _arg(node, "output_mask")
    return [True] * n if mask is None else [bool(m) for m in mask]


# ---------------------------------------------------------------------------------------------------------------
# FLOP formulas, one per op family; each takes the node and returns FLOPs


def _matmul(node: fx.Node, lhs: int = 0, add: bool = False) -> Num:
    a, out = _shape(_in(node, lhs)), _out(node)
    k = a[-1]
    return _concrete(2 * _numel(out) * k + (_numel(out) if add else 0))


def _linear(node: fx.Node) -> Num:
    return _matmul(node, add=_arg(node, "bias") is not None)


def _conv_core(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> Num:
    # a transposed conv scatters each input element into Cout/groups * kernel outputs
    return _concrete(2 * _numel(x if transposed else out) * _prod(_shape(w)[1:]))


def _conv(node: fx.Node) -> Num:
    transposed = "transpose" in _aten_name(node) or bool(_arg(node, "transposed", False))
    out = _out(node)
    bias = _numel(out) if _arg(node, "bias") is not None else 0
    return _concrete(_conv_core(_in(node, 0), _in(node, 1), out, transposed) + bias)


def _conv_backward(node: fx.Node) -> Num:
    grad_out, x, w = _in(node, 0), _in(node, 1), _in(node, 2)
    core = _conv_core(x, w, grad_out, bool(_arg(node, "transposed")))
    dx, dw, db = _mask(node, 3)
    return _concrete(core * (int(dx) + int(dw)) + (_numel(grad_out) if db else 0))


# SDPA variants: packet name -> (index of query, layout is (B, L, H, E) rather than (B, H, L, E), is backward)
_ATTENTION = {
    "scaled_dot_product_attention": (0, False, False),
    "_scaled_dot_product_attention_math": (0, False, False),
    "_scaled_dot_product_attention_math_for_mps": (0, False, False),
    "_scaled_dot_product_flash_attention": (0, False, False),
    "_scaled_dot_product_flash_attention_for_cpu": (0, False, False),
    "_scaled_dot_product_efficient_attention": (0, False, False),
    "_scaled_dot_product_cudnn_attention": (0, False, False),
    "_scaled_dot_product_fused_attention_overrideable": (0, False, False),
    "_flash_attention_forward": (0, True, False),
    "_efficient_attention_forward": (0, True, False),
    "_scaled_dot_product_flash_attention_backward": (1, False, True),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (1, False, True),
    "_scaled_dot_product_efficient_attention_backward": (1, False, True),
    "_scaled_dot_product_cudnn_attention_backward": (1, False, True),
    "_scaled_dot_product_fused_attention_overrideable_backward": (1, False, True),
    "_flash_attention_backward": (1, True, True),
    "_efficient_attention_backward": (1, True, True),
}


def _kv_length(node: fx.Node, k: tuple[Num, ...], seq_first: bool) -> Num:
    if not seq_first:
        return k[-2]  # (..., H, S, E)
    if len(k) == 4:
        return k[-3]  # (B, S, H, E)
    # varlen packing (total_k, H, E): every query sees at most max_k keys
    max_k = _arg(node, "max_k", _arg(node, "max_seqlen_k"))
    return k[0] if max_k is None else _dim(max_k)


def _attention(node: fx.Node) -> Num:
    qi, seq_first, backward = _ATTENTION[_aten_name(node)]
    q, k, v = (_shape(_in(node, qi + j)) for j in range(3))
    e, ev = q[-1], v[-1]
    rows = _prod(q[:-1])  # B * H * L in either layout
    s = _kv_length(node, k, seq_first)
    per_dim = 3 * e + 2 * ev if backward else e + ev
    return _concrete(2 * rows * s * per_dim)


# FLOPs per element of the (grad) input; backward: per requested output (grad_input, grad_weight, grad_bias)
_PER_ELEMENT_FWD = {
    "layer_norm": 5, "native_layer_norm": 5,
    "batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
    "_native_batch_norm_legit_functional": 5, "_native_batch_norm_legit_no_training": 5,
    "group_norm": 5, "native_group_norm": 5, "instance_norm": 5,
    "rms_norm": 4, "_fused_rms_norm": 4,
    "_softmax": 5, "_log_softmax": 5, "softmax": 5, "log_softmax": 5,
}
_PER_ELEMENT_BWD = {
    "native_layer_norm_backward": (6, 2, 1),
    "native_batch_norm_backward": (6, 2, 1),
    "native_group_norm_backward": (6, 2, 1),
    "_fused_rms_norm_backward": (5, 2),
    "_softmax_backward_data": (3,),
    "_log_softmax_backward_data": (3,),
}


def _per_element_fwd(node: fx.Node) -> Num:
    return _concrete(_PER_ELEMENT_FWD[_aten_name(node)] * _numel(_in(node, 0)))


def _per_element_bwd(node: fx.Node) -> Num:
    per = _PER_ELEMENT_BWD[_aten_name(node)]
    mask = _mask(node, len(per))
    return _concrete(sum(p for p, m in zip(per, mask) if m) * _numel(_in(node, 0)))


_FLOPS = {
    **{name: _matmul for name in ("mm", "bmm", "matmul", "mv", "dot")},
    **{name: lambda n: _matmul(n, lhs=1, add=True) for name in ("addmm", "baddbmm", "_addmm_activation")},
    "linear": _linear,
    **{name: _conv for name in ("convolution", "_convolution", "conv1d", "conv2d", "conv3d",
                                "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")},
    "convolution_backward": _conv_backward,
    **{name: _attention for name in _ATTENTION},
    **{name: _per_element_fwd for name in _PER_ELEMENT_FWD},
    **{name: _per_element_bwd for name in _PER_ELEMENT_BWD},
    "embedding": lambda n: 0,
    "embedding_dense_backward": lambda n: _numel(_in(n, 0)),
}

def _is_size_code(node: fx.Node) -> bool:
    """Nodes that make no tensor: SymInt arithmetic, sym_size, _assert_scalar (some carry no meta["val"])."""
    if isinstance(node.target, OpOverload):
        return not any("Tensor" in str(r.type) for r in op_schema(node.target).returns)
    return "val" in node.meta and not _tensors(node.meta["val"])


def _flops(node: fx.Node) -> Num:
    op, name = node.target, _aten_name(node)
    if name in _FLOPS:
        return _FLOPS[name](node)
    if name is not None and torch.Tag.reduction in op.tags:
        return _numel(_in(node, 0))
    # pointwise ops and the documented fallback both count one FLOP per output element
    return _concrete(sum((_numel(t) for t in _tensors(_val(node))), 0))


def _bytes_read(node: fx.Node) -> Num:
    if node.target is torch.ops.aten.embedding.default:
        # a lookup touches the gathered rows (= the output) and the indices, not the whole table
        return _concrete(value_bytes(node) + value_bytes(node.args[1]))
    return _concrete(sum((value_bytes(n) for n in node.all_input_nodes), 0))


def node_cost(node: fx.Node) -> NodeCost:
    """Estimated FLOPs and bytes of one node (see the module docstring for the rules).

    Placeholders, outputs, get_attr, views, getitem and size code (nodes making no tensor: SymInt
    arithmetic, sym_size, _assert_scalar) cost nothing; a call_module whose target is a
    GraphModule costs the sum of its graph. Raises ZBCompileError if a node we must size has no meta["val"].
    """
    if node.op in ("placeholder", "output", "get_attr") or moves_no_data(node) or _is_size_code(node):
        return NodeCost()
    if node.op == "call_module":
        sub = node.graph.owning_module.get_submodule(node.target)
        if isinstance(sub, fx.GraphModule):
            return _submodule_cost(sub)
    return NodeCost(_flops(node), _bytes_read(node), value_bytes(node))


def _submodule_cost(sub: fx.GraphModule) -> NodeCost:
    """A nested graph (split_module's call_module nodes): its FLOPs, its inputs read, its outputs written."""
    graph = sub.graph
    read = sum((value_bytes(p) for p in graph.find_nodes(op="placeholder")), 0)
    written = sum((value_bytes(n) for n in graph.output_node().all_input_nodes), 0)
    return NodeCost(graph_cost(sub).flops, _concrete(read), _concrete(written))


def _op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, OpOverload):
        return str(t.overloadpacket)
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _sorted(by_op: dict[str, NodeCost]) -> dict[str, NodeCost]:
    if all(isinstance(c.flops, int) for c in by_op.values()):
        return dict(sorted(by_op.items(), key=lambda kv: -kv[1].flops))
    return by_op


def graph_cost(gm: fx.GraphModule | fx.Graph) -> GraphCost:
    """Sum of node_cost over a graph, with a per-op breakdown (zero-cost nodes are left out)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    by_op: dict[str, NodeCost] = {}
    for node in graph.nodes:
        cost = node_cost(node)
        if cost != NodeCost():
            name = _op_name(node)
            by_op[name] = by_op.get(name, NodeCost()) + cost
    total = sum(by_op.values(), NodeCost())
    return GraphCost(total.flops, _concrete(total.bytes), _sorted(by_op))


# ---------------------------------------------------------------------------------------------------------------
# Symbolic sizes


def evaluate(x: Num, values: Mapping[str | sympy.Symbol, int]) -> int:
    """`x` with its size symbols replaced by `values` (keyed by symbol or symbol name), as an int.

    Raises ZBCompileError naming the symbols `values` does not cover.
    """
    if not isinstance(x, sympy.Basic):
        return int(x)
    by_name = {str(k): v for k, v in values.items()}
    missing = sorted(s.name for s in x.free_symbols if s.name not in by_name)
    if missing:
        raise ZBCompileError(
            f"cannot evaluate the cost {x}: no value for {', '.join(missing)}. "
            "Pass every size symbol, e.g. size_hints(gm) for the sizes the graph was traced with."
        )
    result = x.subs({s: by_name[s.name] for s in x.free_symbols})
    return int(result)


def size_hints(gm: fx.GraphModule | fx.Graph) -> dict[str, int]:
    """{symbol name: example value} for the size symbols of the graph's inputs ({} when all shapes are static).

    The values are the sizes of the example inputs the graph was traced with (the SymInts' hints).
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    hints: dict[str, int] = {}
    for node in graph.find_nodes(op="placeholder"):
        for t in _tensors(node.meta.get("val")):
            for d in t.shape:
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol) and d.node.hint is not None:
                    hints[d.node.expr.name] = int(d.node.hint)
    return hints


# ---------------------------------------------------------------------------------------------------------------
# Text


def format_cost(cost: NodeCost | GraphCost) -> str:
    """'1.2 GFLOP, 3.4 MiB' for a node's or a graph's cost (bytes = read + written)."""
    return f"{format_flops(cost.flops)}, {format_bytes(cost.bytes)}"


def format_cost_table(cost: GraphCost) -> str:
    """The per-op breakdown as a text table, largest FLOPs first, with a total row."""
    rows = [(op, format_flops(c.flops), format_bytes(c.bytes_read), format_bytes(c.bytes_written))
            for op, c in cost.by_op.items()]
    rows.append(("total", format_flops(cost.flops), format_bytes(cost.bytes), ""))
    return tabulate.tabulate(rows, headers=("op", "flops", "read", "written"))
