"""The trace's own decompositions: ATen composites written out so that the step's graph can carry what the
composite hides, applied to the exported graph before `run_decompositions`.

    DECOMPOSITIONS: instance_norm               its running-statistic updates, as copies into the buffers
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

import math
import operator

import torch
from torch import fx

__all__ = ["DECOMPOSITIONS", "write_out_dropouts"]

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
