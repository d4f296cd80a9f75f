"""A trace-time pass: every custom `torch.autograd.Function` the model applies becomes a custom op that keeps the
user's backward.

Non-strict torch.export runs a Function's `forward` like any Python code and records its aten ops, so the stage
graphs would differentiate those ops and the Function's own `backward` (a straight-through estimator, a gradient
reversal, a hand-written fused gradient) would be silently lost. While the step is traced, `Function.apply` of
a class not from torch itself calls an op `zbfn::<Class>_<digest>` instead (torch.library.custom_op, schema
`(Tensor[] ts) -> Tensor[]`):

    forward    the Function's forward under no_grad (and setup_context, for the new style), on real or fake
               tensors; an output sharing storage with an input is cloned (a custom op may not alias one)
    backward   registered with the op: it runs the forward again on the saved inputs, to rebuild the context
               its backward reads (ctx.saved_tensors, attributes set on ctx, needs_input_grad), then calls the
               user's backward. The joint trace of each stage records those ops, so B and W get them like any
               other backward op.

Recomputing instead of saving keeps the stage graph's values plain tensors; the price is the forward's ops again
in the backward, and three refusals, as TraceError at trace time: a forward that draws random numbers (the
recompute would draw others), one that writes an input in place (ctx.mark_dirty), and one that reads a tensor
requiring grad it was not passed (a module's parameters, as a hand-written checkpoint does: only the op's inputs
get gradients).

Non-tensor arguments (numbers, strings, dtypes, None, or any object) are constants of the op: one op per class
and distinct constants. Torch's own Functions are traced through as before, their backward being the derivative
of their forward. Activation checkpointing of either kind (`torch.utils.checkpoint.checkpoint`) is traced as the
plain call of its block: the recompute changes no value (it replays the random state), and what a stage keeps
for its backward is the pipeline's own plan. The reentrant kind is a Function whose forward runs under no_grad;
the non-reentrant kind's saved-tensor hooks, nested, made export record the whole step as a no_grad region.
As eager, a reentrant block none of whose inputs requires grad is a no_grad region (torch warns: its weights get
no gradient).
"""

from __future__ import annotations

import hashlib
import inspect
import re
import threading
from contextlib import contextmanager

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import check_backward_validity

from zbcompile._torch_private import (NON_REENTRANT_CHECKPOINT, OpOverload, StorageWeakRef, TorchDispatchMode,
                                      checkpoint_module, is_fake)
from zbcompile.errors import TraceError

__all__ = ["functions_as_ops", "op_parts", "op_from_parts"]

_LIBRARY = "zbfn"
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_lock = threading.RLock()
_ops: dict[tuple, "_FunctionOp"] = {}   # (class, input spec, constants key) -> its op, for the process
_names: dict[str, tuple] = {}           # op name -> the key it was made for


@contextmanager
def functions_as_ops():
    """While active (one trace), `Function.apply` of a user Function calls its custom op (module docstring), a
    gradient hook registered on a traced tensor and torch.autograd.grad over traced tensors raise TraceError,
    and `torch.inference_mode()` in the traced thread is a no_grad region."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls is _reentrant_checkpoint():
            # its forward runs the block under no_grad and its backward needs autograd.backward: traced as the
            # plain call instead, the stage graphs keep what the backward reads (same gradients)
            run_function, _preserve_rng, *inputs = args
            return _reentrant_as_plain(run_function, inputs)
        if _from_torch(cls):
            return original.__func__(cls, *args, **kwargs)
        if kwargs:   # as torch's apply does: keywords bound to forward's positions
            args, kwargs = inspect.signature(cls.forward).bind(*args, **kwargs).args, {}
        return _op_for(cls, args, kwargs)(args, kwargs)

    register_hook, tracer = torch.Tensor.register_hook, threading.get_ident()

    def refuse_hook(tensor, hook):
        if not is_fake(tensor):   # (another thread's real tensors, while this one traces)
            return register_hook(tensor, hook)
        raise TraceError(
            "the model registers a gradient hook on a tensor inside forward (`tensor.register_hook`): the traced "
            "step does not record it, and the gradients before it would silently differ from eager's. Write it as "
            "a custom torch.autograd.Function whose backward does what the hook does (zbcompile traces those): "
            "e.g. forward returns x.view_as(x), backward returns the hook's result for the gradient")

    autograd_grad = torch.autograd.grad

    def refuse_grad(outputs, inputs, *args, **kwargs):
        leaves = [t for t in (*pytree.tree_leaves(outputs), *pytree.tree_leaves(inputs)) if isinstance(t, torch.Tensor)]
        if threading.get_ident() != tracer or not any(map(is_fake, leaves)):
            return autograd_grad(outputs, inputs, *args, **kwargs)
        raise TraceError(
            "the model calls torch.autograd.grad inside forward (a gradient penalty, an input-gradient feature): "
            "a pipeline stage's backward is split from its forward and cannot run a backward of its own inside "
            "the forward. Compute such a term outside the pipelined step, or write it as ops of the forward")

    non_reentrant = getattr(checkpoint_module, NON_REENTRANT_CHECKPOINT)

    def non_reentrant_as_plain(*args, **kwargs):
        # checkpoint() runs the block between this generator's two steps: yielding once, with no hooks, leaves
        # the plain call (other threads' real checkpoints, while this one traces, keep torch's)
        if threading.get_ident() != tracer:
            return (yield from non_reentrant(*args, **kwargs))
        yield

    inference = torch.inference_mode
    enter, leave = inference.__enter__, inference.__exit__

    def enter_as_no_grad(self):
        # export records a grad-mode switch (a no_grad region), not inference mode: gradients flowed through
        # the region where eager's have none. Traced as the no_grad region it is to autograd.
        if threading.get_ident() != tracer or not self.mode:
            return enter(self)
        self._zb_grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)

    def leave_as_no_grad(self, *exc):
        if not hasattr(self, "_zb_grad"):
            return leave(self, *exc)
        torch.set_grad_enabled(self.__dict__.pop("_zb_grad"))

    with _lock:   # one patched trace at a time: the patch is process-wide
        base.apply = classmethod(apply)
        torch.Tensor.register_hook = refuse_hook
        inference.__enter__, inference.__exit__ = enter_as_no_grad, leave_as_no_grad
        torch.autograd.grad = refuse_grad
        setattr(checkpoint_module, NON_REENTRANT_CHECKPOINT, non_reentrant_as_plain)
        try:
            yield
        finally:
            setattr(checkpoint_module, NON_REENTRANT_CHECKPOINT, non_reentrant)
            base.apply = original
            torch.Tensor.register_hook = register_hook
            inference.__enter__, inference.__exit__ = enter, leave
            torch.autograd.grad = autograd_grad


def op_parts(target) -> tuple | None:
    """What makes the op `target` (an fx node's target) again in another process, by `op_from_parts`: (class,
    argument tree, tensor mask, constants); None for any other op, and for one whose constants are objects told
    apart by identity (they mean nothing elsewhere)."""
    name = target.name() if isinstance(target, OpOverload) else ""
    key = _names.get(name.split("::")[-1]) if name.startswith(_LIBRARY + "::") else None
    op = _ops.get(key) if key is not None else None
    if op is None or not all(isinstance(c, _PLAIN) for c in op.consts):
        return None
    return op.cls, op.spec, op.mask, op.consts


def op_from_parts(cls, spec, mask, consts):
    """The op `op_parts` describes (made here if this process has not made it yet)."""
    return getattr(getattr(torch.ops, _LIBRARY), _function_op(cls, spec, mask, consts).name).default


def _reentrant_as_plain(run_function, inputs):
    """A reentrant checkpoint's block called plainly, as eager runs it: a no_grad region where no input requires
    grad (eager's CheckpointFunction then makes an output without a gradient; torch's own warning is given)."""
    check_backward_validity(inputs)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return run_function(*inputs)
    with torch.no_grad():
        return run_function(*inputs)


def _reentrant_checkpoint():
    from torch.utils.checkpoint import CheckpointFunction

    return CheckpointFunction


def _from_torch(cls) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")


def _op_for(cls, args, kwargs) -> "_FunctionOp":
    leaves, spec = pytree.tree_flatten((args, kwargs))
    mask = tuple(isinstance(x, torch.Tensor) for x in leaves)
    return _function_op(cls, spec, mask, tuple(None if m else x for m, x in zip(mask, leaves)))


def _function_op(cls, spec, mask, consts) -> "_FunctionOp":
    plain = all(isinstance(c, _PLAIN) for c in consts)
    key = (cls, str(spec), mask, repr(consts) if plain else tuple(map(id, consts)))
    with _lock:
        if key not in _ops:
            _ops[key] = _FunctionOp(cls, spec, mask, consts, _name(cls, key, plain))
        return _ops[key]


def _name(cls, key, plain: bool) -> str:
    """`<Class>_<digest>`: the same in every process that makes the same op (ranks compare their stage graphs),
    numbered on where two keys would share one (constants told apart by identity)."""
    content = repr((cls.__module__, cls.__qualname__, key[1], key[2], key[3] if plain else "by identity"))
    stem = re.sub(r"\W", "_", cls.__qualname__) + "_" + hashlib.sha1(content.encode()).hexdigest()[:10]
    name, n = stem, 1
    while name in _names and _names[name] != key:
        n += 1
        name = f"{stem}_{n}"
    _names[name] = key
    return name


class _Ctx:
    """What a Function's forward and backward read and write on `ctx`, rebuilt for each run."""

    def __init__(self, owner: str, needs_input_grad: tuple[bool, ...]) -> None:
        self._owner = owner
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors) -> None:
        raise TraceError(f"torch.autograd.Function `{self._owner}` marks an input dirty (writes it in place), "
                         "which a pipeline stage graph cannot carry; make its forward out of place (return a new "
                         "tensor)")


class _FunctionOp:
    """One user Function with fixed non-tensor arguments, as a custom op (module docstring)."""

    def __init__(self, cls, spec, mask, consts, name: str) -> None:
        self.cls, self.spec, self.mask, self.consts, self.name = cls, spec, mask, consts, name
        self.new_style = cls.setup_context is not torch.autograd.Function.setup_context
        self.out_spec = None   # the forward's output tree, with its non-tensor leaves (from the first run)
        self.op = torch.library.custom_op(f"{_LIBRARY}::{name}", self._impl, mutates_args=(),
                                          schema="(Tensor[] ts) -> Tensor[]")
        self.op.register_fake(self._fake)
        self.op.register_autograd(self._backward, setup_context=self._setup)

    def __call__(self, args, kwargs):
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outs = iter(self.op(tensors))
        spec, leaves = self.out_spec
        return pytree.tree_unflatten([next(outs) if x is _TENSOR else x for x in leaves], spec)

    def _args(self, tensors):
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(it) if m else c for m, c in zip(self.mask, self.consts)],
                                             self.spec)
        return args, kwargs

    def _forward(self, ctx: _Ctx, tensors):
        args, kwargs = self._args(tensors)
        with torch.no_grad():
            if not self.new_style:
                return self.cls.forward(ctx, *args, **kwargs)
            out = self.cls.forward(*args, **kwargs)
            self.cls.setup_context(ctx, args, out)
            return out

    def _run(self, tensors) -> list[torch.Tensor]:
        out = self._forward(_Ctx(self.cls.__qualname__, (False,) * len(tensors)), tensors)
        leaves, spec = pytree.tree_flatten(out)
        self.out_spec = spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        ins = {StorageWeakRef(t.untyped_storage()) for t in tensors}
        result, seen = [], set()
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = StorageWeakRef(x.untyped_storage())
                result.append(x.clone() if key in ins or key in seen else x)   # a custom op's outputs are fresh
                seen.add(key)
        return result

    def _impl(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._run(ts)

    def _fake(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        with _ForwardWatch(ts) as watch:
            out = self._run(ts)
        name = f"torch.autograd.Function `{self.cls.__qualname__}`"
        if watch.random:
            raise TraceError(f"{name} draws random numbers in its forward ({watch.random}); its backward runs the "
                             "forward again to rebuild ctx and would see other numbers. Draw them outside the "
                             "Function and pass them in as an argument")
        if watch.captured:
            raise TraceError(f"{name} reads a tensor that requires grad without taking it as an argument "
                             f"({watch.captured}, e.g. the parameters of a module it calls): only its tensor "
                             "arguments get gradients in a pipeline stage, so these would get none. Pass them as "
                             "arguments (and return their gradients from backward), or use "
                             "torch.utils.checkpoint.checkpoint for recomputation")
        return out

    @staticmethod
    def _setup(ctx, inputs, output) -> None:
        ctx.ts = inputs[0]
        ctx.wants = tuple(t.requires_grad for t in inputs[0])

    def _backward(self, ctx, grads):
        user = _Ctx(self.cls.__qualname__, self._needs(ctx.wants))
        outs = self._forward(user, ctx.ts)
        out_leaves = [x for x in pytree.tree_leaves(outs) if isinstance(x, torch.Tensor)]
        grads = [torch.zeros_like(o) if g is None and user.materialize_grads else g
                 for g, o in zip(grads, out_leaves)]
        got = self.cls.backward(user, *grads)
        got = got if isinstance(got, tuple) else (got,)
        return [g for g in self._input_grads(got, ctx.ts)],

    def _needs(self, wants: tuple[bool, ...]) -> tuple[bool, ...]:
        """ctx.needs_input_grad as torch gives it: per positional forward argument, whether it is a tensor that
        requires grad (a tensor inside a list or a dict gets no gradient from a Function)."""
        it = iter(wants)
        flags = [_Wants(next(it)) if m else None for m in self.mask]
        args, _ = pytree.tree_unflatten(flags, self.spec)
        return tuple(isinstance(a, _Wants) and a.value for a in args)

    def _input_grads(self, got, tensors) -> list:
        """The user's backward returns one gradient per positional argument; the op's gradient is one per tensor
        leaf (an argument that holds no tensor gets None from the user and is dropped)."""
        (args, _kwargs) = self._args(tensors)
        if len(got) < len(args):
            got = (*got, *([None] * (len(args) - len(got))))
        grads = []
        for a, g in zip(args, got):
            n = sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(a))
            grads += [g] if n == 1 and isinstance(a, torch.Tensor) else [None] * n
        return grads + [None] * (len(tensors) - len(grads))   # keyword tensors: a Function's backward gives none


_TENSOR = object()   # a tensor leaf's place in a Function's output tree


class _Wants:
    """A tensor argument's requires_grad, standing in its place in the argument tree."""

    def __init__(self, value: bool) -> None:
        self.value = value


_aten = torch.ops.aten
_DROPOUTS = (_aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default,
             _aten.feature_alpha_dropout.default, _aten.native_dropout.default)


def _draws(func, args, kwargs) -> bool:
    """Whether an op draws random numbers: tagged nondeterministic_seeded, unless a dropout that draws none
    (p == 0 or not training: F.dropout(x, p=cfg.dropout) with the dropout off, as HF Reformer's is)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    if func in _DROPOUTS:
        bound = {**dict(zip(("input", "p", "train"), args)), **kwargs}
        return bound.get("train") is not False and bound.get("p") != 0   # (native_dropout's train=None: True)
    return True


class _ForwardWatch(TorchDispatchMode):
    """What a Function's forward does that its op cannot carry, seen op by op: a random op (tagged
    nondeterministic_seeded), and a tensor that requires grad read without being an argument (nor made inside)."""

    def __init__(self, inputs) -> None:
        super().__init__()
        self.known = {id(t) for t in inputs}
        self.random = self.captured = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.random and _draws(func, args, kwargs or {}):
            self.random = str(func)
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) not in self.known and t.requires_grad and not self.captured:
                self.captured = f"{list(t.shape)} {t.dtype}, read by {func}"
        out = func(*args, **(kwargs or {}))
        self.known.update(id(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out
