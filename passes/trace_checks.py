"""What a traced step is refused for, as TraceError, before the split works on it: steps that export accepts
but no pipeline can run, each named with the module that made it and what to write instead.

    check_example(flat)         an example argument with no rows (the example is one microbatch)
    check_step(graph, frozen)   a Python number read from a tensor (.item(), float(x)); a matmul or convolution of
                                mixed dtypes, class targets not int64 (eager refuses them; the trace's fake
                                tensors do not); a size that
                                depends on the data (nonzero, boolean indexing); a loss that reaches no trained
                                parameter

Each of these used to surface later, deep in the split, as torch's own exception or one about graph internals.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import fx

from zbcompile.errors import TraceError
from zbcompile.ir.names import Role, key_of, role_of
from zbcompile.ir.stages import Graph, module_path
from zbcompile.passes.graph_walk import ancestors
from zbcompile.passes.trace_decompositions import bound_arguments

__all__ = ["buffer_slots", "check_example", "check_state_sizes", "check_step", "update_reassigned_buffers"]

_aten = torch.ops.aten
_SCALAR_READS = (_aten._local_scalar_dense.default, _aten.item.default)
_DETACHES = (_aten.detach.default, _aten.detach_.default)
# ops whose tensor arguments must share a dtype in eager ("mat1 and mat2 must have the same dtype"), which the
# fake tensors of the trace let through (an int64 input into nn.Linear traced, then failed in the first step)
_SAME_DTYPE = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "addmv", "dot", "conv1d",
                         "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
                         "conv_transpose3d"})


def check_example(flat) -> None:
    """TraceError for an example tensor with no rows, or no first dimension to split: the example is one
    microbatch, and every batch is split into microbatches along the first dimension of each tensor."""
    for i, t in enumerate(flat):
        if not t.dim():
            raise TraceError(f"example argument data:{i} is a 0-dimensional tensor ({t.dtype}): every tensor of "
                             "the batch is split into microbatches along its first dimension, and this one has "
                             "none. Give it one value per row (x.expand(rows), or [rows, 1]), or keep a setting "
                             "shared by every row in the model (a buffer, which the step reads as it is)")
        if t.shape[0] == 0:
            raise TraceError(f"example argument data:{i} has 0 rows ({list(t.shape)}): the example is one "
                             "microbatch of real data, at least one row (the batch given to step() is split into "
                             "microbatches of the example's shape)")


def check_not_inference(model: torch.nn.Module) -> None:
    """TraceError for a parameter or buffer made under torch.inference_mode(): an inference tensor cannot be
    saved for the backward nor updated in place outside that mode, so the model cannot be trained (export's own
    refusal is an opaque metadata assertion)."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        found = [n for n, t in named if t.is_inference()]
        if found:
            raise TraceError(f"{kind} {found[0]}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''} is an "
                             "inference tensor: the model was built under torch.inference_mode(), and such tensors "
                             "cannot be trained (eager's backward refuses them too). Build the model outside "
                             "inference_mode, or replace each with a copy made outside it (under "
                             "torch.inference_mode(False): p.data = p.clone())")


def check_step(graph: Graph, frozen: frozenset[str]) -> None:
    """TraceError for what no pipeline can run in the exported step (the module docstring)."""
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target in _SCALAR_READS:
            raise TraceError(f"{_where(node)} reads a Python number out of a tensor (.item(), float(t), int(t)): "
                             "the stages run as graphs, and such a number would be fixed at trace time or unknown; "
                             "keep it a tensor (x / x.abs().max() instead of x / x.abs().max().item())")
        dtypes = _mixed_dtypes(node)
        if dtypes:
            op = node.target.overloadpacket.__name__
            raise TraceError(f"{_where(node)} multiplies tensors of different dtypes ({', '.join(dtypes)}) in {op}, "
                             "which eager refuses (mat1 and mat2 must have the same dtype): give the example (and "
                             "the batches) the model's dtype, or cast in forward (x.float()); for ids, look them "
                             "up in an nn.Embedding first")
        target = _class_target_dtype(node)
        if target is not None:
            raise TraceError(f"{_where(node)} takes class targets of dtype {target} in "
                             f"{node.target.overloadpacket.__name__}, which eager refuses (expected target dtype "
                             "to be Long or Byte): give the targets as int64 (y.long()), in the example and the "
                             "batches")
        if node.op == "call_function" and getattr(node.target, "name", lambda: "")() in _CONTROL_FLOW:
            raise TraceError(f"{_where(node)} runs torch.{node.target.name()}, a branch or loop taken on the data "
                             "at run time: the stages' graphs are split into F, B and W graphs op by op, which a "
                             "graph holding subgraphs cannot be; compute both sides and select with torch.where")
        size = _data_dependent(node)
        if size is not None:
            raise TraceError(f"{_where(node)} makes a tensor whose size depends on the data ({size}: "
                             "torch.nonzero, boolean-mask indexing, unique ...): pipeline stages exchange tensors "
                             "of sizes fixed at compile; use a fixed-size form (torch.where, a multiplied mask)")
    _check_loss_trains(graph, frozen)


# torch's control-flow operators (higher-order ops holding subgraphs), by name
_CONTROL_FLOW = frozenset({"cond", "while_loop", "map_impl", "scan", "associative_scan"})


def _check_loss_trains(graph: Graph, frozen: frozenset[str]) -> None:
    """The loss must reach a trained parameter through ops that carry a gradient (not through a detach)."""
    names = {node: name for name, node in graph.input_nodes().items()}
    out = graph.gm.graph.output_node().args[0]
    loss = out[graph.outputs.index("loss")]
    reached = ancestors([loss], through=lambda n: n.target not in _DETACHES)
    trained = [n for n in reached if n.op == "placeholder" and role_of(names[n]) is Role.PARAM
               and key_of(names[n]) not in frozen]
    if not trained:
        raise TraceError("the loss does not depend on any trained parameter: nothing would get a gradient (eager's "
                         "backward() raises here too). Is the model's output detached in loss_fn (.detach(), "
                         ".item(), torch.no_grad()), or is every parameter frozen (requires_grad=False)?")


def _mixed_dtypes(node: fx.Node) -> list[str]:
    """The dtypes of a matmul / convolution's tensor arguments where they differ, else []."""
    target = node.target
    if node.op != "call_function" or getattr(getattr(target, "overloadpacket", None), "__name__", "") \
            not in _SAME_DTYPE:
        return []
    dtypes = [str(v.dtype).removeprefix("torch.") for v in (a.meta.get("val") for a in node.all_input_nodes)
              if isinstance(v, torch.Tensor)]
    return sorted(set(dtypes)) if len(set(dtypes)) > 1 else []


# the losses whose class-index targets eager takes as int64 (or uint8) only; their decompositions take any integer
_CLASS_TARGETS = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d",
                            "nll_loss2d_forward", "nll_loss_nd"})


def _class_target_dtype(node: fx.Node) -> str | None:
    """The dtype of a classification loss's integer targets where eager refuses it (int32, int16 ...)."""
    packet = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    if node.op != "call_function" or packet not in _CLASS_TARGETS or len(node.args) < 2:
        return None
    val = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.is_floating_point() or val.dtype in (torch.int64, torch.uint8):
        return None
    return str(val.dtype).removeprefix("torch.")


def _data_dependent(node: fx.Node) -> str | None:
    """The shape of `node`'s value where a size in it is symbolic (an unbacked size export made for data-dependent
    output), else None."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for v in vals:
        if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape):
            return f"shape {list(v.shape)}"
    return None


# frames of torch and of zbcompile itself (passes/, zbcompile/): the user's line is the innermost other one
_NOT_USERS = (f"{os.sep}torch{os.sep}", os.path.dirname(os.path.abspath(__file__)) + os.sep,
              os.path.dirname(os.path.abspath(sys.modules[TraceError.__module__].__file__)) + os.sep)


def _where(node: fx.Node) -> str:
    """The module that made `node`, and the user's line of code where export recorded it."""
    path = [p for p in module_path(node) if p]
    where = f"module {path[-1]!r}" if path else "the model's forward (or loss_fn)"
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip()]
    files = [k for k, ln in enumerate(lines) if ln.startswith("File ")]
    own = [k for k in files if not any(part in lines[k] for part in _NOT_USERS)]   # not torch.nn's, not ours
    if own:   # the innermost frame: `File "...", line N, in forward` then its source line
        k = own[-1]
        where += f" ({lines[k]}: {lines[k + 1]})" if k + 1 < len(lines) else f" ({lines[k]})"
    return where


def check_state_sizes(gm: fx.GraphModule) -> None:
    """TraceError for an op of the exported step that resizes state to another shape: `resize_` to a size its
    tensor does not have, a per-channel fused observer (QAT's FusedMovingAvgObsFakeQuantize before calibration)
    whose statistics do not have one entry per channel yet. The kernel resizes its buffers as it runs, which
    the trace does not see: the stage graphs would be traced for the old shape."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.resize_.default):
        val = node.args[0].meta.get("val")
        if isinstance(val, torch.Tensor) and tuple(val.shape) != tuple(node.args[1]):
            _refuse_resize(node, f"resizes a tensor of shape {tuple(val.shape)} to {tuple(node.args[1])}")
    fused = torch.ops.aten.fused_moving_avg_obs_fake_quant.default
    for node in gm.graph.find_nodes(op="call_function", target=fused):
        args = bound_arguments(node)   # (per_row_fake_quant given by keyword, or left at its default)
        if not args["per_row_fake_quant"]:
            continue
        channels = args["self"].meta["val"].shape[args["ch_axis"]]
        sizes = [args[k].meta["val"].numel() for k in ("running_min", "running_max", "scale", "zero_point")]
        if any(n != channels for n in sizes):
            _refuse_resize(node, f"holds {sizes[0]} running minima for {channels} channels (an observer not "
                                 "calibrated yet: it sizes its statistics on its first call)")


def _refuse_resize(node: fx.Node, what: str) -> None:
    paths = [p for p in module_path(node) if p]
    where = f"module `{paths[-1]}`" if paths else "the model"
    raise TraceError(
        f"the training step changes the shape of its state in {where}: `{node.target}` {what}. The pipeline's "
        "graphs are traced for one shape. Run the model once in eager before compile (for quantization-aware "
        "training: one calibration forward), so the state has its final shape")


def buffer_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of every buffer of `model`, as it is before the traced forward."""
    return [(m, name, t) for m in model.modules() for name, t in m._buffers.items() if t is not None]


def update_reassigned_buffers(slots) -> None:
    """Inside the traced step, after the model's forward: each buffer the forward reassigned (`self.ema = 0.9 *
    self.ema + 0.1 * x.mean(0)`) put back, with the new value copied into it in place. Export records an
    in-place update as the step's new value of the buffer, but drops a reassignment: the update would be lost
    after every step, silently. A new value of another shape is refused: each stage graph is traced for the
    buffer as it is; one of another dtype or device (a cast cache) is left as export has it."""
    for module, name, old in slots:
        new = module._buffers.get(name)
        if new is old or not isinstance(new, torch.Tensor):
            continue
        if new.shape != old.shape:
            raise TraceError(
                f"the training step reassigns buffer `{name}` of {type(module).__name__} with a tensor of shape "
                f"{tuple(new.shape)} where it holds {tuple(old.shape)}; the pipeline's graphs are traced for one "
                "shape. Keep the buffer's shape (update it in place: `self.buf.copy_(new)`), or give it its final "
                "shape before compile (run the model once in eager)")
        if (new.dtype, new.device) != (old.dtype, old.device):
            # a cache cast to the input's dtype or moved to its device (`self.cos = self.cos.to(x.dtype)`): each
            # step's graph makes the same conversion of the buffer as it is, and reads that
            continue
        module._buffers[name] = old
        with torch.no_grad():
            old.copy_(new)

