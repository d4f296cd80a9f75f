"""One trace and split per distinct request in a test session, where the split is not what is under test.

Tracing and splitting are most of the suite's time (export, decompositions and one joint trace per stage: about
2-3 s for the tests' GPT), and many tests split the same small models at the same stage counts: the memory
plan for each schedule, offload, capture, the data-parallel lowering, the training loop, and every rank of every
launch. `install_shared(directory)` wraps `zbcompile.split.split_model` (tests/conftest.py does it before any test
module is imported, so that `from zbcompile.split import split_model` binds the wrapper, and `compiler.split_for`
calls it too; a launched rank does it when `support` is first imported, see support/__init__.py). The wrapper
keeps each successful split under a `fingerprint` of everything the trace reads and hands out a deep copy
(about 60 ms for the GPT), so no test sees what another did to its split. Errors are never kept. It wraps
`zbcompile.split.trace` the same way, under the same fingerprint: a split the memo misses because it cuts at
another stage count, placement or vocabulary sharding still reuses the step's trace (export and
decompositions, about half of a split).

The fingerprint errs on the side of a miss: every module's class, training flag, hooks and plain attributes
(a config object by its repr; an object without a repr of its own by identity), every parameter's and buffer's
name, layout, dtype, device and requires_grad, the ties between them, the values of tensors held outside them
(export lifts those as constants), the loss function's code, defaults and closure, the example's tree and each
tensor's layout, the keyword arguments, and the autocast, default dtype and grad mode in force. Parameter values
are left out: a trace does not read them (data-dependent control flow is refused).

tests/conftest.py turns the memo off for the tests under tests/split/ (the split is what they test) and for any
test marked `fresh_split`.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import hashlib
import io
import marshal
import os
import pickle
import types
import warnings

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from zbcompile._torch_private import FakeTensorMode, StorageWeakRef
from zbcompile.passes.functions import op_from_parts, op_parts

DIRECTORY = "ZB_TEST_SPLIT_DIR"   # a launched rank's environment: the session's directory
_state = {"enabled": True, "directory": None}

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def install_shared(directory: str) -> None:
    """Wrap zbcompile.split.split_model with the memo, kept in memory and in `directory` (see below), which the
    processes this one launches (support/launch.py) are told to share. Once per process."""
    import zbcompile.split as split

    if getattr(split.split_model, "__wrapped__", None) is None:
        memo = OnDisk(directory)
        split.split_model = memoized(split.split_model, memo, lambda: _state["enabled"])
        # the trace alone, too: a model split at other stage counts or placements (pp=2 and pp=4, a V and a
        # line) is traced once; the trace is about half of a split
        split.trace = memoized(split.trace, memo, lambda: _state["enabled"], what="trace")
        _state["directory"] = directory


def install_from_environment() -> None:
    """In a launched rank: `install_shared` with the directory its environment names (DIRECTORY), if any."""
    if os.environ.get(DIRECTORY):
        install_shared(os.environ[DIRECTORY])


def shared_directory() -> str | None:
    """The directory this process keeps its splits in (None: not installed)."""
    return _state["directory"]


def enabled(on: bool) -> None:
    """Turn the installed memo on or off (tests/conftest.py, per test)."""
    _state["enabled"] = on


def memoized(split_model, memo: "Memo", active=lambda: True, what: str = "split"):
    """`split_model` (or `trace`: any function of (model, loss_fn, example, **kwargs)) keeping its results in
    `memo` while `active()` says so; `what` keeps one function's results apart from another's in a shared memo."""
    @functools.wraps(split_model)
    def split_once(model, loss_fn, example, **kwargs):
        key = fingerprint(model, loss_fn, example, kwargs) if active() else None
        if key is None:
            return split_model(model, loss_fn, example, **kwargs)
        return memo.fetch((what, key), lambda: split_model(model, loss_fn, example, **kwargs))

    return split_once


class Memo:
    """Splits by fingerprint, in this process's memory: the first request gets the split it made, every later one
    a deep copy of it (so no test sees what another did to its split). A failed split is not kept."""

    def __init__(self):
        self.kept: dict = {}

    def fetch(self, key, make):
        if key in self.kept:
            return _copy(self.kept[key])
        staged = make()
        self.kept[key] = _copy(staged)
        return staged


def _copy(staged):
    with warnings.catch_warnings():
        # deep-copying the model outputs' TreeSpec trips torch 2.13's own LeafSpec deprecation
        warnings.filterwarnings("ignore", message=".*LeafSpec.* is deprecated", category=FutureWarning)
        return copy.deepcopy(staged)


def fingerprint(model: nn.Module, loss_fn, example, kwargs: dict) -> tuple | None:
    """Everything the trace and the split read of their arguments (see the module docstring); None where a part
    cannot be told apart safely (the split then runs)."""
    from zbcompile.split import autocast_state

    try:
        return (_model(model), _callable(loss_fn), _tree(example), _value(kwargs), autocast_state(),
                torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    except Exception:   # a repr that fails, an attribute that reaches back to the model: no content key
        return None


_MODULE_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}


def _model(model: nn.Module) -> tuple:
    ids: dict[int, int] = {}
    params = tuple((name, _tensor(p), ids.setdefault(id(p), len(ids)))
                   for name, p in model.named_parameters(remove_duplicate=False))
    buffers = tuple((name, _tensor(b)) for name, b in model.named_buffers(remove_duplicate=False))
    modules = tuple((name, type(m), m.training, _attributes(m)) for name, m in model.named_modules())
    return params, buffers, modules


def _attributes(m: nn.Module) -> tuple:
    """A module's own state besides its parameters, buffers and children: hooks, flags, configs, constants."""
    out = []
    for k, v in sorted(vars(m).items()):
        if k in _MODULE_STATE:
            continue
        out.append((k, _value(v)))   # hooks too: dicts of callables
    return tuple(out)


def _tensor(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device.type, t.requires_grad, type(t))


def _tensor_value(t: torch.Tensor) -> tuple:
    """A tensor whose values become part of the traced graph (a constant): its layout and its bytes."""
    if t.is_meta:
        return _tensor(t)
    data = t.detach().cpu().contiguous()
    return (*_tensor(t), hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest())


def _value(v):
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        return _tensor_value(v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value(x) for x in v))
    if isinstance(v, dict):
        return (type(v), tuple((_value(k), _value(x)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return (type(v), tuple(sorted(repr(x) for x in v)))
    if isinstance(v, type):
        return ("type", v)
    if callable(v):
        return _callable(v)
    if type(v).__repr__ is object.__repr__:
        return _Same(v)   # no repr of its own: only itself is itself
    return ("repr", type(v), repr(v))


def _callable(fn) -> tuple:
    """A function by its code, defaults and closure; a partial by its parts; a module by its fingerprint;
    anything else by identity (a miss unless it is the very same object)."""
    if isinstance(fn, functools.partial):
        return ("partial", _callable(fn.func), _value(fn.args), _value(fn.keywords))
    if isinstance(fn, nn.Module):
        return ("module", _model(fn))
    if isinstance(fn, types.MethodType):
        return ("method", _callable(fn.__func__), _Same(fn.__self__))
    if isinstance(fn, types.FunctionType):
        cells = tuple(_value(c.cell_contents) for c in fn.__closure__ or ())
        return ("function", fn.__code__, _value(fn.__defaults__), _value(fn.__kwdefaults__), cells,
                fn.__module__)
    if isinstance(fn, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ("builtin", fn)
    return _Same(fn)


class _Same:
    """A key part equal only to the very same object, which it keeps alive (so that its id is never reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def _tree(example) -> tuple:
    leaves, spec = pytree.tree_flatten(example)
    return (str(spec), tuple(_tensor(x) if isinstance(x, torch.Tensor) else _value(x) for x in leaves))


# ---- the memo on disk: shared by the processes of a launch and by the launches of a test session ----------------
#
# The ranks of a launch all split the same model (4 ranks on 2 cores: twice the time of one split), and the launches
# of one session split the same few models again. The session's directory (made by tests/conftest.py, handed to the
# test processes of pytest -n and, as ZB_TEST_SPLIT_DIR, to launched ranks) keeps every split whose fingerprint
# has a stable digest as a pickle: the first process to ask makes it while holding the digest's lock, the others
# wait for the lock and load it. A pickled fx.GraphModule normally keeps only its code; here it keeps its graph,
# node by node with each node's meta, and the fake tensors in the meta come back as fake tensors of the same layout
# and the same sharing of storage (one FakeTensorMode per load).

class OnDisk(Memo):
    """`Memo`, with each split whose key has a stable digest also kept in `directory` for the other processes."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def fetch(self, key, make):
        name = None if key in self.kept else digest(key)
        if name is None:
            return super().fetch(key, make)
        path = os.path.join(self.directory, name)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # whoever holds it is making this very split; closing releases it
            if os.path.exists(path + ".pkl"):
                with open(path + ".pkl", "rb") as fh:
                    data = fh.read()
                try:
                    self.kept[key] = loads(data)
                except Exception as e:   # make it here: a rank that fails where its peers do not desyncs a launch
                    warnings.warn(f"split memo: {path}.pkl does not load ({type(e).__name__}: {e}); splitting anew")
            elif not os.path.exists(path + ".none"):   # .none: it does not pickle, every process makes its own
                staged = super().fetch(key, make)
                self._store(path, self.kept[key])
                return staged
        return super().fetch(key, make)

    @staticmethod
    def _store(path: str, staged) -> None:
        """`path`.pkl, written whole (another process may read it as soon as the lock is released), or an empty
        `path`.none where the split does not pickle."""
        try:
            data = dumps(staged)
        except Exception:
            data = None
        with open(path + ".part", "wb") as fh:
            fh.write(data or b"")
        os.replace(path + ".part", path + (".pkl" if data is not None else ".none"))


def digest(key) -> str | None:
    """A name for `key` that is the same in every process of the session, or None where the key holds a part
    only this process can tell apart (an object by identity, a class defined inside a function)."""
    parts: list[str] = []

    def walk(v) -> bool:
        if isinstance(v, _Same):
            return False
        if isinstance(v, tuple):
            parts.append("(")
            ok = all(walk(x) for x in v)
            parts.append(")")
            return ok
        if isinstance(v, type):
            if "<locals>" in v.__qualname__:
                return False
            parts.append(f"type:{v.__module__}.{v.__qualname__}")
            return True
        if isinstance(v, types.CodeType):   # a nested function's too: its closure is part of the key
            parts.append("code:" + hashlib.sha1(marshal.dumps(v)).hexdigest())
            return True
        if isinstance(v, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, types.BuiltinFunctionType)):
            parts.append(f"op:{v}")
            return True
        if isinstance(v, (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)):
            parts.append(f"{type(v).__name__}:{v!r}")
            return True
        return False

    if not walk(key):
        return None
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def dumps(staged) -> bytes:
    buf = io.BytesIO()
    _GraphPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(staged)
    return buf.getvalue()


def loads(data: bytes):
    _load["mode"] = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.* is deprecated", category=FutureWarning)
            return pickle.loads(data)
    finally:
        _load.clear()


_load: dict = {}


class _GraphPickler(pickle.Pickler):
    """A pickler for splits: graph modules node by node (their meta kept), fake tensors and torch ops by name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.storages: dict = {}   # a fake storage's key -> its number in this pickle

    def reducer_override(self, obj):
        if isinstance(obj, FakeTensor):
            # views of one storage stay views of one storage: the alias analyses compare storages
            storage = obj.untyped_storage()
            number = self.storages.setdefault(StorageWeakRef(storage), len(self.storages))
            return _fake, (number, _concrete(storage.nbytes()), tuple(obj.shape), tuple(obj.stride()),
                           obj.storage_offset(), obj.dtype, str(obj.device), obj.requires_grad)
        if isinstance(obj, fx.GraphModule):
            return _graph_module, _graph_module_state(obj)
        if isinstance(obj, torch._ops.OpOverload) and obj.namespace == "zbfn":
            parts = op_parts(obj)   # a custom autograd.Function's op: made again where it is loaded
            if parts is None:
                raise pickle.PicklingError(f"{obj} holds objects only this process can tell apart")
            return op_from_parts, parts
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op, (obj._qualified_op_name, None)
        return NotImplemented


class _Ref:
    """A node's argument that is another node, by name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def _graph_module_state(gm) -> tuple:
    nodes = []
    for n in gm.graph.nodes:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: _Ref(a.name))
        meta = dict(n.meta)
        if not isinstance(meta.get("original_aten"), (torch._ops.OpOverload, type(None))):
            meta.pop("original_aten")   # a decomposition's Python function: a note nothing here reads
        nodes.append((n.name, n.op, n.target, args, kwargs, n.type, meta))
    owned = {n.target: _owned(gm, n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    return type(gm).__name__, nodes, owned, dict(gm.meta), gm.graph._codegen


def _owned(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _graph_module(class_name, nodes, owned, meta, codegen):
    g = fx.Graph()
    g._codegen = codegen
    env = {}
    for name, op, target, args, kwargs, type_, node_meta in nodes:
        args, kwargs = _resolve((args, kwargs), env)
        node = g.create_node(op, target, args, kwargs, name=name, type_expr=type_)
        node.meta = node_meta
        env[name] = node
    gm = fx.GraphModule(owned, g, class_name=class_name)
    gm.meta.update(meta)
    return gm


def _resolve(v, env):
    if isinstance(v, _Ref):
        return env[v.name]
    if isinstance(v, tuple):
        return tuple(_resolve(x, env) for x in v)
    if isinstance(v, list):
        return [_resolve(x, env) for x in v]
    if isinstance(v, dict):
        return {k: _resolve(x, env) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_resolve(v.start, env), _resolve(v.stop, env), _resolve(v.step, env))
    return v


def _concrete(n) -> int:
    """A size as a plain int: export can leave an input's storage size symbolic (a SymInt of its shape
    environment, which does not pickle) even where every shape is static; its hint is the value."""
    if isinstance(n, int):
        return n
    hint = getattr(n.node, "hint", None)
    if hint is None:
        raise pickle.PicklingError(f"a fake storage of symbolic size {n} without a value")
    return int(hint)


def _op(name: str, overload: str | None):
    """torch.ops' operator "namespace::op": its overload `overload`, or the packet itself (None)."""
    namespace, op = name.split("::")
    packet = getattr(getattr(torch.ops, namespace), op)
    return packet if overload is None else getattr(packet, overload)


def _fake(storage: int, nbytes: int, shape, stride, offset: int, dtype, device, requires_grad):
    """A fake tensor of this layout on the load's fake storage number `storage` (made on first use)."""
    mode, storages = _load["mode"], _load.setdefault("storages", {})
    with mode:
        if storage not in storages:
            storages[storage] = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        t = torch.empty(0, dtype=dtype, device=device)
        t.set_(storages[storage], offset, shape, stride)
    return t.requires_grad_(requires_grad) if requires_grad else t
