"""What a call of a PipelineModule is refused for before anything runs, each with a UsageError that says why and
what to do: a batch that is not what the compiled step takes, a step in a context it cannot honour, and the
model changed since compile (tensors converted or unfrozen, a module's mode or dropout, hooks added, a plain value
the traced code read); before tracing, hooks the compiled step would never call; and, from compile on, an optimizer
whose step combines every parameter's values (LBFGS) over a pipeline's parameters.

The compiled step is fixed when it is traced: the batch's shapes and dtypes (static P2P buffers), the autocast
region (the casts are in the graphs), which parameters have a gradient, every tensor's dtype and device (the
graphs and the messages). `Traced` keeps what a later call is compared against.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from zbcompile._torch_private import global_module_hooks
from zbcompile.distributed import PLACED
from zbcompile.errors import UsageError, ZBCompileWarning
from zbcompile.watch import Watched, watch_of

__all__ = ["Traced", "check_hooks", "check_kinds", "check_shapes", "check_step_context", "check_autocast",
           "check_default_dtype", "check_conversion", "nothing_trained"]


def nothing_trained(what: str) -> UsageError:
    """Every parameter of the model frozen since compile: seen before the step through the model (each rank sees
    every parameter's flag), or after it through the step's gather (frozen through pipe.parameters(), each rank
    its own)."""
    return UsageError(f"every parameter of the model has requires_grad=False now, so {what} (eager's "
                      "loss.backward() raises here: the loss does not require grad). Unfreeze what you mean to "
                      "train, or call pipe.evaluate(*batch) for the loss alone")


@dataclasses.dataclass(frozen=True)
class Traced:
    """A rank's share of the model as compiled: its parameters by requires_grad, every tensor's dtype and device."""

    frozen: tuple      # (name, parameter) without a gradient in the graphs
    trained: tuple     # (name, parameter) with one
    layouts: tuple     # (name, tensor, dtype, device, shape) of every parameter and buffer (of the model's too)
    modes: tuple = ()  # (name, module, its mode and dropout probability) of every module of the model
    hooks: tuple = ()  # (name, module or parameter, its hooks) of every module and parameter of the model
    watched: tuple = ((), (), (), (), (), (), ())   # what _quick reads: see `of`
    quick: tuple = ()  # _quick(*watched) at compile: what each call compares first
    slots: tuple = ()  # (name, module, dict name, key) of every submodule, parameter and buffer slot: `watched`'s
    watch: Watched = Watched()   # the plain values and tensors the traced code may have read (zbcompile.watch)
    trainable: bool = False      # some parameter of the model (any rank's) had requires_grad at compile

    @classmethod
    def of(cls, module: nn.Module, params: Sequence[tuple[str, nn.Parameter]], model: nn.Module | None = None,
           loss_fn: Callable | None = None) -> Traced:
        tensors = [*module.named_parameters(), *module.named_buffers()]
        if model is not None:
            # and the other ranks' parts, on meta here: the same conversion made on every rank (the user's loop
            # runs everywhere) is then refused on every rank at once, not only where the part is held
            held = {id(t) for _, t in tensors}
            tensors += [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if id(t) not in held]
        parts = [] if model is None else [*model.named_modules(), *model.named_parameters()]
        modules = tuple(m for _, m in parts if isinstance(m, nn.Module))
        hooked = [*parts, *_loss_modules(loss_fn)]   # (a loss module's hooks act on the step as the model's)
        losses = loss_fn.named_modules(prefix="loss_fn", remove_duplicate=False) if isinstance(loss_fn, nn.Module) \
            else ()   # (a class-weight buffer replaced: the step reads the one traced)
        slots = _slots([*module.named_modules(remove_duplicate=False),
                        *(model.named_modules(remove_duplicate=False) if model is not None else ()), *losses])
        watched = (modules, tuple(m for m in modules if isinstance(m, nn.modules.dropout._DropoutNd)),
                   (*global_module_hooks(),   # dicts changed in place, keyed by increasing handle ids
                    *(getattr(m, k) for _, m in hooked if isinstance(m, nn.Module) for k in _MODULE_HOOKS)),
                   # every parameter, the other ranks' (meta here) too: a hook the user's loop adds on every rank
                   # is then refused on every rank at once, not only where the parameter is held
                   tuple(dict.fromkeys([*(p for _, p in params),
                                        *(model.parameters() if model is not None else ())])),
                   # each slot's dict, key and the object in it at compile: a module or a tensor replaced since
                   tuple(getattr(m, d) for _, m, d, _ in slots), tuple(k for *_, k in slots),
                   tuple(getattr(m, d)[k] for _, m, d, k in slots))
        watch = watch_of(model, loss_fn) if model is not None else Watched()
        return cls(tuple((n, p) for n, p in params if not p.requires_grad),
                   tuple((n, p) for n, p in params if p.requires_grad),
                   tuple((n, t, t.dtype, t.device, t.shape) for n, t in tensors),
                   tuple((n, m, _mode(m)) for n, m in parts if isinstance(m, nn.Module)),
                   tuple((n, x, _hooks(x)) for n, x in [*hooked, ("", _EVERY_MODULE)]), watched, _quick(*watched),
                   slots, watch, any(p.requires_grad for p in watched[3]))

    def check(self, rank: int, captured: bool) -> None:
        """UsageError for a parameter unfrozen since compile (its gradient was never traced), every parameter of
        the model frozen since (each rank sees the whole model's flags, the other ranks' parameters on meta, so
        the model frozen as a whole is refused on every rank at once), one frozen since
        under CUDA graphs (a captured step writes every gradient it traced; without capture the runtime's
        set_grad leaves a frozen parameter's .grad alone, as eager does), and a tensor converted since compile
        (through the original model or a part of it: PipelineModule._apply refuses a conversion of itself)."""
        for name, p in self.frozen:
            if p.requires_grad:
                raise UsageError(f"{name} had requires_grad=False when the pipeline was compiled, so the compiled "
                                 "step never computes its gradient; it requires grad now. Compile again "
                                 "(zbcompile.compile) with it trainable to train it, or freeze it again")
        # (this rank's parameters trained at compile first: in a step that trains, the first one ends the search,
        # where the model's parameters in order may begin with a long frozen backbone)
        if self.trainable and not self.trains_here() and not any(p.requires_grad for p in self.watched[3]):
            raise nothing_trained("step() has nothing to train: its gradients would all be dropped")
        for name, p in self.trained if captured else ():
            if not p.requires_grad:
                raise UsageError(f"{name} was frozen (requires_grad_(False)) after the pipeline was compiled with "
                                 "cuda_graphs, whose captured step writes every gradient it traced; freeze it "
                                 "before zbcompile.compile (or compile without cuda_graphs)")
        self.check_model()
        self.check_layouts(rank)

    def check_layouts(self, rank: int) -> None:
        """UsageError for a parameter or buffer converted since compile, or given data of another shape."""
        for name, t, dtype, device, shape in self.layouts:
            if t.dtype != dtype or t.device != device:
                raise _converted(f"rank {rank}: {name}", dtype, device, t)
            if t.shape != shape:
                raise _reshaped(f"rank {rank}: {name}", shape, t)

    def trains_here(self) -> bool:
        """Whether a parameter this rank holds and trained at compile requires grad now."""
        return any(p.requires_grad for _, p in self.trained)

    def check_model(self) -> None:
        """UsageError for a module whose mode or dropout probability changed since compile, a hook added or
        removed, or a plain value the traced code read changed (what evaluate() and pipe(x) check too). Every
        call pays only for _quick and one map over the values; the culprit is looked for where they differ."""
        if _quick(*self.watched) != self.quick:
            self._check_structure()
        self._check_settings()

    def _check_structure(self) -> None:
        """check_model's search for the module, slot or hook that changed, where _quick differs."""
        for (name, m, kind, key), held in zip(self.slots, self.watched[6]):
            now = getattr(m, kind).get(key)
            if now is not held:
                what = {"_modules": "module", "_parameters": "parameter", "_buffers": "buffer"}[kind]
                full = f"{name}.{key}" if name else key
                if isinstance(now, torch.Tensor) and isinstance(held, torch.Tensor) and (
                        now.dtype, now.device) != (held.dtype, held.device):   # a buffer, by model.double()
                    raise _converted(f"{what} {full}", held.dtype, held.device, now)
                raise UsageError(f"{what} {full} was {'removed' if now is None else 'replaced'} after compile, but "
                                 f"the compiled step keeps reading the {what} it was traced with (a new one would "
                                 "never be used, nor get a gradient). Make the change before zbcompile.compile (a "
                                 "new head for fine-tuning: replace it, then compile), or change the values in "
                                 f"place (with torch.no_grad(): old.copy_(new))")
        for name, m, mode in self.modes:
            if _mode(m) != mode:
                raise UsageError(f"module {name or '(the model)'} ({type(m).__name__}) changed after compile "
                                 f"({_said(mode)} -> {_said(_mode(m))}), but the compiled step fixed each module's "
                                 "mode and dropout probability when it was traced. pipe.train() / pipe.eval() switch "
                                 "the whole model; for a part in another mode (frozen BatchNorm statistics) or other "
                                 "dropout, set it before zbcompile.compile")
        for name, x, hooks in self.hooks:
            if _hooks(x) != hooks:
                where = _EVERY_MODULE if x is _EVERY_MODULE else name or "the model"
                raise UsageError(f"a hook was added to or removed from {where} after compile: the "
                                 "compiled step runs the graphs traced at compile, which never call a hook added "
                                 "later (and still run one removed). Register forward hooks before "
                                 "zbcompile.compile; act on gradients after step() returns (on p.grad)")


    def _check_settings(self) -> None:
        """UsageError for a plain value the traced code read (a module's `temperature`, a loss weight in loss_fn's
        closure) that changed since compile, or a tensor it read that was replaced: the graphs hold the value
        and the tensor they had when they were traced. One C-level map over the values per call."""
        change = self.watch.changed()
        if change is None:
            return
        raise UsageError(
            f"{change}, but the compiled step's graphs hold what it was when they were traced: the change would "
            "be ignored. Set it "
            "before zbcompile.compile, or keep a value you change during training in a tensor the step reads, "
            "changed in place: a buffer of the model (register_buffer, then buf.fill_(v)) or a batch argument")


_TRAINING, _P = operator.attrgetter("training"), operator.attrgetter("p")
_GRAD_HOOKS = operator.attrgetter("_backward_hooks")
_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def _quick(modules, dropouts, hook_dicts, params, slot_dicts, keys, held) -> tuple:
    """Every module's mode, every dropout's p, the modules' hook count, whether a parameter has a hook, whether
    every submodule, parameter and buffer slot still holds its object: a few microseconds per hundred modules
    (C-level maps), against a few hundred for _mode and _hooks of each. (A hook added to one module and another
    removed from a second between two calls changes the sum of their handles' ids, which only grow.)"""
    return (list(map(_TRAINING, modules)), list(map(_P, dropouts)), sum(map(sum, hook_dicts)),
            any(map(_GRAD_HOOKS, params)) or any(map(_ACCUMULATE_HOOKS, params)),
            all(map(operator.is_, map(dict.get, slot_dicts, keys), held)))


def _slots(named_modules) -> tuple:
    """(name, module, dict name, key) for every entry of each module's _modules, _parameters and _buffers (a
    module reached twice once)."""
    seen, out = set(), []
    for name, m in named_modules:
        if id(m) in seen:
            continue
        seen.add(id(m))
        out += [(name, m, kind, key) for kind in ("_modules", "_parameters", "_buffers") for key in getattr(m, kind)]
    return tuple(out)


def _mode(m: nn.Module) -> tuple:
    return m.training, getattr(m, "p", None) if isinstance(m, nn.modules.dropout._DropoutNd) else None


def _said(mode: tuple) -> str:
    return ("train mode" if mode[0] else "eval mode") + ("" if mode[1] is None else f", p={mode[1]}")


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


_EVERY_MODULE = "every module (torch.nn.modules.module.register_module_*_hook)"


def _loss_modules(loss_fn) -> list[tuple[str, nn.Module]]:
    """A loss module's modules (named loss_fn...): its hooks act on the step as the model's do."""
    return list(loss_fn.named_modules(prefix="loss_fn")) if isinstance(loss_fn, nn.Module) else []


def _hooks(x) -> tuple:
    """The ids of a module's or a parameter's hooks (a parameter's dicts are None until one is added), or of
    the hooks every module runs."""
    if x is _EVERY_MODULE:
        return tuple(map(tuple, global_module_hooks()))
    kinds = _MODULE_HOOKS if isinstance(x, nn.Module) else _TENSOR_HOOKS
    return tuple(tuple(getattr(x, k, None) or ()) for k in kinds)


def _converted(name: str, dtype: torch.dtype, device: torch.device, now: torch.Tensor) -> UsageError:
    """The refusal of tensor `name`, compiled as `dtype` on `device`, converted since to `now`'s."""
    return UsageError(f"{name} was converted after compiling, from {dtype} on {device} to {now.dtype} on "
                      f"{now.device} (through the original model, or a part of it); a compiled pipeline's graphs "
                      "and messages are fixed to what it was compiled with. Convert the model before compiling "
                      "(model.double(), then zbcompile.compile)")


def _reshaped(name: str, shape: torch.Size, now: torch.Tensor) -> UsageError:
    """The refusal of tensor `name`, compiled with `shape`, given another since (`p.data = bigger`)."""
    return UsageError(f"{name} has shape {list(now.shape)} but was compiled with shape {list(shape)} (its .data was "
                      "replaced by a tensor of another shape); the compiled graphs and messages are fixed to the "
                      "traced shapes. Resize the model before compiling, or replace the values in place with the "
                      "same shape (with torch.no_grad(): p.copy_(new))")


def _check_parts_placed(model: nn.Module) -> None:
    """UsageError for a module of `model` that belongs to a model compiled before on several ranks (a backbone
    shared by two models, one compiled already): each rank kept only its own stages' share of it, the rest on
    meta, so it is whole on no rank, and a rank that kept all of it would trace while the others fail. Decided
    by the marks alone, the same on every rank."""
    for name, m in model.named_modules():
        if name and getattr(m, PLACED, 0) > 1:
            raise UsageError(
                f"module `{name}` ({type(m).__name__}) is part of a model compiled before on "
                f"{getattr(m, PLACED)} ranks, which kept on each rank only its own stages' parameters and buffers "
                "and moved the others to the meta device, so the module is not whole any more. Compile a "
                "copy.deepcopy of it taken before the first compile, or one model holding both parts (two heads "
                "on one backbone: one module returning both, one loss_fn over both)")


def check_hooks(model: nn.Module, loss_fn=None) -> None:
    """UsageError before tracing for a hook the compiled step would never call: a parameter's gradient hooks
    (register_hook, register_post_accumulate_grad_hook) and a module's backward hooks, the model's or a loss
    module's. The stage graphs compute the gradients themselves; forward hooks are traced into them and run.
    (First: that it is a module at all, and not one compiled before, whose other ranks' state is on meta.)"""
    if not isinstance(model, nn.Module):
        raise UsageError(f"zbcompile.compile takes an nn.Module (the model, or its class to decorate); got a "
                         f"{type(model).__name__}")
    if getattr(model, PLACED, 0) > 1:   # (the marks alone: a rank that kept all of it decides as the others do)
        raise UsageError(
            "this model was compiled before: compile keeps on each rank only the parameters and buffers of its own "
            "stages and moves the others to the meta device, so it is no whole model any more. To compile again "
            "(another shape, other options), build the model again and load its weights (pipe.state_dict() holds "
            "this rank's, zbcompile.checkpoint.save / load every rank's), or compile a copy.deepcopy(model) taken "
            "before the first compile")
    _check_parts_placed(model)
    for name, p in model.named_parameters():
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            raise UsageError(f"parameter {name} has a gradient hook (register_hook / register_post_accumulate_grad_"
                             "hook), which the compiled step would never call: its W graphs write the gradient "
                             "themselves. Act on the gradients after step() returns (on p.grad), then compile")
    if any(global_module_hooks()[2:]):
        raise UsageError("a backward hook is registered for every module (torch.nn.modules.module.register_module_"
                         "full_backward_hook / _pre_hook), which the compiled step would never call: remove it "
                         "before zbcompile.compile (forward hooks are traced and run)")
    for name, m in [*model.named_modules(), *_loss_modules(loss_fn)]:
        if m._backward_hooks or m._backward_pre_hooks:
            raise UsageError(f"module {name or '(the model)'} ({type(m).__name__}) has a backward hook "
                             "(register_full_backward_hook / _pre_hook), which the compiled step would never call: "
                             "remove it before zbcompile.compile (forward hooks are traced and run)")


def check_conversion(module: nn.Module, fn, rank: int) -> None:
    """UsageError, before any tensor is touched, where nn.Module._apply(fn) (to / double / half / cuda ...)
    would change a parameter's or buffer's dtype or device: fn is tried on an empty tensor of each (dtype,
    device) present to learn what it would do."""
    seen: dict[tuple[torch.dtype, torch.device], str] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        seen.setdefault((t.dtype, t.device), name)
    for (dtype, device), name in seen.items():
        out = fn(torch.empty(0, dtype=dtype, device=device))
        if isinstance(out, torch.Tensor) and (out.dtype != dtype or out.device != device):
            raise UsageError(
                f"rank {rank}: this conversion (.to / .double / .half / .cuda ...) would turn {name} from {dtype} "
                f"on {device} into {out.dtype} on {out.device}, but a compiled pipeline's graphs and messages are "
                "fixed to the dtypes and device it was compiled with; nothing was changed. Convert the model "
                "before compiling (model.double(), then zbcompile.compile(model, ...)); for another device, build "
                "and compile the model where it runs")


def check_replacement(model: nn.Module, fn, rank: int) -> None:
    """UsageError, before any tensor is touched, where nn.Module._apply(fn) would put a new tensor in a persistent
    buffer's place (`.to(memory_format=...)` on a 4-D buffer, `to_empty`): the compiled step keeps reading the
    buffer it was compiled with. fn is tried on every such buffer of the model, the other ranks' (meta here)
    too, so that the same call is refused on every rank alike. (A parameter keeps its object: torch sets its
    .data, which the step reads.)"""
    for path, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            out = fn(buf)
            if isinstance(out, torch.Tensor) and out is not buf:
                where = f"{path}.{name}" if path else name
                raise UsageError(
                    f"rank {rank}: this conversion would replace buffer {where} with a new tensor (another memory "
                    f"format, or fresh storage as to_empty makes), but the compiled step reads the buffer it was "
                    "compiled with; nothing was changed. Convert the model before zbcompile.compile "
                    "(model.to(memory_format=torch.channels_last), then compile it); to set new values, load "
                    "them in place (pipe.load_state_dict)")


def check_kinds(batch, what: str, device: torch.device) -> None:
    """Every argument a tensor with data (the shape checks read .shape; the runtime copies from it)."""
    call = "pipe(*inputs)" if what == "forward" else f"{what}(*inputs, *targets)"
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            nested = isinstance(t, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in t)
            fix = ("unpack the nested inputs and targets: the batch is flat, not (inputs, targets) as in `example`"
                   if nested else "pass a torch.Tensor (torch.as_tensor(...))")
            raise UsageError(f"{what}() takes the whole batch as flat tensors, {call}; batch argument {i} is a "
                             f"{type(t).__name__}: {fix}")
        if t.requires_grad and what == "step":   # (evaluate and pipe(x) compute no gradient, as under no_grad)
            raise UsageError(f"{what}() got batch argument {i} requiring grad: the pipeline computes gradients for "
                             "the model's parameters only, so its .grad would stay None (input gradients, as for "
                             "saliency maps or adversarial examples, are not supported); pass it detached "
                             "(x.detach())")
        if t.is_meta:
            where = f"on {device} (where the model runs)" + (" or on the CPU" if device.type != "cpu" else "")
            raise UsageError(f"{what}() got batch argument {i} on the meta device, which holds no data: pass the "
                             f"batch's tensors {where}")


def check_shapes(batch: Sequence[torch.Tensor], specs, data_specs: dict, counts: tuple[int, int], m: int,
                 what: str, targets: bool = True, any_count: bool = False, replicas: int = 1) -> None:
    """As many arguments as the step takes (counts: model inputs, targets), each splitting into m microbatches
    of the traced shape and dtype (static shapes, fixed P2P buffer sizes). `specs`: per flat argument the whole
    batch's (shape, dtype) as traced, for the one-comparison fast path; `data_specs`: per argument one
    microbatch's. any_count: the call takes any number of microbatches of the traced shape (evaluate, forward:
    m is the number the batch holds), which the refusals then say. replicas: the batch is the global batch of
    that many data-parallel replicas, each m microbatches (specs and data_specs are one replica's)."""
    num_inputs, num_targets = counts
    specs = specs if targets else specs[:num_inputs]
    if len(batch) != len(specs):
        wanted = f" then {num_targets} target(s)" if targets else " (no targets)"
        raise UsageError(f"{what}() takes {num_inputs} model input(s){wanted}, {len(specs)} tensors; got "
                         f"{len(batch)}")
    if replicas == 1 and all(s is not None and t.shape == s[0] and t.dtype == s[1] for t, s in zip(batch, specs)):
        return
    n = m * replicas   # microbatches in the batch, of every replica
    each = f" on each of dp={replicas} replicas" if replicas > 1 else ""
    for i, t in enumerate(batch):
        spec = data_specs.get(i)
        if spec is None and t.dim() and t.shape[0] % n == 0:
            continue
        rows = t.shape[0] if t.dim() else 0
        takes = _takes(what, m, spec, any_count, replicas)
        if t.dim() == 0 or t.shape[0] % n:
            raise UsageError(f"batch argument {i} has {rows} rows, which do not split into {m} equal microbatches"
                             f"{each}; {takes}")
        shape, dtype = spec
        got = (t.shape[0] // n, *t.shape[1:])
        if t.dtype != dtype and list(got) == list(shape):
            raise UsageError(f"batch argument {i} is {t.dtype}, but the model was compiled for {dtype} from "
                             f"`example`: pass it as .to({dtype}), or compile a fresh model with an example of "
                             "this dtype")
        if t.dtype != dtype or list(got) != list(shape):
            raise UsageError(
                f"batch argument {i}: {m} microbatches{each} of shape {list(got)} ({t.dtype}), but the model was "
                f"compiled for microbatches of shape {list(shape)} ({dtype}) from `example`; {takes}, or compile a "
                "fresh model for this shape")


def _takes(what: str, m: int, spec, any_count: bool, replicas: int = 1) -> str:
    """What a call takes, for check_shapes' refusals (of the global batch of `replicas` data-parallel replicas)."""
    if not spec or not spec[0]:
        return f"use a batch size that is a multiple of {m * replicas}"
    rows, others = spec[0][0], list(spec[0][1:])
    if any_count and replicas == 1:
        return (f"{what}() takes any multiple of the example's {rows} rows (as many microbatches of its shape), "
                f"with its other sizes {others}")
    if any_count:
        return (f"{what}() takes any multiple of {replicas * rows} rows, dp={replicas} replicas x the example's "
                f"{rows} (as many microbatches of its shape on each), with its other sizes {others}")
    each = f" on each of dp={replicas} replicas, every rank handed the global batch:" if replicas > 1 else ","
    return (f"the compiled step takes {m} microbatches of {rows} rows (example's){each} a batch of "
            f"{m * rows * replicas} rows")


def check_vocabulary(batch: Sequence[torch.Tensor], vocab, m: int, what: str, targets: bool = True) -> None:
    """UsageError where a token id the sharded embedding looks up, or a target the sharded loss reads, is
    outside the vocabulary [0, V) (a target may also be the loss's ignore_index): no shard holds its row, so it
    would be looked up as zeros or its logit missed, where eager raises. `batch`: the flat step arguments,
    inputs then targets (inputs only without `targets`)."""
    if vocab is None:
        return
    checks = [(vocab.ids, "token id", "the embedding looks up")]
    if targets:
        checks.append((vocab.targets, "target", "the loss reads"))
    for graph, kind, reader in checks:
        where = [int(name.split(":")[1]) for name in (graph.inputs if graph is not None else ())]
        if graph is None or any(i >= len(batch) for i in where):   # (ids computed from a target: no forward)
            continue
        args = [batch[i].chunk(m) for i in where]
        for k, microbatch in enumerate(zip(*args)):
            with torch.no_grad():   # contiguous, as the runtime stages each microbatch (the graph may view it)
                values = graph.gm(*(t.contiguous() for t in microbatch))
            bad = (values < 0) | (values >= vocab.size)
            if kind == "target":
                bad &= values != vocab.ignore_index
            if bool(bad.any()):
                raise UsageError(
                    f"{what}: a {kind} {reader} is {values[bad][0].item()} (microbatch {k}), outside the vocabulary "
                    f"[0, {vocab.size})" + (f" and not ignore_index={vocab.ignore_index}" if kind == "target" else "")
                    + "; no vocabulary shard holds it (eager raises). Check the batch's ids against the tokenizer's "
                    "vocabulary size")


def check_step_context(training: bool, traced_autocast, now_autocast) -> None:
    """Refuse what a compiled training step cannot honour: eval mode, no_grad / inference_mode (the step would
    write gradients all the same) and an autocast region other than the one the step was traced under."""
    if not training:
        raise UsageError("step() trains, but this PipelineModule is in eval mode (eval() was called): call train() "
                         "before training, and evaluate(*batch) for the eval-mode loss")
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise UsageError("step() trains (it writes .grad) but was called under torch.no_grad() or "
                         "torch.inference_mode(); for a forward pass without gradients call evaluate(*batch) (the "
                         "loss) or run step() with gradients enabled")
    check_autocast("step", traced_autocast, now_autocast)
    if torch.is_anomaly_enabled():   # a debugging run: tell it that the check it relies on is not there
        warnings.warn("step() runs under torch.autograd anomaly detection (detect_anomaly / set_detect_anomaly), "
                      "which it cannot honour: the backward runs as compiled stage graphs, not through autograd, "
                      "so a NaN or inf gradient is written without anomaly mode's error. Check the gradients with "
                      "pipe.grads_finite() after the step (every rank: it is pipeline-wide), or pass the optimizer "
                      "to step(), which skips an update whose gradients are not finite", ZBCompileWarning,
                      stacklevel=5)


def check_default_dtype(what: str, traced) -> None:
    """The default dtype a call runs under is the one the step was traced under, where an op of the step reads it
    (`traced`: split.default_dtype_reads's (dtype, op); None: none does, and any default is fine)."""
    now = str(torch.get_default_dtype()).removeprefix("torch.")
    if traced is not None and now != traced[0]:
        raise UsageError(f"{what}() runs under the default dtype {now} but the step was compiled under {traced[0]}, "
                         f"and its op {traced[1]} makes a tensor of the default dtype (no dtype= given): its graphs "
                         f"would mix the two. Call it under torch.set_default_dtype(torch.{traced[0]}), as it was "
                         "compiled, or give that op a dtype in the model's code")


def check_autocast(what: str, traced_autocast, now_autocast) -> None:
    """The autocast region of a call (step, evaluate, forward) is the one the step was traced under: the casts
    are in the graphs, which evaluate() and pipe(x) run too."""
    if now_autocast != traced_autocast:
        traced = ", ".join(f"{d}: {t}" for d, t in traced_autocast) or "no autocast"
        found = ", ".join(f"{d}: {t}" for d, t in now_autocast) or "no autocast"
        raise UsageError(f"{what}() runs under {found} but the step was compiled under {traced}: a compiled step's "
                         "casts are fixed when it is traced (evaluate() and pipe(x) run its forward graphs). Call "
                         f"{what}() under {traced}, as the step was compiled, or compile it under {found} (inside "
                         "the torch.autocast region you call it in, or outside any)")
