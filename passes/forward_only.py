"""Forward-only stages: the split's F graphs without what only a backward needs, in train or eval mode.

    forward_stages(staged, training=False)   -> StagedModel whose F graphs return act:* and loss only

An evaluation step runs the same split's forward graphs, so it needs no second trace and no second copy of the
parameters. Each F graph keeps its activations (sent on) and the loss, and drops the saved:* outputs (nothing is
kept for a backward; dead-code elimination removes what computed only them). In train mode (`training=True`,
`torch.no_grad()` around a forward in torch) the updated buffers stay outputs, as in eager. In eval mode:

- the ops traced with a `training` argument run with it False: dropout passes its input through, BatchNorm
  normalizes with its running statistics, RReLU uses its mean slope;
- buffer updates are dropped (BatchNorm's running statistics and `num_batches_tracked` stay as they are);
- a random op left over (a dropout written by hand as `x * (torch.rand_like(x) > p)`, or a module that chose its
  train-mode path in Python, `if self.training:`) raises UsageError naming it and its module: the trace fixed
  that path, and evaluation would silently run it.

The backward graphs are left as they are (a forward-only program never calls them).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import fx

from zbcompile.errors import UsageError
from zbcompile.ir.names import Role, role_of
from zbcompile.ir.stages import Graph, Stage, StagedModel

__all__ = ["forward_stages", "forward_graph", "TRAINING_ARGUMENT"]

aten = torch.ops.aten

# op -> the position of its `training` argument
TRAINING_ARGUMENT = {
    aten.native_dropout.default: 2,
    aten._native_batch_norm_legit_functional.default: 5,
    aten._native_batch_norm_legit.default: 5,
    aten.native_batch_norm.default: 5,
    aten.rrelu_with_noise_functional.default: 4,
    aten.rrelu_with_noise.default: 4,
}

# what draws random numbers: left in an eval-mode graph, it was a train-mode path the trace fixed
_RANDOM = ("bernoulli", "rand", "randn", "randint", "randperm", "normal", "uniform", "exponential", "multinomial",
           "poisson", "native_dropout", "rrelu_with_noise", "geometric", "cauchy", "log_normal")


def forward_stages(staged: StagedModel, training: bool) -> StagedModel:
    """`staged` with every stage's F replaced by forward_graph(F, training); see the module docstring."""
    if staged.vocab is not None:
        raise UsageError("a forward-only step (evaluate) is not built for vocabulary parallelism yet: its sharded "
                         "output layer and loss run inside the training schedule's vocabulary passes; evaluate "
                         "with a copy compiled without vocab_parallel, or on the plain model")
    stages = tuple(dataclasses.replace(st, f=forward_graph(st, training)) for st in staged.stages)
    return dataclasses.replace(staged, stages=stages)


def forward_graph(stage: Stage, training: bool) -> Graph:
    """Stage `stage`'s F graph returning only act:* and loss (and, with training, the updated buffers)."""
    f = stage.f
    keep = [i for i, n in enumerate(f.outputs)
            if role_of(n) in (Role.ACT, Role.LOSS) or (training and role_of(n) is Role.BUFFER)]
    gm = fx.GraphModule(f.gm, copy.deepcopy(f.gm.graph))
    graph = gm.graph
    out = graph.output_node()
    out.args = (tuple(out.args[0][i] for i in keep),)
    if not training:
        _to_eval_mode(graph, stage.index)
    graph.eliminate_dead_code(is_impure_node=_impure)
    gm.recompile()
    outputs = tuple(f.outputs[i] for i in keep)
    return dataclasses.replace(f, gm=gm, outputs=outputs,
                               passthrough=tuple(n for n in f.passthrough if n in outputs)).check(
        f"forward-only stage {stage.index}")


def _to_eval_mode(graph: fx.Graph, stage: int) -> None:
    """Every op's `training` argument set False; UsageError for a random op that still draws."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        pos = TRAINING_ARGUMENT.get(node.target)
        if pos is not None:
            args = list(node.args)
            if len(args) > pos:
                args[pos] = False
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, "training" if "batch_norm" in str(node.target) or "rrelu" in
                               str(node.target) else "train": False}
            continue
    graph.eliminate_dead_code(is_impure_node=_impure)
    for node in graph.nodes:
        if node.op == "call_function" and node.target not in TRAINING_ARGUMENT and _draws(node.target):
            module = _module_of(node)
            raise UsageError(
                f"stage {stage}: the traced forward draws random numbers in {module} ({node.target}), which "
                "evaluation cannot switch off: dropout and BatchNorm are switched by their ops, but this path was "
                "fixed when the step was traced in train mode (a hand-written dropout, or an `if self.training:` "
                "branch). Use nn.Dropout / F.dropout(training=self.training) there, or evaluate the plain model")


def _impure(node: fx.Node) -> bool:
    """fx's rule, except that a random op whose result nobody reads is dead (a dropout mask kept for B)."""
    return node.is_impure(impure_random=False)


def _draws(target) -> bool:
    name = getattr(target, "__name__", str(target)).split(".")[0]
    return name in _RANDOM or name.rstrip("_") in _RANDOM or name.removesuffix("_like") in _RANDOM


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "the model's own forward"
    path, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", str(cls)).rsplit(".", 1)[-1]
    return f"module {path or '(root)'} ({name})"
