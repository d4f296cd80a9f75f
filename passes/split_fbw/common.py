"""What the pieces of the split share: the aten namespace, a graph's placeholders by position, and value names
as the identifiers of the placeholders that carry them."""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["_aten", "_placeholder", "_identifier"]

_aten = torch.ops.aten


def _placeholder(gm: fx.GraphModule, i: int) -> fx.Node:
    return list(gm.graph.find_nodes(op="placeholder"))[i]


def _identifier(value_name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in value_name)
