"""The four graphs every rank runs on its shard of the vocabulary rows (IF, S, T, IB; passes/shard_vocab.py says
what each computes), traced from the functions below with the shapes and dtypes of the pattern the split pass
found, and the data graphs that compute the ids and the targets from the step's inputs.

The output layer's graphs are the online-softmax algorithm: S keeps per token the local maximum and sum of
exponentials (and the shard's target logit), T combines the gathered statistics into the log-sum-exp, the loss
and the gradients of x and of the shard's rows; traced with autocast off, as the step's own graphs are.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import fx

from zbcompile._torch_private import FakeTensorMode
from zbcompile.ir.names import key_of
from zbcompile.ir.stages import Graph
from zbcompile.passes.graph_walk import ancestors

if TYPE_CHECKING:
    from zbcompile.passes.shard_vocab import VocabPattern

__all__ = ["data_graph", "shard_graphs", "stat_dtype"]


def data_graph(g: Graph, node: fx.Node, output: str) -> Graph:
    """`node` of `g` (computed from data inputs only) as a Graph of its own, reading those inputs."""
    inputs, gm = _data_fn(g, node)
    return Graph(gm, inputs, (output,))


def _data_fn(g: Graph, node: fx.Node) -> tuple[tuple[str, ...], fx.GraphModule]:
    """The data inputs `node` is computed from and a GraphModule computing it from them."""
    names = dict(zip(g.input_nodes().values(), g.inputs))
    order = {n: i for i, n in enumerate(g.gm.graph.nodes)}
    needed = sorted(ancestors([node]), key=order.__getitem__)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for n in needed:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
            env[n].meta = dict(n.meta)
            inputs.append(names[n])
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[node])
    return tuple(inputs), fx.GraphModule(g.gm, graph)


def shard_graphs(p: VocabPattern, first: Graph, last: Graph, ids_graph: Graph, targets_graph: Graph, rows: int,
                  shards: int, d: int, x_val: torch.Tensor, emb_val: torch.Tensor,
                  device: torch.device) -> dict[str, Graph]:
    id_inputs, ids_fn = ids_graph.inputs, ids_graph.gm
    target_inputs, target_fn = targets_graph.inputs, targets_graph.gm
    table_val = p.embedding.args[0].meta["val"]
    data_vals = {**{n: ph.meta["val"] for n, ph in first.input_nodes().items()},
                 **{n: ph.meta["val"] for n, ph in last.input_nodes().items()}}
    weight_val = data_vals[p.weight]   # (the parameter's own dtype, before any cast autocast made)
    bias_val = data_vals[p.bias] if p.bias else None
    padded = rows * shards != p.size
    heads = (p.weight,) + ((p.bias,) if p.bias else ())
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(val, shape=None, dtype=None):
        with mode:
            return torch.empty(tuple(val.shape) if shape is None else shape, dtype=dtype or val.dtype, device=device)

    offset = fake(None, (), torch.int64)
    tokens = int(x_val.shape[0])
    logit_fn = None
    if p.logit_ops:
        logit_fn = functools.partial(_replay, steps=tuple((n.target, n.args[1:], dict(n.kwargs))
                                                          for n in p.logit_ops))
    fx_if = functools.partial(_input_forward, ids_fn=ids_fn, rows=rows)
    fx_ib = functools.partial(_input_backward, ids_fn=ids_fn, rows=rows, padding_idx=p.padding_idx,
                              size=p.size if p.scale_by_freq else None)
    fx_s = functools.partial(_output_forward, target_fn=target_fn, rows=rows, size=p.size if padded else None,
                             logits_dtype=p.logits_dtype, n_data=len(target_inputs), has_bias=bool(p.bias),
                             compute_dtype=p.compute_dtype, logit_fn=logit_fn)
    fx_t = functools.partial(_output_backward, target_fn=target_fn, rows=rows, reduction=p.reduction,
                             ignore_index=p.ignore_index, logits_dtype=p.logits_dtype, has_bias=bool(p.bias),
                             compute_dtype=p.compute_dtype, logit_fn=logit_fn, size=p.size if padded else None)
    ids = tuple(fake(data_vals[n]) for n in id_inputs)
    targets = tuple(fake(data_vals[n]) for n in target_inputs)
    head_vals = (fake(weight_val, (rows, d)),) + ((fake(bias_val, (rows,)),) if p.bias else ())
    x = fake(x_val)
    saved = fake(None, (tokens, rows), p.linear.meta["val"].dtype if logit_fn else stat_dtype(p.logits_dtype))
    top = fake(None, (tokens,), stat_dtype(p.logits_dtype))
    gathered = fake(None, (shards, tokens, 3), stat_dtype(p.logits_dtype))
    # the loss gradient in the statistics' dtype: float64 logits take a float64 seed (1/m in float32 would scale
    # every gradient by float32's rounding of it), half-precision ones a float32 one
    seed = fake(None, (), stat_dtype(p.logits_dtype))
    grads = tuple("grad:" + n for n in heads)
    return {
        "if": _traced(fx_if, ("param:" + key_of(p.table), "vocab:offset") + id_inputs, ("vocab:part",),
                      (fake(table_val, (rows, d)), offset) + ids),
        "s": _traced(fx_s, heads + ("vocab:x", "vocab:offset") + target_inputs,
                     ("vocab:stats", "vocab:saved:0", "vocab:saved:1"), head_vals + (x, offset) + targets),
        "t": _traced(fx_t, ("vocab:gathered", "vocab:saved:0", "vocab:saved:1", "vocab:x") + heads
                     + ("vocab:offset", "grad:loss") + target_inputs, grads + ("vocab:dx", "loss"),
                     (gathered, saved, top) + (x,) + head_vals + (offset, seed) + targets),
        "ib": _traced(fx_ib, ("vocab:demb", "vocab:offset") + id_inputs, ("grad:" + p.table,),
                      (fake(emb_val), offset) + ids),
    }


def _traced(fn: Callable, inputs: Sequence[str], outputs: Sequence[str], args: Sequence[torch.Tensor]) -> Graph:
    from torch.fx.experimental.proxy_tensor import make_fx

    # outside the autocast the step was traced under: the functions cast as the head's linear did (its weight's
    # cast, if any), which an autocast region of the head's own (enabled=False) may have decided
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        gm = make_fx(fn, tracing_mode="fake")(*args)
    return Graph(gm, tuple(inputs), tuple(outputs))


# The four passes as plain torch, traced once into fx graphs. `offset` is the shard's first row; rows past the
# shard, or ids of other shards, are masked, never indexed.
def _shard_local(ids: torch.Tensor, offset: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = ids - offset
    inside = (local >= 0) & (local < rows)
    return torch.where(inside, local, 0), inside


def _input_forward(table, offset, *data, ids_fn, rows):
    safe, inside = _shard_local(ids_fn(*data), offset, rows)
    return (torch.where(inside.unsqueeze(-1), torch.nn.functional.embedding(safe, table), 0),)


def _input_backward(demb, offset, *data, ids_fn, rows, padding_idx, size=None):
    """`size`: scale_grad_by_freq over a vocabulary of `size` ids. Each token's gradient is divided by how often
    its id occurs in the whole batch, as torch's backward does per token, counted over every id: the shard's own
    count would also count the other shards' ids it parks on row 0."""
    ids = ids_fn(*data)
    safe, inside = _shard_local(ids, offset, rows)
    if padding_idx >= 0:   # the padding row gets no gradient, as in nn.Embedding
        inside = inside & (ids != padding_idx)
    grad = torch.where(inside.unsqueeze(-1), demb, 0)
    if size is not None:
        flat = ids.reshape(-1)
        counts = torch.zeros(size, dtype=demb.dtype, device=demb.device).index_add_(0, flat, torch.ones_like(
            flat, dtype=demb.dtype))
        grad = grad * (1.0 / counts[ids]).unsqueeze(-1)
    return (torch.ops.aten.embedding_dense_backward(grad, safe, rows, -1, False),)


def _cast(t, dtype):
    """A head parameter as the linear reads it: cast as autocast cast it (dtype), or as it is (None)."""
    return t if t is None or dtype is None else t.to(dtype)


def _output_forward(*args, target_fn, rows, size, logits_dtype, n_data, has_bias, compute_dtype=None,
                    logit_fn=None):
    weight, bias = _cast(args[0], compute_dtype), _cast(args[1] if has_bias else None, compute_dtype)
    x, offset = args[1 + has_bias], args[2 + has_bias]
    data = args[3 + has_bias:]
    z = torch.nn.functional.linear(x, weight, bias)
    y = (z if logit_fn is None else logit_fn(z)).to(logits_dtype)
    if size is not None:   # the last shard's padded rows: -inf, outside every softmax
        valid = torch.arange(rows, device=y.device) + offset < size
        y = torch.where(valid, y, float("-inf"))
    yf = y.to(stat_dtype(logits_dtype))
    # a shard of padding rows only (V <= (p - 1) * rows) has max -inf: held at the dtype's lowest finite value,
    # its e = exp(-inf) = 0 and its statistics drop out of the combine, instead of exp(-inf + inf) = NaN
    top = yf.amax(-1).clamp_min(torch.finfo(yf.dtype).min)
    # kept for T (its softmax is e * exp(top - lse), one pass); exp in place: one [tokens, V/p] buffer less
    e = (yf - top.unsqueeze(-1)).exp_()
    safe, inside = _shard_local(target_fn(*data), offset, rows)
    picked = torch.where(inside, yf.gather(1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
    # with per-logit ops T needs their derivative at z, and rebuilds e from z: z is kept instead of e
    return torch.stack([top, e.sum(-1), picked], dim=1), e if logit_fn is None else z, top


def _replay(z: torch.Tensor, *, steps) -> torch.Tensor:
    """The chain's casts and per-logit ops (target, other args, kwargs), in order, on a shard's logits."""
    for target, rest, kwargs in steps:
        z = target(z, *rest, **kwargs)
    return z


def stat_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The softmax statistics are kept in float32 at least (half-precision logits lose the sum's digits)."""
    return torch.promote_types(logits_dtype, torch.float32)


def _output_backward(gathered, saved, top_local, x, *args, target_fn, rows, reduction, ignore_index, logits_dtype,
                     has_bias, compute_dtype=None, logit_fn=None, size=None):
    param = args[0]   # the gradients go back in the parameters' dtypes; the matmuls run in the linear's
    weight = _cast(param, compute_dtype)
    offset, seed = args[1 + has_bias], args[2 + has_bias]
    data = args[3 + has_bias:]
    top = gathered[..., 0].amax(0)
    total = (gathered[..., 1] * torch.exp(gathered[..., 0] - top)).sum(0)
    lse = top + torch.log(total)
    target = target_fn(*data)
    keep = target != ignore_index
    per_token = torch.where(keep, lse - gathered[..., 2].sum(0), 0.0)
    weights = keep.to(gathered.dtype)
    if reduction == 1:   # mean over the tokens that count
        count = weights.sum()
        # a microbatch whose targets are all ignore_index: its loss is 0/0 = NaN, as eager's, but its gradient is
        # zero, as eager's cross-entropy backward gives (weights are all zero; divided by 1, not 0/0 = NaN)
        loss, weights = per_token.sum() / count, weights / count.clamp_min(1)
    else:
        loss = per_token.sum()
    g = weights * seed
    if logit_fn is not None:
        dz = _through_logit_fn(saved, top_local, lse, g, target, offset, rows, size, logit_fn, logits_dtype)
        dz = dz.to(weight.dtype)
        grads = (dz.t().mm(x).to(param.dtype),) + ((dz.sum(0).to(args[1].dtype),) if has_bias else ())
        return (*grads, dz.mm(weight), loss.to(logits_dtype))
    # dy = g (softmax - onehot): the softmax part over the whole shard in one pass, the one-hot part on the
    # [tokens, d] side (a row of x into dW, a row of W out of dx per token whose target is in the shard)
    dy = (saved * (torch.exp(top_local - lse) * g).unsqueeze(-1)).to(weight.dtype)
    safe, inside = _shard_local(target, offset, rows)
    hit = torch.where(inside, g, 0.0).to(weight.dtype).unsqueeze(-1)
    dw = dy.t().mm(x).index_add(0, safe, -(hit * x)).to(param.dtype)
    grads = (dw,) + ((dy.sum(0).index_add(0, safe, -hit.squeeze(-1)).to(args[1].dtype),) if has_bias else ())
    dx = dy.mm(weight) - hit * torch.nn.functional.embedding(safe, weight)
    return (*grads, dx, loss.to(logits_dtype))


def _through_logit_fn(z, top_local, lse, g, target, offset, rows, size, logit_fn, logits_dtype):
    """The gradient at the linear's output z of a shard whose logits are f(z): dy = g (softmax - onehot) on the
    shard's rows, taken back through f by autograd (traced into T's graph as f's own backward ops)."""
    with torch.enable_grad():
        leaf = z.detach().requires_grad_(True)
        y = logit_fn(leaf).to(logits_dtype).to(lse.dtype)
        if size is not None:   # padded rows: out of the softmax, and no gradient (f' there may be anything)
            valid = torch.arange(rows, device=y.device) + offset < size
            y = torch.where(valid, y, float("-inf"))
        softmax = torch.exp(y - lse.unsqueeze(-1))
        safe, inside = _shard_local(target, offset, rows)
        dy = (softmax * g.unsqueeze(-1)).scatter_add(1, safe.unsqueeze(-1), -torch.where(inside, g, 0.0)
                                                     .unsqueeze(-1))
        (dz,) = torch.autograd.grad(y, leaf, dy)
    return dz
