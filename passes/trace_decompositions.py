"""The trace's own decompositions: ATen composites written out so that the step's graph can carry what the
composite hides, applied to the exported graph before `run_decompositions`.

    DECOMPOSITIONS: instance_norm               its running-statistic updates, as copies into the buffers
    detach_no_grad_regions: torch.no_grad()      what the region reads and what it returns, detached (the
                                                region's grad mode, which run_decompositions drops)
    write_out_recurrent_dropouts:               each layer a call of its own, the dropout between them an
      lstm, gru, rnn_tanh, rnn_relu             aten.dropout (torch's decomposition drops it: it sets the
                                                probability to 0 by a test that is never true)
    write_out_dropouts: feature_dropout,        their mask drawn by `native_dropout` (whose `training`
      alpha_dropout, feature_alpha_dropout      argument the eval switch turns off), the output chosen by it

The dropouts' composites draw their mask with `bernoulli_` and leave no op an evaluation could switch off
(passes/forward_only.py flips the `training` argument of the ops in TRAINING_ARGUMENT and refuses any other
random op). Here the draw is `native_dropout(ones(mask shape), p, training)`: on the CPU the same `bernoulli_(1
- p)` over the same shape, so the training step is bit for bit eager's composite. Its two results also say
which mode ran: in train mode a kept element's scaled value is 1/(1 - p) and a dropped one's mask is False;
in eval mode every value is 1 and every mask True. The output is the composite's formula where the mode was
train and the input itself where it was eval, which is what torch's modules return in eval mode.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch
from torch import fx

from zbcompile._torch_private import op_schema
from zbcompile.passes.analysis.aliases import written_inputs

__all__ = ["DECOMPOSITIONS", "bound_arguments", "detach_no_grad_regions", "write_out_dropouts",
           "write_out_recurrent_dropouts"]

aten = torch.ops.aten
_ALPHA = 1.7580993408473766   # SELU's alpha, as ATen's alpha dropout has it


def _instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled):
    """aten.instance_norm as ATen's own composite computes it (a batch norm over the (1, B*C, ...) view of the
    input), written out for the trace: the composite updates the running statistics through an alias its schema
    does not declare, so export neither saw the update (running stats never changed) nor could a stage graph
    carry it (aot refuses the hidden input mutation). Here it is a copy into the buffer, which export makes a
    buffer update of the step, as it does BatchNorm's."""
    b, c = input.shape[0], input.shape[1]

    def per_sample(t):
        return None if t is None else t.repeat(b)

    mean, var = per_sample(running_mean), per_sample(running_var)
    out = torch.batch_norm(input.contiguous().view(1, b * c, *input.shape[2:]), per_sample(weight),
                           per_sample(bias), mean, var, use_input_stats, momentum, eps, cudnn_enabled)
    if use_input_stats and running_mean is not None:
        running_mean.copy_(mean.view(b, c).mean(0))
    if use_input_stats and running_var is not None:
        running_var.copy_(var.view(b, c).mean(0))
    return out.view_as(input)


def write_out_dropouts(gm: fx.GraphModule) -> None:
    """Every feature / alpha dropout of the exported graph, in place, as `_dropout` below writes it. Before
    `run_decompositions`: export's decompositions do not take a table entry for a random op (they are not
    preservable ops), so this edits the graph instead."""
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _DROPOUTS]:
        feature, alpha, inplace = _DROPOUTS[node.target]
        x, p, train = (*node.args, *(node.kwargs[k] for k in ("input", "p", "train") if k in node.kwargs))
        with gm.graph.inserting_before(node):
            call = _Writer(gm.graph, node)
            out = _dropout(call, x, p, train, x.meta["val"], feature=feature, alpha=alpha)
            if inplace and out is not x:   # `inplace=True`: the result written into the input, returned
                out = call(aten.copy_.default, x, out)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    gm.recompile()


def detach_no_grad_regions(gm: fx.GraphModule) -> None:
    """Every `with torch.no_grad():` region of the step with its reads and its results detached.

    Export keeps such a region as a `wrap_with_set_grad_enabled(False, ...)` call, but `run_decompositions`
    inlines it and the grad mode is gone: the joint trace of a stage would then differentiate through it where
    eager does not. A detach says the same thing in a graph that has no grad mode. Detaching the results (a scale
    or a mask computed under no_grad, an EMA buffer read back) keeps gradients from flowing out of the region;
    detaching the reads keeps the region's own values gradient-free, which matters where a stage boundary falls
    inside it (a frozen backbone run under no_grad, cut in two): otherwise the first stage's output would
    carry a gradient, the next stage would send back zeros for it, and parameters eager leaves without a
    `.grad` would get zeros, which weight decay then moves. A read the region writes in place (a buffer's
    running average) stays as it is: the write must reach the buffer, and a buffer carries no gradient."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    for node in list(gm.graph.nodes):
        if hop is None or node.target is not hop or node.args[0] is not False:
            continue
        _detach_reads(gm, node)
        if _inline(gm, node):
            continue
        for item in list(node.users):
            readers = [u for u in item.users if u.op != "output"]
            if readers:
                _detach_for(gm.graph, item, readers, after=item)
    gm.recompile()


def _inline(gm: fx.GraphModule, region: fx.Node) -> bool:
    """The no_grad `region`'s body copied in its place, each result detached; False (nothing done) for a body
    holding submodules (a nested grad-mode region). Inlined here, the body's ops keep their own modules:
    `run_decompositions` would give each the region's (the model, for a backbone called under no_grad), and a
    split point inside the region would find its module computing nothing. Each result becomes a detach of the
    value under the result's own node and name, which the export signature may name."""
    body = getattr(gm, region.args[1].target)
    if any(n.op in ("get_attr", "call_module") for n in body.graph.nodes) or any(
            u.target is not operator.getitem for u in region.users):
        return False
    env = dict(zip(body.graph.find_nodes(op="placeholder"), region.args[2:]))
    with gm.graph.inserting_before(region):
        for n in body.graph.nodes:
            if n.op not in ("placeholder", "output"):
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
    results = body.graph.output_node().args[0]
    for item in list(region.users):
        item.target, item.args = aten.detach.default, (env[results[item.args[1]]],)
    owner = region.args[1]
    gm.graph.erase_node(region)
    if not owner.users:
        gm.graph.erase_node(owner)
        delattr(gm, owner.target)
    return True


def _detach_reads(gm: fx.GraphModule, region: fx.Node) -> None:
    """The operands of the no_grad `region` that carry a gradient, detached for it (those it writes in place
    kept as they are)."""
    written = written_inputs(getattr(gm, region.args[1].target))
    for i, operand in enumerate(region.args[2:]):
        val = operand.meta.get("val") if isinstance(operand, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.requires_grad and i not in written:
            with gm.graph.inserting_before(region):
                _detach_for(gm.graph, operand, [region], after=None)


def _detach_for(graph: fx.Graph, value: fx.Node, readers, *, after: fx.Node | None) -> None:
    """`value` detached, read by `readers` in its place (inserted after `after`, or at the graph's cursor)."""
    with graph.inserting_after(after) if after is not None else contextlib.nullcontext():
        detached = graph.call_function(aten.detach.default, (value,))
    if isinstance(value.meta.get("val"), torch.Tensor):
        detached.meta["val"] = value.meta["val"].detach()
    for user in readers:
        user.replace_input_with(value, detached)


_RECURRENT = {   # op -> (its hidden state is a list (LSTM: h and c), its input is packed (data, batch_sizes))
    aten.lstm.input: (True, False), aten.gru.input: (False, False),
    aten.rnn_tanh.input: (False, False), aten.rnn_relu.input: (False, False),
    aten.lstm.data: (True, True), aten.gru.data: (False, True),
    aten.rnn_tanh.data: (False, True), aten.rnn_relu.data: (False, True),
}


def write_out_recurrent_dropouts(gm: fx.GraphModule) -> None:
    """Every multi-layer recurrent op of the exported graph that drops between its layers (LSTM(num_layers=3,
    dropout=p) in train mode), in place, as one call per layer with `aten.dropout` between them, as ATen's own
    kernel runs it (aten/src/ATen/native/RNN.cpp: the dropout of each layer's sequence-first output but the
    last). torch's decomposition of these ops, which aot's joint trace uses, never drops: the training step
    would silently train without the dropout. Written as `aten.dropout`, the draw is the one nn.Dropout makes,
    and evaluation switches it off as it does nn.Dropout's."""
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _RECURRENT]:
        bound = bound_arguments(node)
        if (bound["num_layers"] > 1 and bound["dropout"] > 0 and bound["train"]
                and all(u.target is operator.getitem for u in node.users)):
            with gm.graph.inserting_before(node):
                results = _layer_by_layer(_Writer(gm.graph, node), node.target, bound)
            for user in list(node.users):
                user.replace_all_uses_with(results[user.args[1]])
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    gm.recompile()


def bound_arguments(node: fx.Node) -> dict:
    """The node's arguments by their schema names, defaults filled in."""
    args = op_schema(node.target).arguments
    return {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            for i, a in enumerate(args)}


def _layer_by_layer(call: "_Writer", op, bound: dict) -> list[fx.Node]:
    """The results of recurrent `op` (output, h_n[, c_n]) computed one layer at a time, with dropout between."""
    lstm, packed = _RECURRENT[op]
    layers, directions = bound["num_layers"], 2 if bound["bidirectional"] else 1
    params = list(bound["params"])
    per_layer = len(params) // layers
    states = list(bound["hx"]) if lstm else [bound["hx"]]
    x, finals = bound["data" if packed else "input"], [[] for _ in states]
    for i in range(layers):
        hx = [call(aten.slice.Tensor, h, 0, i * directions, (i + 1) * directions) for h in states]
        layer = {**bound, "hx": hx if lstm else hx[0], "params": params[i * per_layer:(i + 1) * per_layer],
                 "num_layers": 1, "dropout": 0.0}
        if packed:
            layer["data"] = x
        else:
            layer["input"] = x
        out = call(op, *(layer[a.name] for a in op_schema(op).arguments))
        x = call(operator.getitem, out, 0)
        for k, final in enumerate(finals):
            final.append(call(operator.getitem, out, k + 1))
        if i < layers - 1:
            x = _dropped(call, x, bound["dropout"], batch_first=not packed and bound["batch_first"])
    return [x, *(call(aten.cat.default, final, 0) for final in finals)]


def _dropped(call: "_Writer", x: fx.Node, p: float, *, batch_first: bool) -> fx.Node:
    """`aten.dropout` of a layer's output in train mode, drawn over its sequence-first layout as ATen's kernel
    draws it."""
    if not batch_first:
        return call(aten.dropout.default, x, p, True)
    seq_first = call(aten.transpose.int, x, 0, 1)
    return call(aten.transpose.int, call(aten.dropout.default, seq_first, p, True), 0, 1)


class _Writer:
    """Appends aten calls to a graph, each carrying the replaced node's meta (its module, for errors)."""

    def __init__(self, graph: fx.Graph, like: fx.Node) -> None:
        self.graph, self.meta = graph, {k: v for k, v in like.meta.items() if k != "val"}

    def __call__(self, op, *args) -> fx.Node:
        node = self.graph.call_function(op, args)
        node.meta.update(self.meta)
        return node


def _dropout(call: _Writer, x: fx.Node, p: float, train: bool, val: torch.Tensor, *, feature: bool,
             alpha: bool) -> fx.Node:
    """ATen's `_dropout_impl` (aten/src/ATen/native/Dropout.cpp), its mask drawn by native_dropout, the result
    the input wherever that draw ran in eval mode."""
    if p == 0 or not train or val.numel() == 0:
        return x
    shape = [*val.shape[:2], *(1,) * (val.dim() - 2)] if feature else list(val.shape)
    drawn = call(aten.native_dropout.default, call(aten.new_ones.default, x, shape), p, True)
    scaled, kept = call(operator.getitem, drawn, 0), call(operator.getitem, drawn, 1)
    trained = call(aten.logical_or.default, call(aten.ne.Scalar, scaled, 1),
                   call(aten.logical_not.default, kept))
    if p == 1:
        out = call(aten.mul.Scalar, x, 0)
    else:
        noise = call(aten.to.dtype, kept, val.dtype)
        if alpha:
            a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
            b = call(aten.add.Scalar, call(aten.mul.Scalar, call(aten.sub.Scalar, noise, 1), _ALPHA * a),
                     _ALPHA * a * p)
            out = call(aten.add.Tensor, call(aten.mul.Tensor, x, call(aten.mul.Scalar, noise, a)), b)
        else:
            out = call(aten.mul.Tensor, x, call(aten.div.Scalar, noise, 1 - p))
    return call(aten.where.self, trained, out, x)


_DROPOUTS = {   # op -> (feature: one draw per channel, alpha: SELU's alpha dropout, in place)
    aten.feature_dropout.default: (True, False, False),
    aten.alpha_dropout.default: (False, True, False),
    aten.feature_alpha_dropout.default: (True, True, False),
    aten.feature_dropout_.default: (True, False, True),
    aten.alpha_dropout_.default: (False, True, True),
    aten.feature_alpha_dropout_.default: (True, True, True),
}
DECOMPOSITIONS = {aten.instance_norm.default: _instance_norm}
