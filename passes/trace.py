"""Pass 1, trace: capture one training step `loss_fn(model(*inputs), *targets)` as a functional ATen graph.

    model, loss_fn, example  ->  Traced(graph=Graph(gm, inputs, outputs), tied, frozen, ...)   (zbcompile.ir.stages)

Route (see the F/B/W notes): non-strict `torch.export.export` of a wrapper module, then `run_decompositions`,
which only functionalizes (and writes out instance_norm and the feature / alpha dropouts:
passes/trace_decompositions.py): BatchNorm statistic updates become graph outputs while linear / SDPA /
layer_norm stay high level. Before it, what a `torch.no_grad()` region computes is detached where
the step reads it, and while exporting a custom autograd.Function becomes an op that keeps its backward
(passes/functions.py). Every placeholder of the result is named by its value name:

    param:<fqn>    one placeholder per Parameter *object*; tied aliases are merged onto the canonical
                   (first registered) name and recorded in `Traced.tied`
    buffer:<fqn>   buffers, by FQN in the user's model
    data:<i>       flat user arguments: model inputs first, then loss targets

Lifted tensor constants (tensors created by `torch.tensor(...)` inside forward) become `get_attr` nodes, so
later passes treat them like any other constant. The outputs are `loss` followed by `buffer:<fqn>` for each
buffer the step updates. Parameters are never baked in: the graph reads them through placeholders, so a
runtime can pass the live `nn.Parameter`s by name, and a model built on the meta device traces the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import threading
import warnings
from typing import Callable, Mapping

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind

from zbcompile._torch_private import tree_map
from zbcompile.errors import TraceError
from zbcompile.ir.names import Role, role_of
from zbcompile.ir.stages import Constant, Graph, ModelOutputs, Partition, Traced
from zbcompile.passes.functions import functions_as_ops
from zbcompile.passes.trace_checks import (buffer_slots, check_example, check_not_inference, check_state_sizes,
                                           check_step, update_reassigned_buffers)
from zbcompile.passes.trace_decompositions import (DECOMPOSITIONS, detach_no_grad_regions, write_out_dropouts,
                                                   write_out_recurrent_dropouts)
from zbcompile.passes.trace_explain import explain_export_failure, explain_mutation, signature_problem

__all__ = ["trace", "flatten_example", "input_keywords", "retarget_device", "retarget_stages"]

_WRAPPED = "model"  # the user's model is the `model` child of the exported wrapper


class _Step(nn.Module):
    """The exported wrapper: `forward(*flat) = loss_fn(model(*flat[:n]), *flat[n:])`, the model's inputs
    passed by keyword instead when `keywords` names them (a dict of inputs in the example)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, num_inputs: int, keywords: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "_loss_fn", loss_fn)  # not a submodule: its state is no model state
        self._num_inputs = num_inputs
        self._keywords = keywords
        # what the model returned, kept through a function (export traces with copies of the module's attributes
        # in place, and puts the originals back): per output leaf the names of the parameter or buffer it is, and
        # the output tree (a pytree spec)
        kept: dict = {"returned": [], "tree": None}
        self.returned = lambda: list(kept["returned"])
        self.tree = lambda: kept["tree"]
        object.__setattr__(self, "_keep", kept.update)

    def forward(self, *flat: torch.Tensor) -> torch.Tensor:
        inputs, targets = flat[: self._num_inputs], flat[self._num_inputs :]
        slots = buffer_slots(self.model)
        if self._keywords:
            out = self.model(**dict(zip(self._keywords, inputs)))
        else:
            out = self.model(*inputs)
        update_reassigned_buffers(slots)
        self._keep(returned=_state_returned(self.model, out), tree=torch.utils._pytree.tree_structure(out))
        return self._loss_fn(out, *targets)


def _state_returned(model: nn.Module, out) -> list[frozenset]:
    """Per leaf of the model's output tree, the value names (param:<fqn>, buffer:<fqn>) of the parameter or
    buffer it is, itself (a CLIP model returning its logit_scale); empty for anything else. export's signature
    names some parameter also where an output is dead, so only these are taken as returned state."""
    names: dict[int, set] = {}
    for prefix, items in (("param:", model.named_parameters(remove_duplicate=False)),
                          ("buffer:", model.named_buffers(remove_duplicate=False))):
        for n, t in items:
            names.setdefault(id(t), set()).add(prefix + n)
    return [frozenset(names.get(id(leaf), ())) for leaf in torch.utils._pytree.tree_leaves(out)]


def flatten_example(example) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """`(inputs, targets)`, each a tensor, a tuple of tensors or (inputs only) a dict of keyword arguments ->
    (flat args, num_inputs, num_targets); a dict's tensors go in its order (`input_keywords`)."""
    if not (isinstance(example, (tuple, list)) and len(example) == 2):
        raise TraceError(
            "example must be a pair (inputs, targets), each a tensor or a tuple of tensors (inputs may be a dict "
            f"of keyword arguments); got {type(example).__name__}"
        )
    if isinstance(example[1], dict):   # loss_fn(outputs, *targets) would take its values by position
        raise TraceError(f"example's targets are a dict (keys {list(example[1])}), but loss_fn is called with the "
                         "targets by position, loss_fn(outputs, *targets), which would bind them in the dict's "
                         "order, not by name: give the targets as a tuple in loss_fn's order, or bind them by name "
                         "in a wrapper (lambda out, y, w: loss(out, y=y, w=w))")
    for x, part in zip(example, ("inputs", "targets")):
        if not isinstance(x, (torch.Tensor, tuple, list, dict)):
            raise TraceError(f"example's {part} are {type(x).__name__!r}: each part of the pair (inputs, targets) "
                             "is a tensor or a tuple of tensors (inputs may be a dict of keyword arguments); a loss "
                             "without targets takes an empty tuple, example=(inputs, ())")
    parts = [(x,) if isinstance(x, torch.Tensor) else tuple(x.values()) if isinstance(x, dict) else tuple(x)
             for x in example]
    flat = parts[0] + parts[1]
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"example argument data:{i} is a {type(x).__name__}, not a tensor: every input and "
                             "target is a tensor split into microbatches. Bind a constant argument in the model "
                             "(functools.partial of its forward, or a wrapper module) or the loss_fn, or pass it "
                             "as a tensor (torch.tensor(value), one per row if it changes per sample)")
    return _distinct(flat), len(parts[0]), len(parts[1])


def _distinct(flat: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The example's tensors as a step hands them to the stage graphs:

    - contiguous: the runtime stages every microbatch in a contiguous buffer, so a trace on the example's own
      layout (a slice `batch[:, :-1]`, a channels_last image) would fix strides the graphs never see: frames cut
      by `x.as_strided(..., x.stride(0), ...)` read other samples, a `reshape` after a permute traced as a
      `view` fails;
    - a copy where one object comes again (`example=(x, x)`): export makes one graph input of a repeated object,
      so the step would read one batch argument where the model reads the other (the targets fed to the model).
      Each argument of a step is its own tensor; only the example's values are shared."""
    seen: set[int] = set()
    out = []
    for x in flat:
        out.append(x.clone(memory_format=torch.contiguous_format) if id(x) in seen else x.contiguous())
        seen.add(id(x))
    return tuple(out)


def input_keywords(example) -> tuple[str, ...]:
    """The keyword names of the model's inputs when the example gives them as a dict, in the flat order of
    `flatten_example` (data:0, data:1, ...: the order a batch is passed to a step in); () otherwise."""
    inputs = example[0] if isinstance(example, (tuple, list)) and len(example) == 2 else None
    if not isinstance(inputs, dict):
        return ()
    bad = [k for k in inputs if not isinstance(k, str)]
    if bad:
        raise TraceError(f"example inputs given as a dict must be keyword arguments named by strings; got {bad}")
    return tuple(inputs)


def trace(model: nn.Module, loss_fn: Callable, example) -> Traced:
    """Export `loss_fn(model(*inputs), *targets)`; see the module docstring for the result's naming."""
    flat, num_inputs, num_targets = flatten_example(example)
    check_example(flat)
    check_not_inference(model)
    _refuse_trained_loss_state(model, loss_fn)
    device = None
    if any(p.is_meta for p in model.parameters()):
        # a model built on the meta device traces with meta data: nothing is ever computed
        device = next((x.device for x in flat if not x.is_meta), torch.device("cpu"))
        flat = tuple(x.to("meta") for x in flat)
    ep, unknown, returned, tree = _export(model, loss_fn, flat, num_inputs, input_keywords(example))
    aliases = _tied_groups(model)
    graph = _name_values(ep, aliases)
    frozen = frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
    check_step(graph, frozen)
    return Traced(graph, num_inputs, num_targets, tuple(aliases.values()), frozen, device,
                  _model_outputs(ep, graph, returned), unknown, tree)


def retarget_stages(cut: Partition) -> Partition:
    """A split pass: for a step traced on meta, stage graphs whose tensor factories use the example's device.

    Autograd cannot trace meta tensors, so the stages are differentiated on `traced.device`; a step traced on
    a real device passes through unchanged (the same Partition).
    """
    device = cut.traced.device
    if device is None:
        return cut
    stages = tuple(dataclasses.replace(st, gm=retarget_device(st.gm, device)) for st in cut.stages)
    return dataclasses.replace(cut, stages=stages)


def retarget_device(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of `gm` whose factory calls (`device=meta`) create tensors on `device`; meta["val"] is kept."""
    meta = torch.device("meta")

    def swap(x):
        return device if isinstance(x, torch.device) and x == meta else x

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = g.node_copy(node, lambda n: env[n])
        if node.op == "call_function":
            new.args, new.kwargs = tree_map(swap, (new.args, new.kwargs))
        env[node] = new
    out = fx.GraphModule(gm, g, class_name=type(gm).__name__)
    for node in g.find_nodes(op="get_attr"):
        _retarget_constant(out, node.target, device)
    return out


def _retarget_constant(gm: fx.GraphModule, target: str, device: torch.device) -> None:
    """A tensor constant the meta trace made (HuggingFace's key-value cache starts as one) on `device`: an
    empty one as it is; one with values is refused, since a meta tensor has none."""
    owner, _, name = target.rpartition(".")
    holder = gm.get_submodule(owner) if owner else gm
    value = getattr(holder, name, None)
    if not isinstance(value, torch.Tensor) or not value.is_meta:
        return
    if value.numel():
        raise TraceError(f"the model, built on the meta device, makes a tensor constant of shape "
                         f"{list(value.shape)} in its forward ({target}): on meta it has no values, so the stages "
                         "could not compute with it. A HuggingFace model's key-value cache is one: compile it with "
                         "use_cache=False (config.use_cache = False); otherwise make the tensor a buffer, which "
                         "init_fn fills, or build the model on a real device")
    setattr(holder, name, torch.empty(value.shape, dtype=value.dtype, device=device))


def _export(model: nn.Module, loss_fn: Callable, flat, num_inputs: int,
            keywords: tuple[str, ...] = ()) -> tuple[torch.export.ExportedProgram, str, list[frozenset], object]:
    """The exported step, why it does not keep the model's call signature ("" where it does), which output
    leaves are the model's parameters or buffers themselves (_state_returned), and the model's output tree."""
    step = _Step(model, loss_fn, num_inputs, keywords)
    # one export at a time in a process: non-strict export patches nn.Module.__call__ and torch functions for
    # the whole process while it traces, so ranks run as threads (the loopback world: each rank's first
    # evaluate() in eval mode traces its eval check) could see each other's patches mid-trace
    with _EXPORTING:
        return _export_locked(step, model, flat)


_EXPORTING = threading.RLock()


def _export_locked(step: _Step, model: nn.Module, flat):
    try:
        # a custom autograd.Function keeps its backward (passes/functions.py); an op that fails on the fake
        # tensors (an example of the wrong shape) is our TraceError below, without fake_tensor's logged tracebacks
        with functions_as_ops(), _quiet("torch._subclasses.fake_tensor"):
            return (*_export_step(step, flat), step.returned(), step.tree())
    except TraceError:
        raise
    except Exception as exc:  # torch raises many types here; ours names the module and the fix
        raise TraceError(explain_export_failure(exc, model)) from exc


@contextlib.contextmanager
def _quiet(logger: str):
    """`logger` silent below CRITICAL inside the block (a filter of the block's own, not the logger's level: two
    threads tracing at once cannot leave it silenced)."""
    log = logging.getLogger(logger)

    def critical_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL

    log.addFilter(critical_only)
    try:
        yield
    finally:
        log.removeFilter(critical_only)


def _export_step(step: nn.Module, flat) -> tuple[torch.export.ExportedProgram, str]:
    try:
        # the model's call signature kept: which graph values are the model's outputs (forward outputs of an
        # evaluation step, PipelineModule.forward); the graph itself is the same as without it
        return _decomposed(torch.export.export(step, tuple(flat), strict=False,
                                               preserve_module_call_signature=(_WRAPPED,))), ""
    except TraceError:
        raise
    except Exception as exc:
        # a model whose call signature export cannot keep still trains; nor can the decompositions keep it where
        # a model output the loss does not read is made by a plain op (`return logits, logits.argmax(-1)`): they
        # drop that dead op, and torch then finds the signature naming a value that is gone
        return _decomposed(torch.export.export(step, tuple(flat), strict=False)), signature_problem(exc)


def _decomposed(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    check_state_sizes(ep.graph_module)
    detach_no_grad_regions(ep.graph_module)
    write_out_recurrent_dropouts(ep.graph_module)
    write_out_dropouts(ep.graph_module)
    items = _output_items(ep)
    with warnings.catch_warnings():
        # torch 2.13's own run_decompositions trips its LeafSpec deprecation; nothing a user can act on
        warnings.filterwarnings("ignore", message=".*LeafSpec.* is deprecated", category=FutureWarning)
        out = ep.run_decompositions(DECOMPOSITIONS)
    out.graph_module.meta[_RENAMED] = _items_renamed(out, items)
    return out


_RENAMED = "zbcompile_output_names"   # the model outputs' names in the decomposed graph, where they moved


def _output_items(ep) -> dict[str, tuple[str, int]]:
    """Each model output the call signature names that is an item of a multi-result op (a custom Function's
    result: `getitem(op, 0)`), as (the op's name, the index). run_decompositions numbers the getitems anew but
    keeps the signature's names: `getitem_1` may then be another value (the loss's)."""
    entry = next((e for e in ep.module_call_graph if e.fqn == _WRAPPED and e.signature is not None), None)
    nodes = {n.name: n for n in ep.graph.nodes}
    out = {}
    for arg in entry.signature.outputs if entry is not None else ():
        node = nodes.get(getattr(arg, "name", None))
        if node is not None and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            out[node.name] = (node.args[0].name, node.args[1])
    return out


def _items_renamed(ep, items: dict[str, tuple[str, int]]) -> dict[str, str]:
    """The names `items` (_output_items) have in the decomposed `ep`."""
    where = {(n.args[0].name, n.args[1]): n.name for n in ep.graph.nodes
             if n.target is operator.getitem and isinstance(n.args[0], fx.Node)}
    return {old: where[item] for old, item in items.items() if item in where}


def _model_outputs(ep, graph: Graph, returned: list[frozenset]) -> ModelOutputs | None:
    """The model's outputs in the traced step, from the call signature export kept (None where it kept none):
    each tensor leaf by the name of the value it is (a node's name, or a placeholder's value name: a parameter
    or buffer the model returns itself, `returned`), any other leaf as its constant, and the tree they flatten
    from."""
    entry = next((e for e in ep.module_call_graph if e.fqn == _WRAPPED and e.signature is not None), None)
    if entry is None:
        return None
    names = dict(zip((n.name for n in graph.gm.graph.find_nodes(op="placeholder")), graph.inputs))
    nodes = {n.name for n in graph.gm.graph.nodes}
    renamed = ep.graph_module.meta.get(_RENAMED, {})
    leaves: list = []
    for arg in entry.signature.outputs:
        name = renamed.get(getattr(arg, "name", None), getattr(arg, "name", None))
        value = names.get(name, name)
        # export's signature also names a parameter or buffer where the value was removed as dead (the loss
        # does not read it): it is the leaf only where the model returned that very tensor
        state = role_of(value) in (Role.PARAM, Role.BUFFER) if isinstance(value, str) else False
        k = len(leaves)
        if type(arg).__name__ == "TensorArgument" and name in nodes and (
                not state or value in (returned[k] if k < len(returned) else ())):
            leaves.append(value)
        elif type(arg).__name__ == "ConstantArgument":
            leaves.append(Constant(arg.value))
        else:   # a symbolic size, or a value the step never computes (the loss does not read it)
            leaves.append(Constant(None, missing=f"leaf {len(leaves)} of its output tree"))
    return ModelOutputs(tuple(leaves), entry.signature.out_spec)


def _refuse_trained_loss_state(model: nn.Module, loss_fn: Callable) -> None:
    """A loss function holding trainable parameters that are not the model's (a learned temperature, multi-task
    weights): export would lift them as constants, which no optimizer step could change, silently."""
    mine = {id(p) for p in model.parameters()}
    found: dict[int, str] = {}
    for name, obj in _held_by(loss_fn):
        pairs = [(name, obj)] if isinstance(obj, nn.Parameter) else \
            [(f"{name}.{n}", p) for n, p in obj.named_parameters()] if isinstance(obj, nn.Module) else []
        found.update({id(p): n for n, p in pairs if p.requires_grad and id(p) not in mine and id(p) not in found})
    if found:
        raise TraceError(f"loss_fn holds trainable parameters that are not the model's ({', '.join(found.values())}): "
                         "the pipeline trains the model's parameters only, and would use these as constants. Move "
                         "them into the model (a last module applying them to its output) or freeze them "
                         "(requires_grad_(False))")


def _held_by(fn, depth: int = 0):
    """(name, object) pairs a loss function holds: itself if a module, a bound method's object, a partial's
    function and arguments, a closure's cells, the globals it names."""
    if depth > 3:
        return
    if isinstance(fn, nn.Module):
        yield type(fn).__name__, fn
        return
    if getattr(fn, "__self__", None) is not None:
        yield type(fn.__self__).__name__, fn.__self__
    inner = getattr(fn, "func", None)   # functools.partial
    if inner is not None:
        yield from _held_by(inner, depth + 1)
        yield from ((f"argument {i}", a) for i, a in enumerate((*getattr(fn, "args", ()),
                                                                  *getattr(fn, "keywords", {}).values())))
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars if code else (), cells):
        try:
            yield name, cell.cell_contents
        except ValueError:   # a cell not filled yet
            continue
    names = getattr(fn, "__globals__", {})
    yield from ((name, names[name]) for name in (code.co_names if code else ()) if name in names)


def _tied_groups(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(Parameter) -> all its names, canonical (first registered) first; only Parameters with aliases."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {k: tuple(v) for k, v in names.items() if len(v) > 1}


def _strip(fqn: str) -> str:
    if fqn == _WRAPPED:
        return ""
    if fqn.startswith(_WRAPPED + "."):
        return fqn[len(_WRAPPED) + 1 :]
    raise TraceError(f"state `{fqn}` does not belong to the model (does loss_fn own parameters or buffers?)")


def _name_values(ep, aliases: Mapping[int, tuple[str, ...]]) -> Graph:
    """The exported step as a Graph whose placeholders carry value names (see the module docstring)."""
    gm = ep.graph_module
    graph = gm.graph
    canonical = {alias: names[0] for names in aliases.values() for alias in names}
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    inputs: dict[str, str] = {}
    by_value: dict[str, fx.Node] = {}
    user_index = 0
    for spec in ep.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        if spec.kind == InputKind.PARAMETER:
            value = "param:" + canonical.get(_strip(spec.target), _strip(spec.target))
        elif spec.kind == InputKind.BUFFER:
            value = "buffer:" + _strip(spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            value = f"data:{user_index}"
            user_index += 1
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            _lift_constant(gm, node, ep.constants[spec.target])
            continue
        else:
            raise TraceError(f"unsupported input kind {spec.kind.name} for `{spec.target}` in the exported step")
        if value in by_value:  # a second placeholder for a tied Parameter: read the canonical one
            node.replace_all_uses_with(by_value[value])
            graph.erase_node(node)
            continue
        by_value[value] = node
        inputs[node.name] = value
    outputs = _name_outputs(ep)
    graph.lint()
    gm.recompile()
    return Graph(gm, tuple(inputs[n.name] for n in graph.find_nodes(op="placeholder")), outputs)


def _lift_constant(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor) -> None:
    attr = "_const_" + node.name
    gm.register_buffer(attr, value, persistent=False)
    with gm.graph.inserting_before(node):
        const = gm.graph.get_attr(attr)
    const.meta = dict(node.meta)
    node.replace_all_uses_with(const)
    gm.graph.erase_node(node)


def _name_outputs(ep) -> tuple[str, ...]:
    names = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            names.append("loss")
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            names.append("buffer:" + _strip(spec.target))
        else:
            raise TraceError(explain_mutation(ep, spec, len(names), _strip))
    if names.count("loss") != 1:
        raise TraceError(f"loss_fn must return one scalar tensor; the step returns {names.count('loss')} values")
    output = ep.graph.output_node()
    loss = output.args[0][names.index("loss")]
    val = loss.meta.get("val") if isinstance(loss, fx.Node) else loss
    if val is None:
        raise TraceError("loss_fn returned None (a `return` missing at its end?): return the loss, a scalar tensor")
    if not isinstance(val, torch.Tensor):
        raise TraceError(
            f"loss_fn must return the loss as a scalar tensor, got a {type(val).__name__} (a Python number, e.g. "
            "from .item() or float()); return the tensor itself: the backward starts from it")
    if val.dim() != 0:
        raise TraceError(
            f"loss_fn must return a scalar tensor, got shape {tuple(val.shape)}; reduce it (e.g. .mean()) inside "
            "loss_fn")
    if not val.is_floating_point():
        raise TraceError(f"loss_fn must return a floating-point scalar, got dtype {val.dtype}")
    return tuple(names)
