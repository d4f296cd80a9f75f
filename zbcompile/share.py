"""The share of the user's model a PipelineModule exposes as an nn.Module: this rank's parameters and buffers under
the model's own fully qualified names, in plain containers mirroring the model's tree, so torch's state-dict
helpers and torch.distributed.checkpoint see the user's keys (zbcompile/checkpoint.py).

    share_of(model, params, buffers)          FQN -> live tensor, in state_dict order
    attach_share(root, model, params, buffers)   register them in `root` under those FQNs
"""

from __future__ import annotations

import torch
from torch import nn

from zbcompile._torch_private import STATE_DICT_HOOKS
from zbcompile.errors import UsageError

__all__ = ["share_of", "attach_share", "set_mode", "module_settings", "plain_value", "same_value", "RefusedHooks"]


def share_of(model: nn.Module, params, buffers) -> dict[str, torch.Tensor]:
    """FQN -> live tensor for every entry of `model.state_dict()` that is one of the parameters `params` or the
    buffers `buffers` (names in the model), in state_dict order; a tied parameter under each of its names."""
    held = {id(model.get_parameter(n)) for n in params} | {id(model.get_buffer(n)) for n in buffers}
    out: dict[str, torch.Tensor] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name, p in mod._parameters.items():
            if p is not None and id(p) in held:
                out[prefix + name] = p
        for name, b in mod._buffers.items():
            if b is not None and id(b) in held and name not in mod._non_persistent_buffers_set:
                out[prefix + name] = b
    return out


def attach_share(root: nn.Module, model: nn.Module, params, buffers) -> None:
    """Register `share_of(model, params, buffers)` in `root` under the same FQNs, in plain container modules
    mirroring the model's tree: root.state_dict() then has the model's keys for these tensors, in the model's
    order, and named_parameters() names a tied parameter as the model does (its first name).

    Entries go into the `_modules` / `_parameters` / `_buffers` dicts directly: a user's name may equal one of
    root's own attributes (`model`, `rank`), which register_module would refuse; state_dict, load_state_dict
    and named_parameters read those dicts, never the attributes."""
    for fqn, tensor in share_of(model, params, buffers).items():
        *path, leaf = fqn.split(".")
        mod = root
        for depth, part in enumerate(path, 1):
            if part not in mod._modules:
                mod._modules[part] = _container(model.get_submodule(".".join(path[:depth])))
            mod = mod._modules[part]
        (mod._parameters if isinstance(tensor, nn.Parameter) else mod._buffers)[leaf] = tensor


def set_mode(root: nn.Module, mode: bool) -> None:
    """Every container under `root` reports `mode` as its `training`, as nn.Module.train sets each submodule's
    (code reading `m.training` of a pipe's modules sees the pipe's mode; the containers refuse train() itself)."""
    for m in root.modules():
        if issubclass(type(m), _Share):
            m.__dict__["training"] = mode


class RefusedHooks:
    """A module's hook registrations, each refused through `self._refuse(what)`: the compiled step runs the graphs
    traced at compile, never a module's forward or an autograd backward of it, so such a hook would never run.
    Mixed in before nn.Module by the pipe's containers and by PipelineModule itself."""

    def register_forward_hook(self, *args, **kwargs):
        self._refuse("a forward hook")

    def register_forward_pre_hook(self, *args, **kwargs):
        self._refuse("a forward pre-hook")

    def register_full_backward_hook(self, *args, **kwargs):
        self._refuse("a backward hook")

    def register_full_backward_pre_hook(self, *args, **kwargs):
        self._refuse("a backward pre-hook")

    def register_backward_hook(self, *args, **kwargs):
        self._refuse("a backward hook")


class _Share(RefusedHooks, nn.Module):
    """A container of a PipelineModule's share: one module path of the user's model, holding this rank's tensors
    under their names. It is not the user's module (that one is in `pipe.model`, and the compiled step runs the
    graphs traced from it): what would act on a module (a mode, a hook, apply, a call, an index, a new value
    of a setting) is refused instead of being silently ignored.

    To code that sorts a model's modules it is the user's module: `isinstance(m, nn.LayerNorm)` holds (its
    `__class__` is the user's class, as a mock's is), its settings (eps, normalized_shape, p, ...) read as the
    user's, and its repr is the user's. Optimizer groups built by module type (HF Trainer's no-decay names,
    minGPT's configure_optimizers) then come out as on the plain model; the container's own type keeps the
    user's methods (forward, reset_parameters) out of reach."""

    def __init__(self, module: nn.Module | None = None):
        nn.Module.__init__(self)   # not the next class of a subclass's MRO (a batch norm's needs num_features)
        if module is not None:
            settings = module_settings(module)
            self.__dict__.update(settings, _user_class=type(module), _user_module=module,
                                 _settings=frozenset(settings))
            # the module's state-dict hooks (a storage convention, a legacy key renamed on load), run by torch's
            # state_dict / load_state_dict here as on the module, those added later too
            self.__dict__.update({name: _UserHooks(module, name) for name in STATE_DICT_HOOKS})

    @property
    def __class__(self):
        return self.__dict__.get("_user_class", type(self))

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__.get("_settings", ()) and not same_value(value, self.__dict__[name]):
            self._refuse(f"setting .{name} = {value!r}")
        super().__setattr__(name, value)

    # ---- state dicts: the user's class's own code, as torch would run it on the user's module ----
    # torch asks `self.__class__` (the user's class) whether there is extra state, then calls it on this
    # container; a class's own _save_to_state_dict / _load_from_state_dict (an extra key, a legacy key renamed)
    # run here with this container as self, so their super() calls read and write this rank's tensors
    def get_extra_state(self):
        return self.__dict__["_user_module"].get_extra_state()

    def set_extra_state(self, state) -> None:
        self.__dict__["_user_module"].set_extra_state(state)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        own = self._user_code("_save_to_state_dict")
        if own is None:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        return own(self, destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        own = self._user_code("_load_from_state_dict")
        if own is None:
            return super()._load_from_state_dict(state_dict, prefix, *args)
        return own(self, state_dict, prefix, *args)

    def _user_code(self, name: str):
        """The user's class's own `name` (None: torch's nn.Module one, or no user module)."""
        user = self.__dict__.get("_user_class")
        fn = getattr(user, name, None)
        return None if fn is None or fn is getattr(nn.Module, name) else fn

    def extra_repr(self) -> str:
        user = self.__dict__.get("_user_class")
        try:   # the user's extra_repr, where it reads only the settings copied here
            return user.extra_repr(self) if user is not None else ""
        except (AttributeError, KeyError, TypeError):
            return ""

    def _refuse(self, what: str):
        raise UsageError(
            f"{what} on a container of a PipelineModule (pipe.<name>): it holds this rank's parameters and buffers "
            "under your model's names but is not your module, and the compiled step runs the graphs traced at "
            "compile, which never see it. Switch modes with pipe.train() / pipe.eval(); register forward hooks, "
            "swap modules and initialize before zbcompile.compile; change values in place through "
            "pipe.named_parameters() (your modules themselves are pipe.model's)")

    def train(self, mode: bool = True):
        self._refuse(".train() / .eval()")

    def apply(self, fn):
        self._refuse(".apply(fn) (reached through pipe.apply)")

    def forward(self, *args, **kwargs):
        self._refuse("a call")

    def __getitem__(self, index):
        self._refuse(f"indexing [{index!r}]")


class _UserHooks:
    """One of a user module's state-dict hook dicts (`name`), as torch reads it on the module's container: each
    hook is called with the user's module where torch passes the container (the hook reads the module's own
    attributes, which the container does not copy; this rank's tensors are the same objects in both). A hook
    registered on the container goes into the module's dict. Load pre-hooks get no module (torch binds one
    registered with_module=True to the user's module itself)."""

    def __init__(self, module: nn.Module, name: str):
        self._module, self._hooks = module, getattr(module, name)
        self._module_first = name != "_load_state_dict_pre_hooks"

    def values(self):
        if not self._module_first:
            return list(self._hooks.values())
        return [_called_on(hook, self._module) for hook in self._hooks.values()]

    def __setitem__(self, key, hook) -> None:
        self._hooks[key] = hook

    def __delitem__(self, key) -> None:
        del self._hooks[key]

    def __contains__(self, key) -> bool:
        return key in self._hooks

    def __len__(self) -> int:
        return len(self._hooks)


def _called_on(hook, module: nn.Module):
    def call(_container, *args):
        return hook(module, *args)

    call._from_public_api = getattr(hook, "_from_public_api", False)   # (torch ignores what public ones return)
    return call


class _BatchNormShare(_Share, nn.modules.batchnorm._BatchNorm):
    """The container of a batch-norm module's share. It passes torch's `isinstance(m, _BatchNorm)` checks and
    carries the module's settings (its repr, and load_state_dict's handling of checkpoints without
    num_batches_tracked, are then batch norm's), so that what acts on every batch norm of a model acts here or
    says why it cannot: torch.optim.swa_utils.update_bn resets the statistics, sets `momentum = None` (a
    cumulative average) and runs the model, but the compiled step updates the statistics with the momentum it
    was traced with. Resetting and a new momentum are refused before anything is changed."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        _Share.__init__(self, bn)   # momentum, under the property below, is read from __dict__ too
        self.__dict__["_settings"] -= {"momentum"}

    @property
    def momentum(self):
        return self.__dict__["momentum"]

    @momentum.setter
    def momentum(self, value):
        if value != self.__dict__["momentum"]:
            self._refuse_statistics(f"momentum = {value!r}")

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")

    def reset_running_stats(self):
        self._refuse_statistics(".reset_running_stats()")

    def reset_parameters(self):
        self._refuse_statistics(".reset_parameters()")

    def _refuse_statistics(self, what: str):
        raise UsageError(
            f"{what} on a batch norm of a PipelineModule (torch.optim.swa_utils.update_bn does this): the compiled "
            f"step updates the running statistics with the momentum it was traced with ({self.momentum}), so "
            "they cannot be recomputed as a cumulative average here; nothing was changed. Recompute them on the "
            "plain model (zbcompile.checkpoint.load loads a pipeline's checkpoint into it), then load its state "
            "into the pipe: pipe.load_state_dict(model.state_dict(), strict=False)")


def _container(module: nn.Module) -> _Share:
    """The container for the share of `module` (the user's module at that path)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return _BatchNormShare(module)
    return _Share(module)


def module_settings(m: nn.Module) -> dict:
    """A module's settings: its public attributes holding plain values (eps, p, normalized_shape, a
    temperature), not its mode (`training`), tensors, submodules or objects."""
    return {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training" and plain_value(v)}


def plain_value(value) -> bool:
    """A value the trace may have baked in as a constant: a number, a string, a dtype, a tuple of them."""
    if isinstance(value, tuple):
        return all(map(plain_value, value))
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


def same_value(a, b) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))   # (NaN is NaN)
