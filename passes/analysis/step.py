"""Facts about the traced step that choosing cuts and cutting both read.

    constant_nodes(traced)   {node: True when it depends on no data and no parameter and draws no random
                             numbers}: such nodes (arange, causal masks, lifted constants; buffers count as
                             constant inputs) are recomputed by every stage that uses them, never cut or sent
    first_positions(traced)  {module path: graph position of its first non-constant node}: where a cut before
                             that module goes
"""

from __future__ import annotations

import torch
from torch import fx

from zbcompile._torch_private import OpOverload
from zbcompile.ir.names import Role, role_of
from zbcompile.ir.stages import Traced, module_path

__all__ = ["constant_nodes", "first_positions"]


def constant_nodes(traced: Traced) -> dict[fx.Node, bool]:
    """True for nodes whose value depends on no data, no parameter and no buffer the step updates, and that draw
    no random numbers. (A buffer the step updates is state: `self.t += 1` before a cut and `* self.t` after it
    must read the value the update made for this microbatch, so it crosses the cut; recomputed by the later
    stage from its own copy of the buffer it would read the wrong one.)"""
    updated = {name for name in traced.graph.outputs if role_of(name) is Role.BUFFER}
    buffers = {node for name, node in traced.graph.input_nodes().items()
               if role_of(name) is Role.BUFFER and name not in updated}
    const: dict[fx.Node, bool] = {}
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            const[node] = node in buffers
        elif node.op == "get_attr":
            const[node] = True
        elif node.op == "call_function":
            random = isinstance(node.target, OpOverload) and (
                torch.Tag.nondeterministic_seeded in node.target.tags
            )
            const[node] = not random and all(const[i] for i in node.all_input_nodes)
        else:
            const[node] = False
    return const


def first_positions(traced: Traced) -> dict[str, int]:
    """Graph position of each module's first non-constant node (constants are replicated, not cut)."""
    const = constant_nodes(traced)
    first: dict[str, int] = {}
    for i, node in enumerate(traced.gm.graph.nodes):
        if node.op != "call_function" or const[node]:
            continue
        for path in module_path(node):
            first.setdefault(path, i)
    return first
