"""Whether eval mode computes what the switched training graphs compute, checked before the first evaluation
in eval mode.

An evaluation runs the forward graphs traced in train mode, with dropout and batch norm switched by their ops
(passes/forward_only.py). A Python branch on `self.training` that draws no random numbers (`if self.training:
h = h * 0.5`, a hand-written batch norm choosing batch or running statistics) was fixed in its train-mode path
by the trace and leaves no op to switch: evaluate() and pipe(x) would return the train-mode result, silently.
So the first eval-mode evaluation traces the model again in eval mode and runs both steps, each whole and
forward only, on the compile's example data and the same stand-in values for every parameter and buffer (a
rank holds real values for its own stages only; two sets, positive and signed): a loss that differs on either
set is refused, naming the modules whose code reads `training`.

    check_eval_branches(model, loss_fn, example)    UsageError; else (checked, why pipe(x) cannot run in eval
                                                    mode or None)

A Bernoulli draw the switched graphs still make (torchvision's stochastic depth, `if not self.training: return
x` around `noise.bernoulli_(keep).div_(keep)`) is taken at its expectation in the switched step: where that
equals the eval-mode trace's loss (the inverted mask's expectation is 1, as the skipped branch), the evaluation
programs take it so too (compile_forward's `means`); unchecked, it stays refused.

The shapes are traced on the meta device, or where that fails to trace (a forward making a tensor without
`device=`) or to run (code choosing by device) on stand-ins where the example is. An example on the meta
device, a model of more than 2 GiB (the stand-ins are allocated whole), a step that fails on the stand-ins, and
a vocabulary-parallel pipe (its model holds this rank's rows of the tables) are not checked; a warning says so
(the last: the README). The two traces' output trees are compared too: where eval mode returns others (HF
XLNet's `mems`), pipe(x) in eval mode is refused (evaluate() reads the loss alone).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading

import torch
from torch import nn

from zbcompile import split
from zbcompile._torch_private import tree_map
from zbcompile.errors import UsageError, ZBCompileError
from zbcompile.ir.names import Role, key_of, role_of
from zbcompile.passes.forward_only import forward_loss
from zbcompile.passes.trace import flatten_example, retarget_device
from zbcompile.watch import names_read

__all__ = ["check_eval_branches"]

log = logging.getLogger("zbcompile")

# how far apart the two losses may be: the switched batch norm and the eval-mode one are other ops with the
# same arithmetic (rounding may differ in the last bits); a branch moves the loss far more (BigBird's random
# attention blocks, in training only, by ~4e-5 on the signed stand-ins)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-6}


def check_eval_branches(model: nn.Module, loss_fn, example) -> tuple[bool, str | None]:
    """UsageError where `model` in eval mode computes another loss than its train-mode trace with dropout and
    batch norm switched off and Bernoulli draws at their expectation (see the module docstring); else whether
    it was checked, and why pipe(x) in eval mode cannot return the model's outputs (the eval-mode trace returns
    another output tree), or None."""
    flat, _, _ = flatten_example(example)
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if any(t.is_meta for t in flat) or size > _LARGEST:
        log.warning("evaluate: the model's eval-mode branches are not checked (%s)",
                    "its example is on the meta device" if size <= _LARGEST else
                    f"{size / 2**30:.1f} GiB of parameters and buffers: more than the check allocates")
        return False, None
    log.info("evaluate: tracing the model in eval mode once, to check it computes what the switched training "
             "graphs do")
    with _CHECKING:   # ranks run as threads (the loopback world) would race on fx's process-wide annotations
        losses, trees, problem = _losses(model, loss_fn, example, flat)
    if losses is None:
        log.warning("evaluate: the model's eval-mode branches are not checked (%s)", problem)
        return False, None
    differ = [(got, want) for got, want in losses if not _close(got, want)]
    if not differ:
        return True, _outputs_differ(trees)
    got, want = differ[0]
    readers = [f"{n or '(the model)'} ({type(m).__name__})" for n, m in model.named_modules()
               if not type(m).__module__.startswith("torch.") and "training" in names_read(type(m))]
    raise UsageError(
        "the model computes another loss in eval mode than its training step with dropout and batch norm "
        f"switched off ({want.item():.12g} against {got.item():.12g}, on the example with stand-in weights): a "
        f"Python branch on `self.training`{' in ' + ', '.join(readers) if readers else ''} changes what the "
        "forward computes, and "
        "evaluate() / pipe(x) run the graphs traced in train mode, whose branches were fixed then. Evaluate in "
        "train mode (pipe.train(), then evaluate(); under no_grad in eager that is the train-mode forward), "
        "evaluate the plain model, or write the branch with nn.Dropout / BatchNorm modules (which eval() "
        "switches)")


def _losses(model: nn.Module, loss_fn, example, flat):
    """[(switched train-mode loss, eval-mode loss)] on each set of stand-in weights (`_values`), the output trees
    and ""; or None, None and why not.
    Traced on meta first (nothing allocated); where that fails to trace or its graphs fail to run, on stand-ins
    where the example is: a forward making a tensor without `device=` (torch.eye(n)) or a constant on the input's
    device cannot meet meta weights, and code choosing by device (HF's MoE router loss: `histc` on int32 unless
    on the CPU) traces another path on meta than the one the step runs."""
    device = flat[0].device
    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, example)
    problem = ""
    for where, data in (("meta", meta), (device, example)):
        try:
            graphs, trees = _both_modes(_stand_ins(model, where), loss_fn, data, device)
        except ZBCompileError as e:
            problem = f"tracing it failed: {e}"
            continue
        try:
            return [tuple(_loss(g, values) for g in graphs) for values in _values(graphs, flat)], trees, ""
        except (RuntimeError, IndexError, ValueError) as e:   # stand-ins a model cannot take (an id past a table)
            problem = f"its step fails on stand-in weights: {e}"
    return None, None, problem


# the check runs both steps on stand-in tensors of every parameter's shape (a rank holds real values for its
# own stages only): above this many bytes it is not made
_LARGEST = 2 * 2**30
_CHECKING = threading.Lock()


def _values(graphs, flat) -> list[dict[str, torch.Tensor]]:
    """Two sets of stand-ins, one per input name of either graph, equal for both graphs. Positive: floats in
    [0.5, 1.5) (a variance stays positive, a log finite). Signed: the parameters uniform around 0 with the
    variance 1 / their last dimension (a layer keeps its input's scale), the buffers as before. With positive
    weights alone every hidden vector points one way, and a branch choosing which of them to mix (BigBird's
    random attention blocks in training) moves the loss by less than rounding. Integers 0 or 1 (valid token
    ids and classes); the example's data as it is."""
    return [_stand_in_values(graphs, flat, signed) for signed in (False, True)]


def _stand_in_values(graphs, flat, signed: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for g in graphs:
        for name, node in zip(g.inputs, g.gm.graph.find_nodes(op="placeholder")):
            if name in out:
                continue
            if role_of(name) is Role.DATA:
                out[name] = flat[int(key_of(name))]
                continue
            v = node.meta["val"]
            if not v.is_floating_point():
                t = torch.randint(0, 2, v.shape, generator=gen)
            elif signed and role_of(name) is Role.PARAM:
                fan_in = v.shape[-1] if v.dim() > 1 else 1   # (unit variance through a layer, as nn.Linear's init)
                t = (torch.rand(v.shape, generator=gen, dtype=torch.float64) * 2 - 1) * (3 / fan_in) ** 0.5
            else:
                t = torch.rand(v.shape, generator=gen, dtype=torch.float64) + 0.5
            out[name] = t.to(dtype=v.dtype, device=flat[0].device)
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether the two modes' losses agree within the dtype's rounding (a loss that is not finite on these
    stand-ins shows nothing: the other set decides)."""
    tol = _TOLERANCE.get(want.dtype, 2e-2)   # (the loss's own dtype: a float32 model rounds in float32)
    got, want = got.double(), want.double()
    return not (got.isfinite() and want.isfinite()) or abs(got - want) <= tol * max(abs(want), abs(got), 1e-6)


def _both_modes(shape: nn.Module, loss_fn, example, device):
    """The step of `shape` traced in train mode with dropout and batch norm switched off, and traced in eval
    mode: each as a forward-only graph of the loss, its constants on `device`; and each trace's output tree."""
    trained = split.trace(shape, loss_fn, example)
    with _eval_modes(shape):
        evaluated = split.trace(shape, loss_fn, example)
    graphs = (forward_loss(trained.graph, training=False, means=True), forward_loss(evaluated.graph, training=True))
    return (tuple(dataclasses.replace(g, gm=retarget_device(g.gm, device)) for g in graphs),
            (trained.output_tree, evaluated.output_tree))


def _outputs_differ(trees) -> str | None:
    """Why pipe(x) in eval mode cannot return eager's outputs: the eval-mode trace returns another tree (HF
    XLNet adds its `mems` in eval mode), or None."""
    trained, evaluated = trees
    if trained is None or evaluated is None or trained == evaluated:
        return None
    return (f"the model returns other outputs in eval mode ({_fields(evaluated)}) than in the training step "
            f"traced at compile ({_fields(trained)}), and pipe(x) returns what the traced graphs compute. Make "
            "both modes return the same (HF: use_cache=False, use_mems_eval=False), call pipe(x) in train mode "
            "(dropout as in training: pipe.train()), or run the plain model; evaluate() is not affected")


def _fields(tree) -> str:
    """A tree's top-level keys (a dict, an HF ModelOutput), else its number of values."""
    keys = tree.context if isinstance(getattr(tree, "context", None), (list, tuple)) else None
    return ", ".join(map(str, keys)) if keys else f"{tree.num_leaves} values"


def _stand_ins(model: nn.Module, device) -> nn.Module:
    """A copy of `model` whose parameters and buffers are uninitialised tensors of their shapes on `device` (a
    rank holds real values for its own stages only); the tensors are not copied."""
    memo: dict[int, object] = {}
    for t in model.parameters():
        memo[id(t)] = nn.Parameter(torch.empty_like(t, device=device), requires_grad=t.requires_grad)
    for t in model.buffers():
        memo[id(t)] = torch.empty_like(t, device=device)
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _eval_modes(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _loss(graph, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """The graph's loss on `values`, with the global generator as it was (random ops of eval mode draw alike)."""
    args = [values[n] for n in graph.inputs]
    devices = sorted({t.device.index or 0 for t in args if t.is_cuda})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        return graph.gm(*args)[0].detach()
