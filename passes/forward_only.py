"""Forward-only stages: the split's F graphs without what only a backward needs, in train or eval mode.

    forward_stages(staged, training=False)   -> StagedModel whose F graphs return act:* and loss only

An evaluation step runs the same split's forward graphs, so it needs no second trace and no second copy of the
parameters. Each F graph keeps its activations (sent on) and the loss, and drops the saved:* outputs (nothing is
kept for a backward; dead-code elimination removes what computed only them). In train mode (`training=True`,
`torch.no_grad()` around a forward in torch) the updated buffers stay outputs, as in eager. In eval mode:

- the ops traced with a `training` argument run with it False: dropout passes its input through, BatchNorm
  normalizes with its running statistics, RReLU uses its mean slope;
- buffer updates are dropped (BatchNorm's and InstanceNorm's running statistics and `num_batches_tracked` stay
  as they are); an update of any other buffer (an EMA) raises UsageError naming it: the graph, traced in train
  mode, computes with the updated value, and whether eval mode would make the update (unconditional) or skip it
  (`if self.training:`) is not in it, so dropping it would silently match neither (train mode keeps it, as eager's
  no_grad forward in train mode does);
- a random op left over (a dropout written by hand as `x * (torch.rand_like(x) > p)`, or a module that chose its
  train-mode path in Python, `if self.training:`) raises UsageError naming it and its module: the trace fixed
  that path, and evaluation would silently run it.

The backward graphs are left as they are (a forward-only program never calls them).

With vocabulary parallelism (forward_vocab) the sharded output layer runs forward only as well: every rank's S
returns just its softmax statistics, and T, reading the gathered statistics and the targets, just the loss (the
online-softmax combine without the gradients, so neither saved logits nor a reduce of input gradients). IF is
the training step's; IB never runs.

    output_graph(partition)                   -> OutputGraph (or why there is none), kept in StagedModel.meta
    output_stages(staged, training)           -> StagedModel whose loss stage returns the model's outputs

A forward returning the model's outputs (`PipelineModule.forward`, `pipe(x)`) runs the same F graphs, except
on the loss stage: there it runs the stage's forward as the partition cut it (before the F/B/W split, which
renames values), returning `out:<k>` for each tensor leaf of the model's outputs instead of the loss, which
with the targets it reads is dropped. The trace knows which values those are from the model's call signature
(passes/trace.py); a model output the loss never reads is never computed, so such a model gets no forward.
With vocabulary parallelism that forward is the last stage as cut before its output layer was sharded
(VocabLayers.last), reading each vocabulary parameter whole as `vocab:whole:<fqn>`, which the lowering
all-gathers from every rank's rows (passes/lower/vocab.py).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch import fx

from zbcompile.errors import UsageError
from zbcompile.ir.names import VOCAB_WHOLE, Role, key_of, role_of
from zbcompile.ir.stages import (Constant, Graph, ModelOutputs, Partition, Stage, StagedModel, TensorSpec,
                                  VocabLayers)

__all__ = ["forward_stages", "forward_graph", "forward_loss", "forward_vocab", "output_graph", "output_stages",
           "OutputGraph", "TRAINING_ARGUMENT", "OUTPUT", "other_buffer_updates", "views_as_reshapes", "switched_off"]

OUTPUT = Role.OUTPUT.value   # out:<k>: the k-th tensor leaf of the model's outputs, from the loss stage

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

# op -> the position of its dropout probability: attention that drops (a module's `dropout_p=p if
# self.training else 0.0`, fixed at p by the trace) runs with 0 in eval mode; F graphs have it decomposed into
# native_dropout, the partitioned forward a forward returning the outputs runs (output_graph) has it whole
DROPOUT_PROBABILITY = {
    aten.scaled_dot_product_attention.default: 4,
}

# what draws random numbers: left in an eval-mode graph, it was a train-mode path the trace fixed
_RANDOM = ("bernoulli", "rand", "randn", "randint", "randperm", "normal", "uniform", "exponential", "multinomial",
           "poisson", "native_dropout", "rrelu_with_noise", "geometric", "cauchy", "log_normal")


def forward_stages(staged: StagedModel, training: bool, means: bool = False) -> StagedModel:
    """`staged` with every stage's F replaced by forward_graph(F, training, means), and its vocabulary layers (if
    any) by forward_vocab(vocab, training); see the module docstring."""
    stages = tuple(dataclasses.replace(st, f=forward_graph(st, training, means)) for st in staged.stages)
    vocab = None if staged.vocab is None else forward_vocab(staged.vocab, training)
    return dataclasses.replace(staged, stages=stages, vocab=vocab)


def forward_graph(stage: Stage, training: bool, means: bool = False) -> Graph:
    """Stage `stage`'s F graph returning only act:* and loss (and, with training, the updated buffers)."""
    f = stage.f
    keep = [i for i, n in enumerate(f.outputs)
            if role_of(n) in (Role.ACT, Role.LOSS) or (training and role_of(n) is Role.BUFFER)]
    return _forward_copy(f, keep, training, f"stage {stage.index}", means)


def forward_loss(step: Graph, training: bool, where: str = "the traced step", means: bool = False) -> Graph:
    """A whole traced step (Traced.graph) returning only its loss, in eval mode unless `training`
    (zbcompile/eval_check.py runs it against an eval-mode trace)."""
    return _forward_copy(step, [step.outputs.index("loss")], training, where, means)


def forward_vocab(vocab: VocabLayers, training: bool) -> VocabLayers:
    """The vocabulary passes of a forward-only step: S returns only the softmax statistics (nothing is saved
    for T's gradients), T only the loss, read off the gathered statistics and the targets (no grad:loss, no
    weight or input gradient, so no reduce of them); IF as it is. IB is never run (no backward)."""
    graphs = dict(vocab.graphs)
    for key, kept in (("s", lambda n: n == "vocab:stats"), ("t", lambda n: role_of(n) is Role.LOSS)):
        g = graphs[key]
        keep = [i for i, n in enumerate(g.outputs) if kept(n)]
        graphs[key] = _without_unread_inputs(_forward_copy(g, keep, training, f"vocabulary pass {key.upper()}"))
    return dataclasses.replace(vocab, graphs=graphs).check("forward-only vocabulary layers")


def _without_unread_inputs(g: Graph) -> Graph:
    """`g` without the inputs nothing reads any more (a trimmed graph must not ask for values a forward-only
    program never makes: grad:loss, the saved tensors of a backward)."""
    gm = g.gm
    inputs = list(g.inputs)
    for name, node in zip(g.inputs, list(gm.graph.find_nodes(op="placeholder"))):
        if not node.users:
            gm.graph.erase_node(node)
            inputs.remove(name)
    gm.recompile()
    return dataclasses.replace(g, inputs=tuple(inputs))


def views_as_reshapes(graph: fx.Graph) -> bool:
    """Make every `aten.view` of `graph` an `aten.reshape`, in place; whether there was one (recompile then).

    A traced layout is not always the one the graph meets when it runs: a received activation is contiguous
    where the trace saw a permuted view whose `.contiguous()` export dropped as redundant, and aot decomposes on
    fake tensors whose layouts are not always the real kernels' (BatchNorm over a transposed input keeps the
    input's strides on a fake tensor, not on the CPU). A view the trace allowed then fails ("view size is not
    compatible with input tensor's size and stride"); a reshape views wherever the real layout allows, so
    nothing changes where the trace was right, and copies where it was not."""
    views = graph.find_nodes(op="call_function", target=aten.view.default)
    for node in views:
        node.target = aten.reshape.default
    return bool(views)


def _forward_copy(f: Graph, keep: list[int], training: bool, where: str, means: bool = False) -> Graph:
    """A copy of `f` returning its outputs at `keep`, in eval mode unless `training` (with `means`, a Bernoulli
    draw eval mode cannot switch off replaced by its expectation: _to_eval_mode), with what computed only the
    others removed, and every view a reshape (which views where the layout allows)."""
    gm = fx.GraphModule(f.gm, copy.deepcopy(f.gm.graph))
    graph = gm.graph
    out = graph.output_node()
    if not training:
        _check_eval_buffer_updates(f, graph, where)
    out.args = (tuple(out.args[0][i] for i in keep),)
    if not training:
        _to_eval_mode(graph, where, means)
    views_as_reshapes(graph)   # as in the step's graphs (split_fbw)
    graph.eliminate_dead_code(is_impure_node=_impure)
    gm.recompile()
    outputs = tuple(f.outputs[i] for i in keep)
    return dataclasses.replace(f, gm=gm, outputs=outputs,
                               passthrough=tuple(n for n in f.passthrough if n in outputs)).check(
        f"forward-only {where}")


# ---- forward outputs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputGraph:
    """The loss stage's forward (as partitioned) returning the model's tensor outputs, `out:<k>` in leaf order,
    then its buffer updates; `outputs` says how they rebuild the model's output tree."""

    stage: int
    graph: Graph
    outputs: ModelOutputs
    whole: tuple[TensorSpec, ...] = ()   # vocabulary parameters the graph reads whole (VocabLayers.whole)


def output_graph(cut: Partition) -> OutputGraph | str:
    """The OutputGraph of `cut`, or why the model has none (kept in StagedModel.meta["outputs"] by the split,
    so that asking for the model's outputs costs no second trace)."""
    outputs = cut.traced.outputs
    if cut.vocab is not None and cut.vocab.last is None:
        return "its output layer is sharded over the ranks (vocab_parallel=True) and the split kept no whole copy"
    if outputs is None:
        return ("torch.export could not keep the model's call signature, so the trace does not know its outputs: "
                + (cut.traced.outputs_unknown or "an output export cannot describe"))
    if outputs.missing:
        return (f"the loss does not read every output of the model ({', '.join(outputs.missing)}), so the "
                "traced step never computes those")
    if cut.vocab is not None:   # the last stage as cut, before its output layer was sharded
        stage, g = len(cut.stages) - 1, cut.vocab.last
    else:
        stage = next(i for i, st in enumerate(cut.stages) if "loss" in st.outputs)
        g = cut.stages[stage]
    gm = fx.GraphModule(g.gm, copy.deepcopy(g.gm.graph))
    graph = gm.graph
    by_value = dict(zip(g.inputs, graph.find_nodes(op="placeholder")))
    nodes = {n.name: n for n in graph.nodes if n.op != "placeholder"}
    found = []
    for k, leaf in enumerate(outputs.leaves):
        if isinstance(leaf, Constant):
            continue
        node = nodes.get(leaf, by_value.get(leaf, by_value.get("act:" + leaf)))
        if node is None and role_of(leaf) in (Role.PARAM, Role.BUFFER):   # returned as it is (a logit scale)
            held = [i for i, st in enumerate(cut.stages) if leaf in st.inputs]
            return (f"the model output {_leaf_path(outputs, k)} is the model's {key_of(leaf)} itself, which "
                    f"stage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))} read"
                    f"{'' if len(held) > 1 else 's'} but the loss stage (stage {stage}) does not (its rank does not "
                    "hold it); sending it on for pipe(x) is not built. Cut so "
                    "that the stage computing the loss reads it too (split_points: no cut between its use and "
                    "the loss), or read it from the model (pipe.get_parameter on the rank holding it)")
        if node is None:
            made = [i for i, st in enumerate(cut.stages) if leaf in {n.name for n in st.gm.graph.nodes}]
            return (f"the model output {_leaf_path(outputs, k)} (traced as {leaf!r}) is computed on stage "
                    f"{made[0] if made else '?'}, not on the loss stage (stage {stage}), which reads it only "
                    "through a value computed from it; sending it on for pipe(x) is not built. Cut so that the "
                    "stage computing the loss computes it too (split_points: no cut between the model's last "
                    "layer and the loss)")
        found.append(node)
    out = graph.output_node()
    buffers = [(n, v) for n, v in zip(g.outputs, out.args[0]) if role_of(n) is Role.BUFFER]
    out.args = (tuple(found) + tuple(v for _, v in buffers),)
    names = tuple(f"{OUTPUT}{k}" for k in range(len(found))) + tuple(n for n, _ in buffers)
    graph.eliminate_dead_code(is_impure_node=_impure)
    inputs = list(g.inputs)
    for name, node in list(by_value.items()):   # the targets the loss read, and anything else now unread
        if role_of(name) is Role.DATA and not node.users:
            graph.erase_node(node)
            inputs.remove(name)
    whole = () if cut.vocab is None else _read_whole(graph, inputs, cut.vocab)
    gm.recompile()
    return OutputGraph(stage, Graph(gm, tuple(inputs), names, index=g.index, modules=g.modules), outputs, whole)


def _leaf_path(outputs: ModelOutputs, k: int) -> str:
    """Leaf k of the model's output tree as the user indexes it (`output[0]`, `output['aux']`)."""
    from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

    try:
        paths = tree_flatten_with_path(tree_unflatten(list(range(len(outputs.leaves))), outputs.spec))[0]
        return "output" + keystr(paths[k][0])
    except Exception:   # (a tree torch's pytree cannot name keys of)
        return f"leaf {k}"


def _read_whole(graph: fx.Graph, inputs: list[str], vocab: VocabLayers) -> tuple[TensorSpec, ...]:
    """Make `graph` read each vocabulary parameter whole from the all-gather of every rank's rows
    (`vocab:whole:<fqn>`, [shards, rows, ...]) instead of the parameter, which on a rank holds only its rows:
    the placeholder is renamed in `inputs`, and a view and a slice drop the last shard's padding rows.
    Returns the specs of what is gathered (one rank's rows each)."""
    specs = []
    for i, (name, node) in enumerate(zip(list(inputs), list(graph.find_nodes(op="placeholder")))):
        if role_of(name) is not Role.PARAM or key_of(name) not in vocab.params or not node.users:
            continue
        full = node.meta["val"]
        rest = tuple(full.shape[1:])
        with graph.inserting_after(node):
            rows = graph.call_function(aten.view.default, (node, [vocab.shards * vocab.rows, *rest]))
        with graph.inserting_after(rows):
            kept = graph.call_function(aten.slice.Tensor, (rows, 0, 0, vocab.size))
        node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not rows)
        gathered = full.new_empty((vocab.shards, vocab.rows, *rest))   # in the trace's fake mode, on its device
        node.meta["val"], rows.meta["val"] = gathered, gathered.view(-1, *rest)
        kept.meta["val"] = rows.meta["val"][:vocab.size]
        inputs[i] = VOCAB_WHOLE + key_of(name)
        specs.append(TensorSpec(inputs[i], (vocab.rows, *rest), full.dtype, requires_grad=False))
    return tuple(specs)


def output_stages(staged: StagedModel, training: bool, means: bool = False) -> StagedModel:
    """forward_stages(staged, training), except that the loss stage returns the model's outputs (out:<k>) and
    no loss; UsageError naming why where the model has no OutputGraph."""
    og = staged.meta.get("outputs")
    if not isinstance(og, OutputGraph):
        why = og or "it was split without them"
        raise UsageError(f"this model's outputs cannot be returned by the pipeline: {why}; use evaluate(*batch) "
                         "for the loss, or run the plain model")
    fwd = forward_stages(staged, training, means)
    if og.whole:
        fwd = dataclasses.replace(fwd, vocab=dataclasses.replace(fwd.vocab, whole=og.whole))
    g = og.graph
    keep = [i for i, n in enumerate(g.outputs) if role_of(n) is not Role.BUFFER or training]
    f = _forward_copy(g, keep, training, f"stage {og.stage}", means)
    data = tuple(int(key_of(n)) for n in f.inputs if role_of(n) is Role.DATA)
    stages = list(fwd.stages)
    stages[og.stage] = dataclasses.replace(stages[og.stage], f=f, data=data, has_loss=False)
    return dataclasses.replace(fwd, stages=tuple(stages))


def _to_eval_mode(graph: fx.Graph, where: str, means: bool = False) -> None:
    """Every op's `training` argument set False; UsageError for a random op that still draws. With `means`, a
    Bernoulli draw (a stochastic depth's or a hand-written dropout's mask, `if self.training` around it) becomes
    its expectation: the keep probability, which the inverted mask's division makes 1, as eval mode's skipped
    branch is. Only where zbcompile/eval_check.py found the eval-mode trace's loss equal to the result."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        pos = DROPOUT_PROBABILITY.get(node.target)
        if pos is not None:
            if len(node.args) > pos:
                node.args = (*node.args[:pos], 0.0, *node.args[pos + 1:])
            elif "dropout_p" in node.kwargs:
                node.kwargs = {**node.kwargs, "dropout_p": 0.0}
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
    if means:
        _bernoulli_means(graph)
    for node in graph.nodes:
        if (node.op == "call_function" and node.target not in TRAINING_ARGUMENT
                and node.target not in DROPOUT_PROBABILITY and _draws(node.target)):
            module = _module_of(node)
            raise UsageError(
                f"{where}: the traced forward draws random numbers in {module} ({node.target}), which "
                "evaluation cannot switch off: dropout and BatchNorm are switched by their ops, but this path was "
                "fixed when the step was traced in train mode (a hand-written dropout, or an `if self.training:` "
                "branch). Use nn.Dropout / F.dropout(training=self.training) there, or evaluate the plain model")


def _bernoulli_means(graph: fx.Graph) -> None:
    """Each Bernoulli draw replaced by its expectation: bernoulli(x, p) by p in x's shape, bernoulli(probs) by
    the probabilities themselves."""
    for node in list(graph.find_nodes(op="call_function", target=aten.bernoulli.p)):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        with graph.inserting_before(node):
            mean = graph.call_function(aten.full_like.default, (node.args[0], p))
        mean.meta = dict(node.meta)
        node.replace_all_uses_with(mean)
        graph.erase_node(node)
    for node in list(graph.find_nodes(op="call_function", target=aten.bernoulli.default)):
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


# what a normalization's running statistic passes through between its op and the buffer's new value
# (InstanceNorm: the batch norm of the repeated statistics, viewed per instance and averaged; a bfloat16 /
# float16 batch norm: the float32 statistic cast back to the buffer's dtype)
_STATISTIC_PATH = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.mean.dim,
                             aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default})
_BATCH_NORM = frozenset(op for op in TRAINING_ARGUMENT if "batch_norm" in str(op))


def _check_eval_buffer_updates(f: Graph, graph: fx.Graph, where: str) -> None:
    """UsageError for an eval-mode forward whose graph updates a buffer other than the normalization
    statistics the eval switch handles. The step was traced in train mode: whether eval mode makes such an
    update (unconditional) or skips it (`if self.training:`) is not in the graph, and the graph computes with
    the updated value either way; dropping the update would silently match neither."""
    inputs = dict(zip(graph.find_nodes(op="placeholder"), f.inputs))
    for name, node in zip(f.outputs, graph.output_node().args[0]):
        if role_of(name) is not Role.BUFFER or inputs.get(node) == name or _switched_statistic(name, node, inputs):
            continue
        buffer = key_of(name)
        raise UsageError(
            f"{where}: the traced forward updates buffer {buffer!r} in {_module_of(node)}, which evaluation in "
            "eval mode cannot reproduce: the step was traced in train mode, so its graph cannot tell whether eval "
            "mode skips that update (an `if self.training:` branch) or makes it, and it computes with the updated "
            "value either way. Only BatchNorm / InstanceNorm running statistics are switched by their ops. "
            "Evaluate in train mode instead (pipe.train(), then evaluate() / pipe(x): "
            "the updates run as traced and are kept, as eager's train-mode forward under torch.no_grad() does), "
            f"or make the update of {buffer!r} depend on something other than the module's mode (e.g. make it "
            "in the training loop, outside forward), or evaluate the plain model")


def other_buffer_updates(f: Graph) -> list[str]:
    """The buffers stage forward graph `f` updates other than normalization running statistics (an EMA, a
    counter: what the forward may read back, unlike BatchNorm's statistics in training)."""
    graph = f.gm.graph
    inputs = dict(zip(graph.find_nodes(op="placeholder"), f.inputs))
    return [key_of(name) for name, node in zip(f.outputs, graph.output_node().args[0])
            if role_of(name) is Role.BUFFER and inputs.get(node) != name
            and not _switched_statistic(name, node, inputs)]


def _switched_statistic(name: str, node: fx.Node, inputs: dict[fx.Node, str]) -> bool:
    """Whether buffer `name`'s new value `node` is a normalization's running statistic that eval mode leaves
    as it is: the running mean / var out of a batch norm op whose `training` argument the switch sets False
    (InstanceNorm's averaged per instance), or BatchNorm's `num_batches_tracked + 1` (per call)."""
    if key_of(name).rsplit(".", 1)[-1] == "num_batches_tracked":
        while node.op == "call_function" and node.target is aten.add.Tensor and isinstance(node.args[1], int):
            node = node.args[0]
        return inputs.get(node) == name
    while node.op == "call_function" and node.target in _STATISTIC_PATH:
        node = node.args[0]
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] in (3, 4)
            and getattr(node.args[0], "target", None) in _BATCH_NORM)


def _impure(node: fx.Node) -> bool:
    """fx's rule, except that a random op whose result nobody reads is dead (a dropout mask kept for B), and so
    is a metadata check export put beside a cast (`y.float()` in the loss): kept, it would keep the targets it
    checks an input of a forward that is not given them (pipe(x))."""
    return node.is_impure(impure_random=False) and node.target is not aten._assert_tensor_metadata.default


def switched_off(node: fx.Node) -> bool:
    """Whether random op `node` draws nothing: switched off by its `training` argument or its dropout probability
    (dropout and attention in an eval-mode graph, _to_eval_mode), as in eager's eval-mode forward."""
    pos = TRAINING_ARGUMENT.get(node.target)
    if pos is not None:
        return (node.args[pos] if len(node.args) > pos else node.kwargs.get("training", node.kwargs.get("train"))) \
            is False
    pos = DROPOUT_PROBABILITY.get(node.target)
    if pos is not None:
        return (node.args[pos] if len(node.args) > pos else node.kwargs.get("dropout_p", 0.0)) == 0
    return False


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
