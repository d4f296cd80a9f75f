"""F and BW from the min-cut partition (step 2 of the split): aot's forward and backward graphs renamed to the
stage IR's value names (inputs by name, saved:*, grad:*), with the pass-throughs wired in by hand."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import fx

from zbcompile.errors import SplitError
from zbcompile.ir.names import Role, role_of
from zbcompile.ir.stages import Graph
from zbcompile.passes.split_fbw.common import _aten, _identifier, _placeholder

__all__ = ["_forward_graph", "_backward_graph"]


def _forward_graph(stage: Graph, fw: fx.GraphModule, diff_names) -> tuple[Graph, dict[str, str]]:
    """F with named inputs; outputs = stage outputs, pass-throughs, then saved:*. Returns saved renames too."""
    primals = {ph.name: ph for ph in fw.graph.find_nodes(op="placeholder")}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, name in enumerate(stage.inputs):
        ph = g.placeholder(_identifier(name))
        old = primals.get(f"primals_{i + 1}")
        if old is not None:
            ph.meta = dict(old.meta)
            env[old] = ph
        else:  # min-cut drops unused primals; F still takes every stage input by name
            ph.meta = dict(_placeholder(stage.gm, i).meta)
    if len(env) != len(primals):
        raise SplitError(f"stage {stage.index}: unexpected forward placeholders {sorted(primals)}")
    for node in fw.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = g.node_copy(node, lambda n: env[n])
    fw_outs = list(fw.graph.output_node().args[0])
    k = len(diff_names)
    results = [env[n] for n in fw_outs[:k]]
    if "loss" in diff_names:
        results[diff_names.index("loss")] = _own_scalar(g, results[diff_names.index("loss")])
    by_input = dict(zip(stage.inputs, g.find_nodes(op="placeholder")))
    results += [by_input[p] for p in stage.passthrough]
    saved: dict[str, str] = {}
    for node in fw_outs[k:]:
        if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            raise SplitError(f"stage {stage.index}: the forward saves a non-tensor value {node!r} (dynamic shapes?)")
        saved[node.name] = f"saved:{env[node].name}"
        results.append(env[node])
    g.output(tuple(results))
    gm = fx.GraphModule(fw, g, class_name=f"Stage{stage.index}F")
    names = tuple(diff_names) + stage.passthrough + tuple(saved.values())
    return Graph(gm, stage.inputs, names), saved


def _backward_graph(stage, bw: fx.GraphModule, saved: Mapping[str, str], tangents: Sequence[str], in_rg,
                    device: torch.device | None = None) -> Graph:
    """BW with named inputs (saved:*, grad:<output>) and outputs (grad:<input> for the differentiable inputs a
    gradient reaches). `device` replaces the meta device of inputs traced on meta."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names: list[str] = []
    bw_placeholders = list(bw.graph.find_nodes(op="placeholder"))
    tangent_nodes = [ph for ph in bw_placeholders if ph.name.startswith("tangents")]
    if len(tangent_nodes) != len(tangents):
        raise SplitError(
            f"stage {stage.index}: the backward takes {len(tangent_nodes)} output grads, expected {len(tangents)}"
        )
    tangent_of = dict(zip(tangent_nodes, tangents))
    for ph in bw_placeholders:
        name = tangent_of.get(ph) or saved.get(ph.name)
        if name is None:
            raise SplitError(f"stage {stage.index}: backward input `{ph.name}` is neither saved nor a grad")
        env[ph] = g.placeholder(_identifier(name))
        env[ph].meta = dict(ph.meta)
        names.append(name)
    incoming = {}
    for p in stage.passthrough:
        if in_rg[p]:  # the grad coming back from the next stage for a value we only forwarded
            incoming[p] = g.placeholder(_identifier(f"grad:{p}"))
            incoming[p].meta = dict(_placeholder(stage.gm, stage.inputs.index(p)).meta)
            names.append(f"grad:{p}")
    for node in bw.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = g.node_copy(node, lambda n: env[n])
    grads = list(bw.graph.output_node().args[0])
    out_names, results = [], []
    for name, grad in zip(stage.inputs, grads, strict=True):
        value = env[grad] if isinstance(grad, fx.Node) else None
        if name in incoming:
            value = incoming[name] if value is None else _add(g, value, incoming[name])
        if value is None:
            # (an activation that reaches none of this stage's graded outputs, read for its shape alone or through
            # an argmax, gets no gradient, as in eager: split_fbw then splits its sender again sending it without)
            continue
        if not in_rg[name]:
            raise SplitError(f"stage {stage.index}: the backward produces a grad for `{name}`, which needs none")
        if role_of(name) is Role.ACT:  # sent back to the previous stage: contiguous on the wire
            value = _contiguous(g, value)
        out_names.append(f"grad:{name}")
        results.append(value)
    g.output(tuple(results))
    return Graph(fx.GraphModule(bw, g, class_name=f"Stage{stage.index}BW"), tuple(names), tuple(out_names))


def _zeros(g: fx.Graph, like: torch.Tensor, device: torch.device | None) -> fx.Node:
    """A node of zeros shaped as `like` (contiguous), on `device` where `like` is on meta."""
    where = torch.device(device) if device is not None and like.device.type == "meta" else like.device
    node = g.call_function(_aten.zeros.default, (list(like.shape),),
                           {"dtype": like.dtype, "device": where, "pin_memory": False})
    node.meta["val"] = like.new_zeros(like.shape)
    return node


def _own_scalar(g: fx.Graph, loss: fx.Node) -> fx.Node:
    """A copy of the 0-dim loss in memory of its own. Some loss kernels return a view of their elementwise buffer
    (aten.mse_loss on CPU: 4 bytes visible, the batch's [N, D] held): the step keeps every microbatch's loss
    until it sums them, and that buffer with it, which no tensor size (nor the memory plan) shows."""
    val = loss.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        return loss
    out = g.call_function(_aten.clone.default, (loss,))
    out.meta["val"] = val.clone()
    return out


def _contiguous(g: fx.Graph, value: fx.Node) -> fx.Node:
    """`value`, or a contiguous copy of it where its traced layout (meta["val"], from aot's fake run) is not."""
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_contiguous():
        return value
    out = g.call_function(_aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    out.meta["val"] = val.contiguous()
    return out


def _add(g: fx.Graph, a: fx.Node, b: fx.Node) -> fx.Node:
    out = g.call_function(_aten.add.Tensor, (a, b))
    out.meta["val"] = a.meta.get("val")
    return out
