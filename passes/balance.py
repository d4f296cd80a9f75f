"""Contiguous load balancing: cut a sequence of weighted units into groups with the smallest maximum weight.

The partitioner calls this with per-unit costs (e.g. graph_cost(...).flops of each block) to choose stage
boundaries. The answer is exact, not greedy:

    weights  3 1 4 1 5 9 2 6      parts = 3
    groups  [3 1 4 1][5 9][2 6]   -> cuts (4, 6), group weights (9, 14, 8)

Algorithm: best[k][i] = the smallest max-weight of the first i units cut into k non-empty groups,
best[k][i] = min over j of max(best[k-1][j], sum(weights[j:i])). With non-negative weights the first term
grows with j and the second shrinks, so the best j sits where they cross, and that crossing only moves right
as i grows: one sweeping pointer per layer gives O(n * parts) time.

`balance_placed` does the same when several groups run on one device (a pipeline rank holding stages 0 and 3
of a V): it minimizes the heaviest device load, then the heaviest group.

    weights  1 1 1 1 1 1 1 6      placement (0, 1, 1, 0)   (a V over two ranks)
    balance         [1 1][1 1][1 1 1][6]  -> groups (2, 2, 3, 6), devices (8, 5)
    balance_placed  [1][1][1 1 1 1 1][6]  -> groups (1, 1, 5, 6), devices (7, 6)

No DP fits this objective (a device couples distant groups), so it searches: every cutting when there are at
most `exact_limit` of them, else a hill climb (move one cut at a time while the objective drops) from the
per-part optimum.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from zbcompile.errors import PartitionError

__all__ = ["balance", "balance_placed", "group_weights", "placement_loads", "device_loads"]


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


def placement_loads(weights: Sequence[float], cuts: Sequence[int], placement: Sequence[int]) -> dict[int, float]:
    """Summed weight per device: group g (as cut by `cuts`) adds its weight to device `placement[g]`."""
    return device_loads(group_weights(weights, cuts), placement)


def device_loads(groups: Sequence[float], placement: Sequence[int]) -> dict[int, float]:
    """Summed weight per device of groups already weighed: group g adds groups[g] to device `placement[g]`."""
    loads: dict[int, float] = {}
    for device, w in zip(placement, groups, strict=True):
        loads[device] = loads.get(device, 0.0) + w
    return loads


def balance_placed(weights: Sequence[float], placement: Sequence[int], *, exact_limit: int = 50_000
                   ) -> tuple[int, ...]:
    """Cut `weights` into len(placement) contiguous groups minimizing (heaviest device, heaviest group).

    Group g runs on device `placement[g]` (any hashable id, e.g. the pipeline rank of stage g); a device's load
    is the sum of its groups' weights. Returns cuts as `balance` does. Exact (every cutting; the first best in
    lexicographic order of cuts) when there are at most `exact_limit` cuttings, else a local optimum reached by
    single-cut moves from `balance`'s optimum, which it never makes worse. With one group per device this is
    `balance`. Raises PartitionError as `balance` does.
    """
    parts = len(placement)
    _check(weights, parts)
    if len(set(placement)) == parts:
        return balance(weights, parts)
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    slot = {d: i for i, d in enumerate(dict.fromkeys(placement))}
    device = [slot[d] for d in placement]

    def score(cuts: Sequence[int]) -> tuple[float, float]:
        loads = [0.0] * len(slot)
        heaviest = 0.0
        bounds = (0, *cuts, len(weights))
        for g in range(parts):
            w = prefix[bounds[g + 1]] - prefix[bounds[g]]
            loads[device[g]] += w
            heaviest = max(heaviest, w)
        return max(loads), heaviest

    if math.comb(len(weights) - 1, parts - 1) <= exact_limit:
        return min(itertools.combinations(range(1, len(weights)), parts - 1), key=score)
    return _climb(list(balance(weights, parts)), len(weights), score)


def _climb(cuts: list[int], n: int, score) -> tuple[int, ...]:
    """Local search: move one cut anywhere between its neighbours, or two cuts one unit each, while that
    lowers `score` (two-cut moves shift load between devices whose groups are not adjacent)."""
    best = score(cuts)
    improved = True
    while improved:
        improved = False
        for k in range(len(cuts)):
            lo = cuts[k - 1] + 1 if k else 1
            hi = cuts[k + 1] - 1 if k + 1 < len(cuts) else n - 1
            keep = cuts[k]
            for position in range(lo, hi + 1):
                cuts[k] = position
                value = score(cuts)
                if value < best:
                    best, keep, improved = value, position, True
            cuts[k] = keep
        if improved:
            continue
        for k, j in itertools.combinations(range(len(cuts)), 2):
            for dk, dj in itertools.product((-1, 1), repeat=2):
                moved = list(cuts)
                moved[k] += dk
                moved[j] += dj
                if _valid(moved, n) and (value := score(moved)) < best:
                    best, cuts, improved = value, moved, True
    return tuple(cuts)


def _valid(cuts: Sequence[int], n: int) -> bool:
    return all(a < b for a, b in itertools.pairwise((0, *cuts, n)))
