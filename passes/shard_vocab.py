"""The split pass for vocabulary parallelism: shard the input embedding and the output layer over every rank.

    Partition -> Partition (with .vocab: VocabLayers, zbcompile.ir.stages)

It finds, in the stage forwards, the pattern

    first stage:  emb = embedding(param:E, ids(data))                           E: [V, d]
    last stage:   loss = cross_entropy(view/slice/cast/f...(linear(x, param:W[, param:b])), target(data))  W: [V, d]

(f: ops that act on each logit alone, with constants: a soft-cap `c * tanh(z / c)`, a logit scale; a head written
as `h @ W.T` or with its bias added after the product is made that linear op first: passes/vocab_head.py)

and cuts it out: the first stage reads `act:vocab.emb` instead of computing the lookup, and the last stage
returns `act:vocab.x` (x after the same token reshapes and slices the logits went through, [tokens, d])
instead of the loss. The removed work becomes four graphs that every rank runs on its own shard of rows
(zbcompile.ir.stages.VocabLayers), joined by collectives the lowering inserts:

    IF  partial lookup: rows of the shard, zeros for ids of other shards     -> reduce-sum onto the first stage
    S   local logits y = f(x W_r^T) and per token (max m, sum of e = exp(y - m), target logit if in the
        shard); keeps e and m for T (z = x W_r^T instead of e where there is an f)  -> all-gather (one barrier)
    T   the online-softmax combine: lse = M + log sum_j s_j exp(m_j - M); the loss (cross-entropy's
        reduction and ignore_index); dy = g (e exp(m - lse) - onehot); dW_r = dy^T x; dx_r = dy W_r, the
        one-hot part applied on the [tokens, d] side (rows of x into dW_r, rows of W_r out of dx_r); with an f,
        dy is taken back through f by autograd to dz, and dW_r = dz^T x, dx_r = dz W_r
                                                                            -> reduce-sum onto the last stage
    IB  the first stage's input gradient (broadcast) scattered into the shard's rows

This is the paper's forward-phase algorithm (Yeung et al., MLSys 2025, "Vocab-1"): max and sum merged into one
barrier by the online-softmax rescaling, the input-gradient shares reduced after T. Padded rows (V rounded up
to a multiple of the shards) get -inf logits, so they never enter the softmax, and no id looks them up.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import fx

from zbcompile.errors import VocabError
from zbcompile.ir.names import VOCAB_EMB, VOCAB_X, Role, key_of, role_of
from zbcompile.ir.stages import Graph, Partition, TensorSpec, VocabLayers, module_path
from zbcompile.passes.graph_walk import ancestors
from zbcompile.passes.vocab_shard_graphs import data_graph, shard_graphs, stat_dtype

__all__ = ["shard_vocab", "find_vocab_layers", "VocabPattern"]

_aten = torch.ops.aten
# ops the logits may pass through between the linear layer and the cross-entropy: each acts on token dims only
# (checked), so it can act on the layer's input instead
_RESHAPES = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_IDENTITIES = (_aten.alias.default, _aten.clone.default, _aten.contiguous.default, _aten.detach.default)
_TOKEN_OPS = (_aten.slice.Tensor, _aten.select.int)
_CAST = _aten._to_copy.default
# checks export adds beside a cast (`.float()` -> _to_copy + _assert_tensor_metadata): they read the logits but
# compute nothing, so they go with the logits
_CHECKS = (_aten._assert_tensor_metadata.default,)
# a pointwise op whose other arguments are constants (a soft-cap's div / tanh / mul, a logit scale) acts on each
# logit alone, so each shard applies it to its own rows; these are the ones whose gradient T takes
_NOT_PER_LOGIT = (_aten.native_dropout.default, _aten.bernoulli.default, _aten.bernoulli.p)
_EXPECTED = ("an embedding lookup `embedding(E, ids)` in the first stage and, as the loss, "
             "`cross_entropy(linear(x, W)[...], targets)` in the last, with E and W of shape [V, d]")


@dataclasses.dataclass(frozen=True)
class VocabPattern:
    """Where the vocabulary layers are in the stage forwards (nodes of stage 0's and the last stage's graphs)."""

    embedding: fx.Node
    linear: fx.Node
    chain: tuple[fx.Node, ...]         # the nodes from the linear's output to the cross-entropy's input
    loss: fx.Node                      # the cross_entropy_loss node
    table: str                         # param:E
    weight: str                        # param:W
    bias: str | None                   # param:b
    size: int                          # V
    reduction: int                     # 1 mean, 2 sum
    ignore_index: int
    padding_idx: int
    logits_dtype: torch.dtype
    compute_dtype: torch.dtype | None = None   # W (and b) cast to this before the linear (autocast), else None
    scale_by_freq: bool = False        # the embedding's scale_grad_by_freq
    logit_ops: tuple[fx.Node, ...] = ()   # the casts and per-logit ops of the chain, in order, if it has any f


def shard_vocab(cut: Partition, *, shards: int) -> Partition:
    """A split pass: `cut` with its vocabulary layers taken out of the first and last stage and sharded over
    `shards` ranks (see the module docstring). Raises VocabError naming what was expected and what was found."""
    if shards < 1:
        raise VocabError(f"vocabulary parallelism needs at least 1 shard, got {shards}")
    first, last = cut.stages[0], cut.stages[-1]
    pattern = find_vocab_layers(first, last, cut.traced.frozen)
    stages = list(cut.stages)
    x_val, new_last = _output_layer_input(last, pattern)
    stages[-1] = new_last
    emb_source = stages[0]
    stages[0] = _embedding_input(emb_source, pattern)
    _check_only_vocab_uses(stages, pattern)
    d = int(x_val.shape[-1])
    rows = -(-pattern.size // shards)
    emb_val = pattern.embedding.meta["val"]
    device = cut.traced.device or x_val.device
    ids = data_graph(first, pattern.embedding.args[1], "vocab:ids")
    targets = data_graph(last, pattern.loss.args[1], "vocab:targets")
    graphs = shard_graphs(pattern, first, last, ids, targets, rows, shards, d, x_val, emb_val, device)
    vocab = VocabLayers(
        shards=shards, size=pattern.size, rows=rows, embedding=key_of(pattern.table), head=key_of(pattern.weight),
        bias=key_of(pattern.bias) if pattern.bias else None, graphs=graphs,
        x=TensorSpec(VOCAB_X, tuple(x_val.shape), x_val.dtype),
        emb=TensorSpec(VOCAB_EMB, tuple(emb_val.shape), emb_val.dtype),
        stats=TensorSpec("vocab:stats", (int(x_val.shape[0]), 3), stat_dtype(pattern.logits_dtype),
                         requires_grad=False),
        pattern=_describe(pattern), last=last, ids=ids, targets=targets, ignore_index=pattern.ignore_index)
    return dataclasses.replace(cut, stages=tuple(stages), vocab=vocab)


# ---- finding the pattern ----------------------------------------------------------------------------------
def find_vocab_layers(first: Graph, last: Graph, frozen=frozenset()) -> VocabPattern:
    """The vocabulary layers of a partition's first and last stage forwards, checked; VocabError otherwise."""
    loss = last.output_nodes().get("loss")
    if loss is None or loss.target is not _aten.cross_entropy_loss.default:
        got = "nothing" if loss is None else f"`{loss.format_node()}`"
        raise VocabError(f"vocab_parallel=True expects {_EXPECTED}; the loss is computed by {got}.\n"
                         "fix: return the logits from the model and let loss_fn be `F.cross_entropy(logits.view(-1, "
                         "V), targets.view(-1))` (no ops after it), or compile without vocab_parallel")
    reduction, ignore_index, smoothing, weight = (_arg(loss, 3, "reduction", 1), _arg(loss, 4, "ignore_index", -100),
                                                  _arg(loss, 5, "label_smoothing", 0.0), _arg(loss, 2, "weight"))
    if weight is not None or smoothing or reduction not in (1, 2):
        raise VocabError("vocab_parallel=True supports cross_entropy with reduction 'mean' or 'sum', no class "
                         f"weights and no label smoothing; found weight={'given' if weight is not None else None}, "
                         f"label_smoothing={smoothing}, reduction={['none', 'mean', 'sum'][reduction]}.\n"
                         "fix: use plain cross-entropy, or compile without vocab_parallel")
    target = loss.args[1].meta.get("val") if isinstance(loss.args[1], fx.Node) else None
    if target is None or target.is_floating_point() or target.dim() != 1:
        shape = "" if target is None else f" ({target.dtype}, {list(target.shape)})"
        raise VocabError(f"vocab_parallel=True takes the cross-entropy's targets as class indices, one per token; "
                         f"these{shape} are not (probabilities, or another layout). Each rank holds only its rows of "
                         "the vocabulary, so it picks its share of the target logit by index.\n"
                         "fix: pass `targets.view(-1)` of integer class ids, or compile without vocab_parallel")
    chain, node, linear = [], loss.args[0], _chain_end(loss.args[0])
    while node is not linear:
        chain.append(node)
        node = node.args[0]
    weight, compute_dtype = _through_cast(linear.args[1]) if isinstance(linear, fx.Node) else (None, None)
    if not (isinstance(linear, fx.Node) and linear.target is _aten.linear.default
            and _placeholder_name(last, weight) is not None):
        what = linear.format_node() if isinstance(linear, fx.Node) else repr(linear)
        raise VocabError(f"vocab_parallel=True expects {_EXPECTED}; the cross-entropy's logits come from "
                         f"`{what}`, not from a linear layer with a parameter weight.\n"
                         "fix: compute the logits with an nn.Linear, F.linear or `h @ W.T` on the model's parameter "
                         "(a bias parameter may be added after); "
                         "between it and the loss only reshapes, token slices, casts and ops on each logit alone "
                         "with constants (a soft-cap `c * tanh(z / c)`, a scale) may act")
    weight_name = _placeholder_name(last, weight)
    bias_arg = linear.args[2] if len(linear.args) > 2 else None
    bias_name = _placeholder_name(last, _through_cast(bias_arg)[0]) if bias_arg is not None else None
    size = int(weight.meta["val"].shape[0])
    logits = loss.args[0].meta["val"]
    if logits.dim() != 2 or int(logits.shape[-1]) != size:
        raise VocabError(f"vocab_parallel=True expects the cross-entropy's input as [tokens, V={size}]; it is "
                         f"{list(logits.shape)}.\nfix: pass `logits.view(-1, V)` and `targets.view(-1)`")
    for n in (linear, *chain):
        readers = [u for u in n.users if u.target not in _CHECKS]
        if len(readers) != 1:
            raise VocabError(f"the logits `{n.name}` are read by more than the cross-entropy "
                             f"({', '.join(u.name for u in readers)}); vocab_parallel=True never materializes the "
                             "whole logits. fix: compute only the loss from them")
    for n in chain:
        _check_token_op(n, size)
    embedding = _find_embedding(first, size)
    table = _placeholder_name(first, embedding.args[0])
    if _arg(embedding, 4, "sparse", False):
        raise VocabError("vocab_parallel=True does not support an embedding with sparse=True (its shards' gradients "
                         "are dense rows); fix: use nn.Embedding(sparse=False), or compile without vocab_parallel")
    for name in (table, weight_name, bias_name):
        if name is not None and key_of(name) in frozen:
            raise VocabError(f"vocab_parallel=True: {key_of(name)} does not require grad; sharded vocabulary "
                             "parameters must be trained. fix: compile without vocab_parallel")
    _check_from_data(first, embedding.args[1], "the embedding's ids")
    _check_from_data(last, loss.args[1], "the cross-entropy's targets")
    chain.reverse()
    logit_ops = tuple(n for n in chain if n.target is _CAST or _per_logit(n)) if any(map(_per_logit, chain)) else ()
    return VocabPattern(embedding, linear, tuple(chain), loss, table, weight_name, bias_name, size,
                        reduction, ignore_index, _arg(embedding, 2, "padding_idx", -1), logits.dtype, compute_dtype,
                        bool(_arg(embedding, 3, "scale_grad_by_freq", False)), logit_ops)


def _chain_end(node: fx.Node) -> fx.Node:
    """Where the logits' chain of reshapes, token ops, casts and per-logit ops to the loss starts."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (node.target in (
            *_RESHAPES, *_IDENTITIES, *_TOKEN_OPS, _CAST) or _per_logit(node)):
        node = node.args[0]
    return node


def _per_logit(node: fx.Node) -> bool:
    """`node` maps each logit to one floating value by itself: a pointwise op reading the logits and constants."""
    val, source = node.meta.get("val"), node.args[0] if node.args else None
    others: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), others.append)
    return (node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())
            and node.target not in _NOT_PER_LOGIT and isinstance(source, fx.Node) and not others
            and isinstance(val, torch.Tensor) and val.dtype.is_floating_point
            and tuple(val.shape) == tuple(source.meta["val"].shape))


def _through_cast(node):
    """(the parameter placeholder, the dtype) where `node` is a cast of one to another dtype read by the linear
    alone (what autocast makes of `linear(x, W)`); (node, None) otherwise."""
    if (isinstance(node, fx.Node) and node.target is _CAST and set(node.kwargs) <= {"dtype"}
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
            and len([u for u in node.users if u.target not in _CHECKS]) == 1):
        return node.args[0], node.kwargs.get("dtype")
    return node, None


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _placeholder_name(g: Graph, node) -> str | None:
    """The stage input name of `node` when it is a parameter placeholder of `g`."""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return None
    name = dict(zip(g.input_nodes().values(), g.inputs)).get(node)
    return name if name is not None and role_of(name) is Role.PARAM else None


def _find_embedding(first: Graph, size: int) -> fx.Node:
    found = [n for n in first.gm.graph.nodes if n.target is _aten.embedding.default
             and _placeholder_name(first, n.args[0]) is not None and int(n.args[0].meta["val"].shape[0]) == size]
    if len(found) != 1:
        seen = [f"`{n.format_node()}`" for n in first.gm.graph.nodes if n.target is _aten.embedding.default]
        raise VocabError(f"vocab_parallel=True expects {_EXPECTED}; the first stage has "
                         f"{len(found)} embedding lookups on a [{size}, d] parameter"
                         f"{' (lookups: ' + ', '.join(seen) + ')' if seen else ''}.\n"
                         "fix: look the token ids up in one nn.Embedding(V, d) at the start of the model, and "
                         "put the first split point after that lookup")
    return found[0]


def _check_token_op(node: fx.Node, size: int) -> None:
    """Between the linear layer and the loss only ops that leave the vocabulary dim whole may act."""
    val = node.args[0].meta["val"]
    if node.target in _TOKEN_OPS:
        dim = node.args[1] if len(node.args) > 1 else 0
        if dim % val.dim() == val.dim() - 1:
            raise VocabError(f"`{node.format_node()}` slices the vocabulary dim of the logits; vocab_parallel=True "
                             "needs every logit of the vocabulary. fix: slice the tokens, not the vocabulary")
    elif node.target is _CAST and set(node.kwargs) - {"dtype"}:
        raise VocabError(f"`{node.format_node()}` moves the logits; only a dtype cast may act on them")
    elif node.target in _RESHAPES and int(node.meta["val"].shape[-1]) != size:
        raise VocabError(f"`{node.format_node()}` reshapes the vocabulary dim of the logits (to "
                         f"{list(node.meta['val'].shape)}); fix: keep V as the last dim, e.g. logits.view(-1, V)")


def _check_from_data(g: Graph, node: fx.Node, what: str) -> None:
    """`node` must be computed from the user's data alone (every rank has the data, none the activations)."""
    names = dict(zip(g.input_nodes().values(), g.inputs))
    order = {n: i for i, n in enumerate(g.gm.graph.nodes)}
    for n in sorted(ancestors([node]), key=order.__getitem__):
        if n.op == "placeholder" and role_of(names[n]) is not Role.DATA:
            raise VocabError(f"{what} depend on `{names[n]}`, not only on the step's inputs; every rank computes "
                             f"them from the batch. fix: pass them in as model inputs / loss targets")


def _describe(p: VocabPattern) -> str:
    head = key_of(p.weight) + (f" + {key_of(p.bias)}" if p.bias else "")
    per_logit = "".join(f" -> {n.target.__name__.split('.')[0]}" for n in p.logit_ops if n.target is not _CAST)
    return (f"embedding {key_of(p.table)}[ids] ... linear {head}{per_logit} -> cross_entropy"
            f"({'mean' if p.reduction == 1 else 'sum'}, ignore_index={p.ignore_index}), V={p.size}")


# ---- rewriting the stage forwards ---------------------------------------------------------------------------
def _output_layer_input(last: Graph, p: VocabPattern) -> tuple[torch.Tensor, Graph]:
    """The last stage returning act:vocab.x (the linear's input through the logits' token ops) for the loss."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(last.gm.graph, env)
    for check in [u for n in (p.linear, *p.chain) for u in n.users if u.target in _CHECKS]:
        graph.erase_node(env[check])   # it read the logits, which this stage no longer computes
    x = env[p.linear.args[0]]
    for n in p.chain:
        if n.target in _IDENTITIES or n.target is _CAST or n in p.logit_ops:
            continue
        args = list(n.args)
        args[0] = x
        target = n.target
        if n.target in _RESHAPES:
            shape = list(args[1])
            shape[-1] = -1 if shape[-1] == -1 else int(p.linear.args[0].meta["val"].shape[-1])
            args[1] = shape
            # the logits' `.contiguous()` before the view is not replayed, so x may be a strided slice (a causal
            # LM's shift, `logits[:, :-1]`): reshape copies where a view could not
            target = _aten.reshape.default
        x = graph.call_function(target, tuple(args), dict(n.kwargs))
        x.meta = {**n.meta, "val": target(*fx.node.map_arg(tuple(args), lambda a: a.meta["val"]), **n.kwargs)}
    outs = dict(zip(last.outputs, out if isinstance(out, (tuple, list)) else (out,)))
    x = graph.call_function(_aten.contiguous.default, (x,))   # sent as [tokens, d], contiguous on the wire
    x.meta = {"val": x.args[0].meta["val"].contiguous()}
    names = (VOCAB_X,) + tuple(n for n in last.outputs if n != "loss")
    graph.output(tuple(x if n == VOCAB_X else outs[n] for n in names))
    g = _pruned(last, graph, names)
    return x.meta["val"], g


def _embedding_input(first: Graph, p: VocabPattern) -> Graph:
    """The first stage reading the summed lookup as act:vocab.emb instead of computing it."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(first.gm.graph, env)
    lookup = env.get(p.embedding)
    if lookup is None:   # a one-stage pipeline: the first stage is the last stage, rewritten above
        lookup = next(n for n in graph.nodes if n.target is _aten.embedding.default and n.name == p.embedding.name)
    placeholders = list(graph.find_nodes(op="placeholder"))
    with graph.inserting_after(placeholders[-1]):
        emb = graph.placeholder("vocab_emb")
    emb.meta = {"val": lookup.meta["val"]}
    lookup.replace_all_uses_with(emb)
    graph.erase_node(lookup)
    graph.output(fx.node.map_arg(out, lambda n: emb if n is lookup else n))
    return _pruned(first, graph, first.outputs, extra_inputs=(VOCAB_EMB,))


def _pruned(old: Graph, graph: fx.Graph, outputs: Sequence[str], extra_inputs: Sequence[str] = ()) -> Graph:
    """`graph` without dead nodes and without the placeholders nothing reads any more, as a Graph record."""
    graph.eliminate_dead_code()
    names = list(old.inputs) + list(extra_inputs)
    kept = []
    for name, ph in zip(names, list(graph.find_nodes(op="placeholder"))):
        if ph.users or role_of(name) is Role.ACT:
            kept.append(name)
        else:
            graph.erase_node(ph)
    graph.lint()
    gm = fx.GraphModule(old.gm, graph)
    return dataclasses.replace(old, gm=gm, inputs=tuple(kept), outputs=tuple(outputs))


def _check_only_vocab_uses(stages: Sequence[Graph], p: VocabPattern) -> None:
    """After the rewrite no stage may read a vocabulary parameter: it exists only as shards."""
    for st in stages:
        for name in {p.table, p.weight, p.bias} & set(st.inputs):
            users = [u.name for u in st.input_nodes()[name].users]
            where = ", ".join(sorted({path for u in st.input_nodes()[name].users for path in module_path(u)[-1:]}))
            raise VocabError(f"vocab_parallel=True shards {key_of(name)} over the ranks, but stage {st.index} also "
                             f"reads it outside the embedding lookup and the output layer ({', '.join(users)}"
                             f"{' in ' + where if where else ''}). fix: use it only in those two places, or compile "
                             "without vocab_parallel")
