"""The split side's IRs: one named-graph record (`Graph`) from the trace to the stage IR.

    model, loss_fn, example --trace--> Traced --partition--> Partition --split_fbw--> StagedModel
                                       (one Graph: the step) (a Graph per stage)      (Stage: F, B, W, BW Graphs)

The stage IR, each pipeline stage as four fx graphs (F, B, W and the fused BW) with named inputs and outputs,
is the contract between the split passes and the lowering. Every graph takes and returns flat tuples of
tensors; `Graph.inputs` / `Graph.outputs` name each position, so the passes and the lowering wire values
between graphs, ranks and microbatches by name and never by position guesswork. Every record here checks
itself (`.check()`): the split passes run that check on each result (zbcompile.split).

Value names (the same name means the same value within one (stage, microbatch)):

    param:<fqn>        a parameter, by its canonical fully qualified name in the user's model
    buffer:<fqn>       a buffer's value going into F; as an F *output*, the buffer's new value after the
                       microbatch (the runtime copies it into the real buffer: BatchNorm statistics)
    data:<i>           microbatch slice of the i-th flat user argument (model inputs first, then loss targets)
    act:<name>         a boundary activation: F output of stage s, F input of stage s+1
    loss               the last stage's scalar loss for the microbatch (an F output)
    saved:<k>          a tensor F saves for the backward
    wsaved:<k>         an intermediate B computes that W needs (e.g. a grad of a Linear's output)
    grad:act:<name>    gradient of a boundary activation (B/BW input on the sender, B/BW output on the receiver)
    grad:loss          the seed gradient of `loss` (the runtime feeds 1 / num_microbatches)
    grad:param:<fqn>   a parameter gradient for this microbatch (W and BW outputs); summed over microbatches

    A value made in stage i and read in stage j > i+1 is a pass-through in between: such a stage has act:<x>
    as both F input and F output (re-sent unchanged), and grad:act:<x> as both B/BW input (from stage s+1) and
    B/BW output (to stage s-1, plus whatever the stage's own use of x contributes). Key envs by stage.

    F:  param, buffer, data, act            ->  act (send), loss (last stage), buffer (updated), saved
    B:  saved, grad:act (send) | grad:loss  ->  grad:act (recv, those that require grad), wsaved
    W:  saved, wsaved, grad:act | grad:loss ->  grad:param
    BW: saved, grad:act | grad:loss         ->  grad:act (recv), grad:param
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import fx

from zbcompile.errors import SplitError, UsageError
from zbcompile.ir.names import VOCAB_EMB, VOCAB_X, Role, is_vocab_boundary, role_of

__all__ = ["TensorSpec", "Graph", "Traced", "ModelOutputs", "Constant", "Partition", "Stage", "StagedModel",
           "VocabLayers", "module_path", "module_stack"]


def module_path(node: fx.Node) -> tuple[str, ...]:
    """The module paths in the user's model that computed `node` (a node of any graph here), outermost first
    ('' = the model itself); read from the `nn_module_stack` the trace recorded and every pass copies along."""
    return tuple(path for path, _ in module_stack(node))


def module_stack(node: fx.Node) -> tuple[tuple[str, str], ...]:
    """(module path, qualified class name) of each module of the user's model that computed `node`, outermost
    first: `module_path` with the class of each module, as torch.export recorded it."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = []
    for path, kind in stack.values():
        kind = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
        if path == "model":   # the trace exports the user's model as the `model` child of a wrapper
            entries.append(("", kind))
        elif path.startswith("model."):
            entries.append((path[len("model.") :], kind))
    return tuple(entries)


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor crossing a boundary (per microbatch)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Graph:
    """An fx GraphModule whose flat inputs and outputs carry the value names above: the record of every level.

    The extras are set where a level has them (graph_pp's GraphMeta idea) and keep their defaults elsewhere:
        index        the stage the graph belongs to (a stage forward of the partition); None for the whole step
        passthrough  act:* names the stage receives and re-sends unchanged (a stage forward)
        modules      outermost module paths wholly placed in the stage, for reports and errors (a stage forward)
    Invariants (`check`): the graph lints; one distinct name per placeholder and per output, in order.
    """

    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    index: int | None = None
    passthrough: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()

    def __call__(self, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run on the values named in `env`; returns {output name: tensor}."""
        results = self.gm(*(env[name] for name in self.inputs))
        return dict(zip(self.outputs, results, strict=True))

    def input_nodes(self) -> dict[str, fx.Node]:
        """{input name: its placeholder node}; the node's meta["val"] holds the traced shape and dtype."""
        return dict(zip(self.inputs, self.gm.graph.find_nodes(op="placeholder"), strict=True))

    def output_nodes(self) -> dict[str, fx.Node]:
        """{output name: the node returned there}."""
        return dict(zip(self.outputs, self.gm.graph.output_node().args[0], strict=True))

    @property
    def code(self) -> str:
        return self.gm.code

    def check(self, where: str = "") -> Graph:
        """Raise SplitError unless the graph lints and its names match its placeholders and outputs one to one."""
        try:
            self.gm.graph.lint()
        except Exception as exc:  # fx raises RuntimeError and AssertionError; ours says which graph
            raise SplitError(f"{where}: the graph does not lint: {exc}\n{self.code}") from exc
        placeholders = self.gm.graph.find_nodes(op="placeholder")
        returned = self.gm.graph.output_node().args[0]
        for kind, names, count in (("inputs", self.inputs, len(placeholders)),
                                   ("outputs", self.outputs, len(returned))):
            if len(names) != count:
                raise SplitError(f"{where}: {len(names)} {kind} named for {count} in the graph: {names}\n{self.code}")
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise SplitError(f"{where}: {kind} named twice: {twice}")
        if not set(self.passthrough) <= set(self.inputs) & set(self.outputs):
            raise SplitError(f"{where}: pass-throughs {self.passthrough} are not both inputs and outputs")
        return self


@dataclass(frozen=True)
class Constant:
    """A leaf of the model's outputs that is no tensor of the step (None, a number), or, with `missing`, one the
    step never computes (the loss does not read it) and why."""

    value: object
    missing: str | None = None


@dataclass(frozen=True)
class ModelOutputs:
    """The model's outputs within the traced step `loss_fn(model(*inputs), *targets)`: per leaf of the output
    tree, the value name it is (a node of the step, or a data:/param:/buffer: input) or a Constant; `spec` is the
    tree (torch.utils._pytree) they flatten from."""

    leaves: tuple[str | Constant, ...]
    spec: object

    @property
    def missing(self) -> list[str]:
        return [c.missing for c in self.leaves if isinstance(c, Constant) and c.missing]

    @property
    def numbers(self) -> list[tuple[int, object]]:
        """(leaf index, value) of each Python number among the leaves: fixed as the trace computed it, for one
        microbatch of the example (a shape or a count read in forward is the microbatch's)."""
        return [(k, c.value) for k, c in enumerate(self.leaves) if isinstance(c, Constant)
                and isinstance(c.value, (int, float)) and not isinstance(c.value, bool)]

    def rebuild(self, flat, microbatches: int, dims: Sequence[int | None] | None = None):
        """The model's output tree from a forward's flat result (microbatch by microbatch, each its tensor
        leaves in order): each leaf's microbatches concatenated on its dim of `dims` (batch_dims; default dim 0),
        a 0-dim leaf's stacked; a parameter or buffer the model returns itself as it is (the same tensor in every
        microbatch)."""
        from torch.utils._pytree import tree_unflatten

        k = len(flat) // microbatches
        dims = self.batch_dims(flat[:k], None) if dims is None else dims
        tensors = iter([parts[0] if d is None else torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts, d)
                        for d, parts in zip(dims, (flat[j::k] for j in range(k)))])
        leaves = [leaf.value if isinstance(leaf, Constant) else next(tensors) for leaf in self.leaves]
        return tree_unflatten(leaves, self.spec)

    def batch_dims(self, first, rows: int | None) -> list[int | None]:
        """Per tensor leaf (`first`: one microbatch's, in leaf order) the dim its microbatches are put together on,
        as model(x) returns the batch: None for a parameter or buffer the model returns itself; dim 0 where it is
        a multiple of the microbatch's `rows` (batch-major, or flattened from it: [rows * T, V]), and for a 0-dim
        leaf (stacked); else the one dim of `rows` elements (a time-major output, [T, rows, ...]). UsageError for
        a leaf with neither, which holds no row dim (made from parameters alone, or reduced over the batch): its
        microbatches' values make no batch's value. (Shapes alone cannot tell a time-major output whose length
        is a multiple of `rows` from a flattened one: it is taken as flattened.) rows None: dim 0 everywhere."""
        tensors = [leaf for leaf in self.leaves if not isinstance(leaf, Constant)]
        dims = []
        for k, (leaf, t) in enumerate(zip(tensors, first)):
            if role_of(leaf) in (Role.PARAM, Role.BUFFER):
                dims.append(None)
                continue
            held = [d for d, n in enumerate(t.shape) if n == rows]
            if not rows or t.dim() == 0 or t.shape[0] % rows == 0:
                dims.append(0)
            elif len(held) == 1:
                dims.append(held[0])
            else:
                raise UsageError(
                    f"pipe(x): the model's output tensor {k} has shape {list(t.shape)} for a microbatch of {rows} "
                    f"rows: its dim 0 is no multiple of the rows and {'several dims hold' if held else 'no dim holds'} "
                    "them, so it is not per row (made from parameters alone, or reduced over the batch) and the "
                    "microbatches' values do not make the batch's as model(x) returns it. Return per-row tensors "
                    "(the reduction in the loss), or call pipe.evaluate(*batch) for the loss")
        return dims


@dataclass(frozen=True)
class Traced:
    """The trace pass's result: one training step as a Graph, plus facts about the whole step.

    graph.inputs name every placeholder param:<fqn> (one per Parameter object, tied aliases merged onto the
    canonical name), buffer:<fqn> or data:<i>; graph.outputs are "loss", then buffer:<fqn> per updated buffer.
    """

    graph: Graph
    num_inputs: int
    num_targets: int
    tied: tuple[tuple[str, ...], ...]      # aliases of one Parameter, canonical name first
    frozen: frozenset[str]                 # canonical names of parameters with requires_grad=False
    # A model on the meta device is traced with meta data; graphs built from it create their tensors
    # (arange, masks) on the device of the user's example instead (cpu if that is meta too).
    device: torch.device | None = None
    outputs: ModelOutputs | None = None    # which values of the step are the model's outputs (before the loss)
    outputs_unknown: str = ""              # where outputs is None: why torch.export could not say
    output_tree: object = None             # the model's output tree as forward returned it (a pytree spec)

    @property
    def gm(self) -> fx.GraphModule:
        """The step's GraphModule (`graph.gm`)."""
        return self.graph.gm

    def check(self, where: str = "trace") -> Traced:
        self.graph.check(f"{where}, the traced step")
        if self.graph.outputs.count("loss") != 1:
            raise SplitError(f"{where}: the traced step returns {self.graph.outputs}, not one loss")
        stray = [n for n in self.graph.inputs if role_of(n) not in (Role.PARAM, Role.BUFFER, Role.DATA)]
        if stray:
            raise SplitError(f"{where}: the traced step has inputs that are no param/buffer/data: {stray}")
        return self


@dataclass(frozen=True)
class Partition:
    """The partition pass's result: one stage forward Graph per stage (with index, passthrough and modules).

    Stage s's inputs are param:*, buffer:*, data:*, then act:* (received); its outputs act:* (sent), then loss
    (last stage) and buffer:* (updated). Stage s+1 receives exactly what stage s sends, in the same order.
    """

    stages: tuple[Graph, ...]
    split_points: tuple[str, ...]
    traced: Traced                         # the step the stages were cut from (its whole-step facts)
    vocab: VocabLayers | None = None       # the sharded vocabulary layers (passes/shard_vocab.py), if any

    def check(self, where: str = "partition") -> Partition:
        for s, stage in enumerate(self.stages):
            stage.check(f"{where}, stage {s} forward")
            if stage.index != s:
                raise SplitError(f"{where}: stage {s} is numbered {stage.index}")
        _check_chain([_acts(st.outputs) for st in self.stages], [_acts(st.inputs) for st in self.stages], where)
        if self.vocab is None and "loss" not in self.stages[-1].outputs:
            raise SplitError(f"{where}: the last stage does not return the loss")
        if self.vocab is not None:
            self.vocab.check(where)
            _check_vocab_ends(self.stages[0].inputs, self.stages[-1].outputs, where)
        return self


def _acts(names: Sequence[str]) -> tuple[str, ...]:
    """The boundary activations between neighbouring stages (the vocabulary layers' own boundaries aside)."""
    return tuple(n for n in names if role_of(n) is Role.ACT and not is_vocab_boundary(n))


def _check_vocab_ends(first_inputs: Sequence[str], last_outputs: Sequence[str], where: str) -> None:
    if VOCAB_EMB not in first_inputs or VOCAB_X not in last_outputs or "loss" in last_outputs:
        raise SplitError(f"{where}: with vocabulary parallelism the first stage must read {VOCAB_EMB} and the "
                         f"last stage return {VOCAB_X} instead of the loss")


def _check_chain(sends: Sequence[Sequence[str]], recvs: Sequence[Sequence[str]], where: str) -> None:
    """Stage s+1 receives what stage s sends, in order; the first stage receives and the last sends nothing."""
    for s in range(len(sends)):
        before = tuple(sends[s - 1]) if s else ()
        if tuple(recvs[s]) != before:
            raise SplitError(f"{where}: stage {s} receives {tuple(recvs[s])} but stage {s - 1} sends {before}")
    if sends and tuple(sends[-1]):
        raise SplitError(f"{where}: the last stage sends {tuple(sends[-1])}")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its graphs and what it reads from the model, the data and its neighbours."""

    index: int
    f: Graph
    b: Graph
    w: Graph
    bw: Graph
    # canonical FQNs of the parameters this stage uses, then of those no stage uses that it holds (each such
    # parameter or buffer is listed by exactly one stage, so that one rank keeps it: split_fbw._hold_unused)
    params: tuple[str, ...]
    buffers: tuple[str, ...]         # FQNs of the buffers this stage reads or updates, then held ones
    recv: tuple[TensorSpec, ...]     # activations from stage index-1, named act:<name> in the graphs
    send: tuple[TensorSpec, ...]     # activations to stage index+1 (empty for the last stage)
    data: tuple[int, ...]            # which flat user arguments this stage reads (data:<i>)
    modules: tuple[str, ...] = ()    # module paths placed here, for reports and errors
    has_loss: bool = False


@dataclass(frozen=True)
class StagedModel:
    """The split pass's result: every stage, plus facts the lowering needs about the whole model."""

    stages: tuple[Stage, ...]
    num_inputs: int                  # flat user arguments 0..num_inputs-1 go to the model,
    num_targets: int                 # the next num_targets to the loss function
    tied: tuple[tuple[str, ...], ...] = ()   # aliases of one Parameter; the canonical name first
    meta: Mapping[str, object] = field(default_factory=dict)
    vocab: VocabLayers | None = None         # the sharded vocabulary layers, with vocabulary parallelism

    def check(self, where: str = "split") -> StagedModel:
        for s, st in enumerate(self.stages):
            if st.index != s:
                raise SplitError(f"{where}: stage {s} is numbered {st.index}")
            for kind in ("f", "b", "w", "bw"):
                getattr(st, kind).check(f"{where}, stage {s} {kind.upper()}")
            if st.has_loss != (self.vocab is None and s == len(self.stages) - 1):
                raise SplitError(f"{where}: stage {s} of {len(self.stages)} has_loss={st.has_loss}")
        _check_chain([_acts([t.name for t in st.send]) for st in self.stages],
                     [_acts([t.name for t in st.recv]) for st in self.stages], where)
        if self.vocab is not None:
            self.vocab.check(where)
            _check_vocab_ends(self.stages[0].f.inputs, self.stages[-1].f.outputs, where)
        return self


@dataclass(frozen=True)
class VocabLayers:
    """The input embedding and the output layer + cross-entropy, sharded by rows over `shards` ranks.

    Shard r holds rows [r * rows, (r + 1) * rows) of each vocabulary parameter (`params`: the embedding table,
    the output weight and its bias, one name if tied), zero rows past `size` on the last shard. One graph per
    pass serves every shard: it reads the shard's first row as `vocab:offset` (a 0-dim int64). The passes, per
    microbatch, and the collectives between them (all ranks, in the same order):

        if  param:E, vocab:offset, data:*            -> vocab:part      reduce-sum onto the first stage: act:vocab.emb
        s   param:W[, param:b], vocab:x, vocab:offset, data:*
                                                     -> vocab:stats, vocab:saved:*   (x: the last stage's
                                                        act:vocab.x, broadcast; stats all-gathered: vocab:gathered)
        t   vocab:gathered, vocab:saved:*, vocab:x, param:W[, param:b], vocab:offset, grad:loss, data:*
                                                     -> grad:param:W[, grad:param:b], vocab:dx, loss
                                                        (dx reduce-summed onto the last stage: grad:act:vocab.x)
        ib  vocab:demb, vocab:offset, data:*         -> grad:param:E     (demb: the first stage's
                                                        grad:act:vocab.emb, broadcast)
    """

    shards: int
    size: int                        # V, the vocabulary
    rows: int                        # rows per shard: ceil(V / shards)
    embedding: str                   # canonical fqn of the input table
    head: str                        # canonical fqn of the output weight (== embedding when tied)
    bias: str | None
    graphs: Mapping[str, Graph]      # "if", "s", "t", "ib"
    x: TensorSpec                    # act:vocab.x: the output layer's input, [tokens, d]
    emb: TensorSpec                  # act:vocab.emb: the embedding lookup's output
    stats: TensorSpec                # vocab:stats, per shard
    pattern: str = ""                # what was found, for reports: "wte.weight[ids] ... lm_head -> cross_entropy"
    # the last stage's forward as the partition cut it, the output layer and the loss in it: what a forward
    # returning the model's logits runs (passes/forward_only.py, output_graph); None where it was not kept
    last: Graph | None = None
    # the parameters such a forward reads whole: each rank's rows of them are all-gathered at the start of its
    # step into `vocab:whole:<fqn>` (the specs: the name and one rank's rows); () in every other program
    whole: tuple[TensorSpec, ...] = ()
    # the token ids the lookup reads and the targets the loss reads, each computed from the step's data inputs
    # (one microbatch's): what a call's batch is checked against [0, size) with (no shard looks an id outside it
    # up, no shard holds such a target's logit: eager would raise); None where the split did not keep them
    ids: Graph | None = None
    targets: Graph | None = None
    ignore_index: int = -100

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for p in (self.embedding, self.head, self.bias) if p))

    def check(self, where: str) -> VocabLayers:
        missing = {"if", "s", "t", "ib"} - set(self.graphs)
        if missing:
            raise SplitError(f"{where}: the vocabulary layers lack graphs {sorted(missing)}")
        for key, g in self.graphs.items():
            g.check(f"{where}, vocabulary pass {key.upper()}")
        if self.last is not None:
            self.last.check(f"{where}, the last stage with its output layer")
        if self.rows * self.shards < self.size:
            raise SplitError(f"{where}: {self.shards} shards of {self.rows} rows do not hold {self.size} rows")
        return self
