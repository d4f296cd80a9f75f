"""What the traced code may have read from Python, kept at compile so that a change after it is refused, not
ignored: the trace bakes every plain value it reads into the graphs as a constant, and reads every tensor it is
handed through the object it had then.

    watch_of(model, loss_fn) -> Watched(settings, objects)

settings: (label, dict, key, value) of each plain value (a number, a string, a tuple of them, a list or dict of
them as a copy) the code may read, compared by value at every call:
- a module's attributes whose names the code a step may run mentions (`_methods`: forward, the methods of the
  class's own file but `__init__` and the like, what they call by name, a helper function of the same file:
  not a library base class's `save_pretrained`), public or private (`self._temp`), on the module itself or read
  by another module of the model (`self.head.scale` in the root's forward); one level into a plain object held
  there (a config: `self.cfg.scale`, and what a property read there reads);
- the globals that code and loss_fn's code (with its helpers) name (one level into a dict: `CFG["aux"]`),
  loss_fn's closure cells, a functools.partial's bound arguments, a callable object's attributes its class reads;
- each module's own `forward` attribute (a `model.forward = partial(...)` rebound after compile).
objects: (label, dict, key, object) of each tensor held outside parameters and buffers (a module's plain tensor
attribute, a tensor in loss_fn's closure), compared by identity: a tensor replaced is not read by the step,
one changed in place is.

An attribute the training loop keeps on a module (a step counter) is not watched unless the model's code names
it. Torch's own modules' internals (`_parameters`, the hook dicts, ...) are not settings.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import itertools
import types
from typing import Callable

import torch
from torch import nn

from zbcompile.share import plain_value, same_value

__all__ = ["Watched", "watch_of", "names_read", "MISSING"]

MISSING = object()
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"}


@dataclasses.dataclass(frozen=True)
class Watched:
    """The plain values and the objects the traced code may have read (module docstring), and their columns:
    the dicts, keys and values taken apart once, so that a call's comparison is one C-level map each."""

    settings: tuple = ()
    objects: tuple = ()

    @functools.cached_property
    def columns(self) -> tuple:
        _, dicts, keys, values = zip(*self.settings) if self.settings else ((), (), (), ())
        _, odicts, okeys, objs = zip(*self.objects) if self.objects else ((), (), (), ())
        cells = tuple({id(d): d for d in (*dicts, *odicts) if isinstance(d, CellView)}.values())
        return dicts, keys, list(values), odicts, okeys, objs, cells

    def changed(self) -> str | None:
        """What changed first ("model attribute temperature changed after compile (1.0 -> 0.5)"), or None."""
        dicts, keys, values, odicts, okeys, objs, cells = self.columns
        for view in cells:
            view.refresh()
        if (list(map(dict.get, dicts, keys, itertools.repeat(MISSING))) == values
                and all(map(_is, map(dict.get, odicts, okeys, itertools.repeat(MISSING)), objs))):
            return None
        for label, held, key, value in self.settings:
            now = held.get(key, MISSING)
            if not same_value(now, value):
                return f"{label} changed after compile ({_said(value)} -> {_said(now)})"
        for label, held, key, obj in self.objects:
            now = held.get(key, MISSING)
            if now is not obj:
                return (f"{label} was replaced after compile ({_said(obj)} -> {_said(now)}, another object)"
                        if now is not MISSING else f"{label} was deleted after compile")
        return None


def _is(a, b) -> bool:
    return a is b


def _said(value) -> str:
    if value is MISSING:
        return "(deleted)"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class CellView(dict):
    """A closure cell as a dict of one entry {name: its contents}, refreshed before each comparison."""

    def __init__(self, name: str, cell) -> None:
        super().__init__()
        self.name, self.cell = name, cell
        self.refresh()

    def refresh(self) -> None:
        try:
            self[self.name] = self.cell.cell_contents
        except ValueError:   # emptied (del of the variable)
            self.pop(self.name, None)


def watch_of(model: nn.Module, loss_fn: Callable | None) -> Watched:
    """Watched of `model` and `loss_fn` (module docstring)."""
    modules = [(f"model attribute {n + '.' if n else ''}", m) for n, m in model.named_modules()]
    if isinstance(loss_fn, nn.Module):
        modules += [(f"loss_fn attribute {n + '.' if n else ''}", m) for n, m in loss_fn.named_modules()]
    read = frozenset().union(*(names_read(type(m)) for _, m in modules))
    out: list = []
    for label, m in modules:
        out.append((label + "forward", vars(m), "forward", vars(m).get("forward", MISSING)))
        for k, v in vars(m).items():
            if k not in _MODULE_INTERNALS and k in read:
                out += _entries(label + k, vars(m), k, v, read)
    for cls in {type(m) for _, m in modules}:
        out += _globals_read(cls, "model's global")
    out += _callable_entries(loss_fn)
    settings = tuple(e for e in out if not isinstance(e[3], torch.Tensor))
    objects = tuple(e for e in out if isinstance(e[3], torch.Tensor))
    return Watched(settings, objects)


def _entries(label: str, where: dict, key, value, read: frozenset) -> list:
    """The watch entries of one value: itself if plain or a tensor, a copy of a list / dict of plain values,
    the plain attributes of a plain object (a config) whose names the code mentions."""
    if plain_value(value) or isinstance(value, torch.Tensor):
        return [(label, where, key, value)]
    if isinstance(value, list) and all(map(plain_value, value)):
        return [(label, where, key, list(value))]
    if isinstance(value, dict):
        return [(f"{label}[{k!r}]", value, k, v) for k, v in value.items()
                if plain_value(v) or isinstance(v, torch.Tensor)]
    if _plain_object(value):
        read = read | _properties_read(type(value), read)
        return [(f"{label}.{k}", vars(value), k, v) for k, v in vars(value).items()
                if k in read and (plain_value(v) or isinstance(v, torch.Tensor))]
    return []


def _properties_read(cls: type, read: frozenset) -> frozenset:
    """The names the code of `cls`'s properties among `read` mentions: a config's `_attn_implementation`
    property reads the attribute `_attn_implementation_internal`, which is where a change lands."""
    props = [getattr(cls, n, None) for n in read]
    return frozenset().union(*(_code_names(p.fget.__code__) for p in props
                               if isinstance(p, property) and isinstance(p.fget, types.FunctionType)))


def _plain_object(value) -> bool:
    """An instance of a user class holding settings (a dataclass config, a SimpleNamespace): not a module,
    tensor, function, class or Python module."""
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType,
                                                                  types.FunctionType, types.MethodType,
                                                                  functools.partial)))


def _callable_entries(fn, label: str = "loss_fn") -> list:
    """A loss function's closure cells and the globals its code names; a partial's bound arguments and its
    function's; a callable object's attributes its class mentions and the globals its methods name."""
    if isinstance(fn, types.FunctionType):
        out = []
        for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            view = CellView(n, c)
            out += _entries(f"{label}'s {n}", view, n, view.get(n, MISSING), frozenset())
        for f in _reached([fn]):
            for n, value in _globals_named(f):
                out += _entries(f"{label}'s global {n}", f.__globals__, n, value, frozenset())
        return out
    if isinstance(fn, functools.partial):
        bound = [(f"{label}'s bound keyword {k}", fn.keywords, k, v) for k, v in fn.keywords.items()
                 if plain_value(v) or isinstance(v, torch.Tensor)]
        return bound + _callable_entries(fn.func, label)
    if fn is not None and not isinstance(fn, nn.Module) and _plain_object(fn):
        read = names_read(type(fn))
        out = [e for k, v in vars(fn).items() if k in read for e in _entries(f"{label} attribute {k}", vars(fn),
                                                                              k, v, read)]
        return out + _globals_read(type(fn), f"{label}'s global")
    return []


def _globals_read(cls: type, label: str) -> list:
    """The plain globals (and a dict's plain items) and the global tensors (by identity) the code a step may run
    of `cls` names, for a class of the user's (torch's own modules read no global a training loop changes)."""
    if cls.__module__.startswith("torch."):
        return []
    out = []
    for fn in _methods(cls):
        for n, value in _globals_named(fn):
            if plain_value(value) or isinstance(value, (dict, torch.Tensor)):
                out += _entries(f"{label} {n}", fn.__globals__, n, value, frozenset())
    return out


def _globals_named(fn: types.FunctionType):
    """(name, value) of each global `fn`'s code looks up (its nested code's too), but dunders, in name order."""
    for n in sorted(_global_names(fn.__code__)):
        if n in fn.__globals__ and not n.startswith("__"):
            yield n, fn.__globals__[n]


@functools.lru_cache(maxsize=None)   # (names_read and _globals_read both walk it, per class)
def _methods(cls: type) -> tuple[types.FunctionType, ...]:
    """The code a step may run of `cls`: its methods defined in the class's own Python module and `forward`,
    then, transitively, every method (along the MRO) and every plain function of the same Python module that
    this code names. A library base class's other methods (HuggingFace's `save_pretrained`, `push_to_hub`) are
    left out, with the globals they read: those are the library's business, and change when it is used."""
    defined: dict[str, list[types.FunctionType]] = {}
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for attr, value in vars(klass).items():
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if attr not in _NOT_READ_IN_STEPS and isinstance(fn, types.FunctionType):
                defined.setdefault(attr, []).append(fn)
    found = {fn.__code__: fn for attr, fns in defined.items() for fn in fns
             if attr == "forward" or fn.__module__ == cls.__module__}
    return tuple(_reached(list(found.values()), defined))


def _reached(functions: list[types.FunctionType], methods: dict | None = None) -> list[types.FunctionType]:
    """`functions`, and what their code names, transitively: a method of `methods` by its name (every
    definition along the MRO: `super().forward()` names the base's), a plain function of the same Python
    module by its global name (a helper such as `attention(self, q, k)` reads the module's attributes as much
    as forward does; a library's utilities elsewhere are not the model's), a function in its closure (the
    method a decorator wraps), the methods of a custom autograd.Function named (_function_code)."""
    seen = {fn.__code__: fn for fn in functions}
    todo = list(functions)
    while todo:
        fn = todo.pop()
        names = _code_names(fn.__code__)
        called = [f for n in names for f in (methods or {}).get(n, ())]
        called += [v for n in sorted(names) if isinstance(v := fn.__globals__.get(n), types.FunctionType)
                   and v.__globals__ is fn.__globals__]
        called += [v for v in map(_cell_contents, fn.__closure__ or ()) if isinstance(v, types.FunctionType)]
        called += [f for n in sorted(names) for f in _function_code(fn.__globals__.get(n))]
        for f in called:
            if f.__code__ not in seen:
                seen[f.__code__] = f
                todo.append(f)
    return list(seen.values())


def _function_code(value) -> list[types.FunctionType]:
    """The forward, backward and setup_context of `value` where it is a torch.autograd.Function class of the
    user's (`GradReverse.apply(x, ...)`): code a step runs, whose backward the trace recorded with the globals it
    read then (a gradient-reversal coefficient annealed through a global)."""
    if not (isinstance(value, type) and issubclass(value, torch.autograd.Function)):
        return []
    return [f for klass in value.__mro__ if not klass.__module__.startswith("torch.")
            for attr in ("forward", "backward", "setup_context")
            if isinstance(f := getattr(vars(klass).get(attr), "__func__", vars(klass).get(attr)), types.FunctionType)]


@functools.lru_cache(maxsize=None)
def names_read(cls: type) -> frozenset[str]:
    """The attribute names the code a step may run of `cls` mentions (`_methods`): by name, or as a string
    (`getattr(self.config, "use_cache", None)`)."""
    names: set[str] = set()
    for fn in _methods(cls):
        names |= _code_names(fn.__code__, strings=True)
    return frozenset(names)


_NOT_READ_IN_STEPS = frozenset({"__init__", "extra_repr", "__repr__", "__setstate__", "reset_parameters",
                                "_reset_parameters", "_init_weights"})


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:   # an empty cell
        return None


_GLOBAL_LOOKUPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=None)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The names `code` and the code nested in it look up as globals. Not co_names, which also holds the names of
    attributes and methods (`h.mean(-1)`, `self.scale`): a training loop's global `mean` is no global the model
    reads, and rebinding it must not refuse the next step."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOOKUPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


def _code_names(code: types.CodeType, strings: bool = False) -> set[str]:
    """co_names of `code` and of the code nested in it (lambdas, comprehensions, inner functions); with
    `strings`, its string constants that are identifiers too."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const, strings)
        elif strings and isinstance(const, str) and const.isidentifier():
            names.add(const)
        elif strings and isinstance(const, tuple):   # a constant list of names: ("use_cache", ...)
            names |= {c for c in const if isinstance(c, str) and c.isidentifier()}
    return names
