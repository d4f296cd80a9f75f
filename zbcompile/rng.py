"""The CPU random stream of a pipeline rank: its stages' random ops draw from a stream of their own, so the global
generator every rank's training loop reads stays the same on every rank.

Eager training draws dropout masks and a shuffling DataLoader's order from one global generator. In a pipeline
each rank runs only its own stages' dropout, so each draws a different amount: with the same seed everywhere, the
ranks' generators drift apart after the first step, and from the next epoch on a DataLoader(shuffle=True) hands
each rank another batch (rank 0 feeds one batch's inputs, the last rank scores another's targets) without an
error. So every step, evaluation and forward that runs random ops on the CPU draws ONE number from the global
generator (the same draw on every rank, whatever its stages), seeds the CPU generator with it and the rank for the
step's own ops, and puts the global generator back where that one draw left it.

Only the CPU generator is forked: on a GPU the stages draw from the device's generator and a DataLoader's order
from the CPU one, which then never drifts. A pipeline over stand-in groups (the tests' threads, which share one
generator) is left alone.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["has_random_ops", "own_stream"]

_MIX = 0x9E3779B97F4A7C15   # odd, 64-bit: ranks' seeds far apart


def has_random_ops(graphs, switched_off=lambda node: False) -> bool:
    """Whether any of the fx GraphModules `graphs` calls a random op (an op tagged nondeterministic_seeded) that
    `switched_off(node)` does not say draws nothing (dropout in an eval-mode graph: forward_only.switched_off)."""
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) \
                    and not switched_off(node):
                return True
    return False


@contextlib.contextmanager
def own_stream(rank: int, active: bool):
    """Inside: the CPU generator seeded for this rank from one draw of the global generator; after: the global
    generator as that draw left it (see the module docstring). Nothing is drawn unless `active`."""
    if not active:
        yield
        return
    seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
    after = torch.get_rng_state()
    torch.default_generator.manual_seed((seed ^ (rank * _MIX)) & (2 ** 63 - 1))
    try:
        yield
    finally:
        torch.set_rng_state(after)

