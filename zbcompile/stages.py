"""The stage IR: each pipeline stage as four fx graphs (F, B, W and the fused BW) with named inputs and outputs.

This is the contract between the split passes (trace -> partition -> split_fbw) and the lowering. Every
graph takes and returns flat tuples of tensors; `Graph.inputs` / `Graph.outputs` name each position, so the
lowering wires values between graphs, ranks and microbatches by name and never by position guesswork.

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
from typing import Mapping

import torch
from torch import fx

__all__ = ["TensorSpec", "Graph", "Stage", "StagedModel"]


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
    """An fx GraphModule whose flat inputs and outputs carry the value names above."""

    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __call__(self, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run on the values named in `env`; returns {output name: tensor}."""
        results = self.gm(*(env[name] for name in self.inputs))
        return dict(zip(self.outputs, results, strict=True))

    def input_nodes(self) -> dict[str, fx.Node]:
        """{input name: its placeholder node}; the node's meta["val"] holds the traced shape and dtype."""
        return dict(zip(self.inputs, self.gm.graph.find_nodes(op="placeholder"), strict=True))

    @property
    def code(self) -> str:
        return self.gm.code


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its graphs and what it reads from the model, the data and its neighbours."""

    index: int
    f: Graph
    b: Graph
    w: Graph
    bw: Graph
    params: tuple[str, ...]          # canonical FQNs of the parameters this stage uses
    buffers: tuple[str, ...]         # FQNs of the buffers this stage reads (and maybe updates)
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

    def report(self) -> str:
        """Per-stage table: modules, params, estimated F/B/W FLOPs, saved bytes, boundary tensors, tied groups."""
        from zbcompile.split import report  # the report needs the cost model; the IR itself does not

        return report(self)
