"""The optimizers a pipeline's parameters cannot be stepped by: one whose step combines every parameter's values
(LBFGS) is refused, by the post-validated step and by a global optimizer step pre-hook over any pipe's
parameters, before it changes anything. And a post-validated step's optimizer, whose state the verdict may
still change: a load settles the step first, a read before the verdict warns (`watch_pending`)."""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zbcompile.errors import UsageError, ZBCompileWarning

__all__ = ["check_cross_parameter", "watch_optimizers", "watch_pending"]

# Optimizers whose step combines values across all their parameters (LBFGS: dot products of the whole parameter
# vector, a line search on the whole loss): each rank of a pipeline holds only its share, so each would step by
# its own share's curvature and stopping tests, a model no single process trains.
_CROSS_PARAMETER = (torch.optim.LBFGS,)
_PIPES: weakref.WeakSet = weakref.WeakSet()   # every live PipelineModule, for the optimizer hook below
_HOOK: list = []


def check_cross_parameter(optimizer) -> None:
    """UsageError for an optimizer whose step combines every parameter's values (LBFGS)."""
    if isinstance(optimizer, _CROSS_PARAMETER):
        raise UsageError(f"{type(optimizer).__name__} over a pipeline's parameters: its step combines values "
                         "across all the parameters it holds (dot products, a line search), but each pipeline "
                         "rank holds only its own share, so every rank would step by its share alone, unlike "
                         "eager. Use an optimizer that updates each parameter from its own state (SGD, Adam, "
                         "AdamW, Adagrad, RMSprop, ...)")


def watch_optimizers(pipe: nn.Module) -> None:
    """Refuse, from then on, a step of an optimizer check_cross_parameter refuses over any of `pipe`'s
    parameters (a user's own `lbfgs.step(closure)` around pipe.step), before it changes anything: one global
    optimizer step pre-hook, registered once."""
    _PIPES.add(pipe)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_over_a_pipe))


def _refuse_over_a_pipe(optimizer, args, kwargs) -> None:
    if isinstance(optimizer, _CROSS_PARAMETER):
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(p) in held for pipe in list(_PIPES) for p in pipe.parameters()):
            check_cross_parameter(optimizer)


def watch_pending(pipe, optimizer) -> tuple:
    """Hooks on the optimizer of `pipe`'s post-validated steps (their handles). optimizer.load_state_dict()
    settles the pending step first, as pipe.load_state_dict() does: the verdict would otherwise undo or make the
    step's update over the loaded state (every rank loads its own optimizer, at the same point of the loop).
    optimizer.state_dict() read before the verdict warns: the verdict may still change what it returned (it does
    not settle: a rank reading it alone would wait on the others)."""
    pipe = weakref.ref(pipe)   # (the hooks stay with the user's optimizer; the pipe may go first)

    def settle(optimizer, state_dict) -> None:
        owner = pipe()
        if owner is not None and owner._failure is None:   # (a failed pipe's step is lost: load into it)
            owner.settle()

    def warn(optimizer) -> None:
        owner = pipe()
        b = owner._pv.boundary if owner is not None and owner._pv is not None else None
        if b is not None and b.pending is not None and b.rank < b.ranks - 1 and owner._failure is None:
            warnings.warn(f"rank {b.rank}: optimizer.state_dict() read before the last post-validated step's "
                          "verdict, which may still undo and redo its update: a checkpoint of it may hold an "
                          "update that is not the one kept. Call pipe.settle() on every rank first (or save with "
                          "pipe.state_dict() / zbcompile.checkpoint, which settle)", ZBCompileWarning, stacklevel=3)
    return optimizer.register_load_state_dict_pre_hook(settle), optimizer.register_state_dict_pre_hook(warn)
