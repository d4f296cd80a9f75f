"""Contiguous load balancing: cut a sequence of weighted units into groups with the smallest maximum weight.

The partitioner calls this with per-unit costs (e.g. graph_cost(...).flops of each block) to choose stage
boundaries. The answer is exact, not greedy:

    weights  3 1 4 1 5 9 2 6      parts = 3
    groups  [3 1 4 1][5 9][2 6]   -> cuts (4, 6), group weights (9, 14, 8)

Algorithm: best[k][i] = the smallest max-weight of the first i units cut into k non-empty groups,
best[k][i] = min over j of max(best[k-1][j], sum(weights[j:i])). With non-negative weights the first term
grows with j and the second shrinks, so the best j sits where they cross, and that crossing only moves right
as i grows: one sweeping pointer per layer gives O(n * parts) time.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from zbcompile.errors import PartitionError

__all__ = ["balance", "group_weights"]


def _check(weights: Sequence[float], parts: int) -> None:
    n = len(weights)
    if parts < 1:
        raise PartitionError(f"balance: parts must be at least 1, got {parts}")
    if parts > n:
        raise PartitionError(
            f"balance: cannot cut {n} unit(s) into {parts} non-empty groups. "
            f"Ask for at most {n} stages, or cut the model into finer units (more split points)."
        )
    bad = [(i, w) for i, w in enumerate(weights) if not (w >= 0 and math.isfinite(w))]
    if bad:
        i, w = bad[0]
        raise PartitionError(f"balance: weights must be finite and non-negative; unit {i} weighs {w}")


def _layer(prev: list[float], prefix: list[float], k: int) -> tuple[list[float], list[int]]:
    """best[k][i] and its argmin j for i in k..n, from best[k-1] (entries below k stay inf / 0)."""
    n = len(prefix) - 1
    cur, arg = [math.inf] * (n + 1), [0] * (n + 1)
    j = k - 1  # largest j seen so far with prev[j] <= weight of units j..i-1 (or k-1 if none)
    for i in range(k, n + 1):
        while j + 1 <= i - 1 and prev[j + 1] <= prefix[i] - prefix[j + 1]:
            j += 1
        for c in (j, j + 1) if j + 1 <= i - 1 else (j,):
            value = max(prev[c], prefix[i] - prefix[c])
            if value < cur[i]:
                cur[i], arg[i] = value, c
    return cur, arg


def balance(weights: Sequence[float], parts: int) -> tuple[int, ...]:
    """Cut `weights` into `parts` contiguous non-empty groups minimizing the heaviest group's total weight.

    Returns the `parts - 1` cut indices, strictly increasing and strictly inside 0..len(weights): with
    bounds = (0, *cuts, len(weights)), group g is weights[bounds[g]:bounds[g + 1]]. Ties between optimal
    cuttings are broken deterministically. Weights must be finite and non-negative.
    Raises PartitionError when parts < 1, parts > len(weights) or a weight is negative or not finite.
    """
    _check(weights, parts)
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    best = [0.0] + [math.inf] * len(weights)  # zero groups hold zero units
    args = []
    for k in range(1, parts + 1):
        best, arg = _layer(best, prefix, k)
        args.append(arg)
    cuts, i = [], len(weights)
    for arg in reversed(args[1:]):
        i = arg[i]
        cuts.append(i)
    return tuple(reversed(cuts))


def group_weights(weights: Sequence[float], cuts: Sequence[int]) -> tuple[float, ...]:
    """The total weight of each group that `cuts` (as returned by balance) makes of `weights`."""
    bounds = (0, *cuts, len(weights))
    return tuple(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
