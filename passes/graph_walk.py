"""The one upward walk over an fx graph the passes share: what a node is computed from.

    ancestors(roots)                                  every node the roots read, directly or not (roots included)
    ancestors(roots, through=is_computed)             ... walking only through call_function nodes
    ancestors(roots, through=..., stop=b_nodes)       ... and not into the nodes of `stop`

Splitting B from W, slicing a graph for data-parallel pieces, taking the data-only part of a vocabulary stage and
finding a stage's live nodes all ask this question; each once wrote its own loop.
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import fx

__all__ = ["ancestors", "is_computed", "not_placeholder"]


def ancestors(roots: Iterable, *, through: Callable[[fx.Node], bool] = lambda n: True,
              stop: set[fx.Node] | frozenset = frozenset()) -> set[fx.Node]:
    """The nodes `roots` are computed from, roots included: a node is kept (and its inputs visited) when
    `through(node)` holds and it is not in `stop`. Roots that are not nodes (a constant output) are skipped."""
    seen: set[fx.Node] = set()
    stack = [n for n in roots if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or n in stop or not through(n):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def is_computed(node: fx.Node) -> bool:
    """An op of the graph (not an input, an attribute or the output)."""
    return node.op == "call_function"


def not_placeholder(node: fx.Node) -> bool:
    return node.op != "placeholder"
