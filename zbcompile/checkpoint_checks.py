"""What a checkpoint or a state dict is checked for before anything is read into the model: every key this rank
loads present with the model's shape, no key no rank of this model would load, the optimizer's entries for every
parameter it holds, and (before a save) no entry that is not a tensor. Each problem is one line of a
CheckpointError that lists the first few and says what to do; zbcompile/checkpoint.py gathers every rank's
problems first, so that every rank raises together.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from zbcompile.checkpoint_rows import vocab_names, vocab_rows
from zbcompile.errors import CheckpointError
from zbcompile.share import share_of

__all__ = ["check_state_dict", "check_tensors_only", "checkpoint_problems", "message", "listing"]

_SHOWN = 8   # mismatches named in an error


def check_state_dict(state_dict: Mapping[str, object], expected: Mapping[str, torch.Tensor], *, strict: bool = True,
                     where: str = "") -> None:
    """Raise CheckpointError unless `state_dict` has a tensor of the expected shape for every key of `expected`
    and no other keys; strict=False skips missing and unexpected keys, as nn.Module.load_state_dict does (it then
    reports them in its result). Shapes are checked whatever `strict` says: nothing is copied on a mismatch."""
    shapes = {k: _shape(v) for k, v in state_dict.items()}
    problems = _mismatches(shapes, {k: _shape(v) for k, v in expected.items()}, missing=strict,
                           unexpected=strict)
    if problems:
        raise CheckpointError(message(f"the state dict given to load_state_dict ({where})", problems,
                                       "pass the state dict of this model (or load with strict=False to skip "
                                       "missing and unexpected keys; shapes must match)"))


def _shape(value) -> tuple | None:
    """A tensor's shape; None for a module's extra state (get_extra_state: any object)."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def check_tensors_only(module: nn.Module) -> None:
    """CheckpointError, before anything is written, for a state dict entry that is not a tensor: a module's
    extra state (get_extra_state), which DCP stores flattened into keys of its own that a load cannot match."""
    objects = [k for k, v in module.state_dict().items() if not isinstance(v, torch.Tensor)]
    if objects:
        raise CheckpointError(
            f"the state dict holds {', '.join(objects[:_SHOWN])}: a module's extra state (get_extra_state), which "
            "zbcompile.checkpoint does not store; nothing was written. Save it with the checkpoint as JSON values "
            "(checkpoint.save(..., extra={'calibration': ...}), which load returns) and set it back after the load")


def _mismatches(got: Mapping[str, tuple], want: Mapping[str, tuple], *, missing: bool = True,
                unexpected: bool = True, prefix: str = "") -> list[str]:
    """(missing) Missing keys, then other shapes, then (unexpected) unexpected keys, each as one line."""
    absent = [f"missing: {prefix}{k} {_said(s)}" for k, s in want.items() if k not in got] if missing else []
    shape = [f"shape: {prefix}{k} is {_said(got[k])} there, {_said(s)} in the model" for k, s in want.items()
             if k in got and got[k] != s]
    extra = [f"unexpected: {prefix}{k}" for k in got if k not in want] if unexpected else []
    return absent + shape + extra


def _said(shape: tuple | None) -> str:
    return "(extra state)" if shape is None else str(list(shape))


def message(what: str, problems: list[str], fix: str) -> str:
    return (f"{what} does not fit this model, nothing was loaded; {len(problems)} mismatch(es):\n  "
            f"{listing(problems)}\nIt comes from another model or another configuration of it: {fix}.")


def listing(problems: list[str]) -> str:
    """The first _SHOWN problems, one per line, and how many more there are."""
    more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return "\n  ".join(problems[:_SHOWN]) + more


def checkpoint_problems(meta: Mapping[str, object], module: nn.Module, optimizer) -> list[str]:
    """This rank's mismatches between the checkpoint's index `meta` and `module` / `optimizer`: keys this rank
    loads that are missing or have other shapes, model keys that no rank of this model would load, and
    parameters of `optimizer` without saved optimizer state."""
    saved = {k[len("model."):]: tuple(m.size) if hasattr(m, "size") else None   # (None: an object, extra state)
             for k, m in meta.items() if k.startswith("model.")}
    mine = {k: _shape(v) for k, v in module.state_dict(keep_vars=True).items()}
    found = vocab_rows(module)
    if found is not None:   # the checkpoint holds the whole tables this rank holds rows of
        for name in vocab_names(module, found[0]):
            mine[name] = (found[0].size, *mine[name][1:])
    problems = _mismatches(saved, mine, unexpected=False, prefix="model.")   # the others' keys: checked below
    problems += [f"unexpected: model.{k}" for k in saved if k not in _whole_model_keys(module)]
    if optimizer is not None:
        problems += _optimizer_problems(meta, module, optimizer)
    return problems


def _whole_model_keys(module: nn.Module) -> set[str]:
    """The model keys some rank of this pipeline holds (every key of a plain module)."""
    staged = getattr(module, "staged", None)
    if staged is None:
        return set(module.state_dict(keep_vars=True))
    params = {p for st in staged.stages for p in st.params} | set(staged.vocab.params if staged.vocab else ())
    buffers = {b for st in staged.stages for b in st.buffers}
    return set(share_of(module.model, params, buffers))


def _optimizer_problems(meta: Mapping[str, object], module: nn.Module, optimizer) -> list[str]:
    """Every parameter of `optimizer` needs its param-group entries in the checkpoint (written for every
    parameter the saving optimizer held, with or without state)."""
    saved = {k for k in meta if k.startswith("optim.param_groups.")}
    if not saved:
        return ["no optimizer state in the checkpoint (it was saved without an optimizer): load without one"]
    names = {id(p): n for n, p in module.named_parameters()}
    wanted = [names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names]
    have = {k[len("optim.param_groups."):].rsplit(".", 1)[0] for k in saved}
    return [f"missing: optimizer state of {n}" for n in wanted if n not in have]
