"""Merge two fixed chains of passes per rank by running them forward in time (used by `vocab`)."""

from __future__ import annotations

import heapq
from typing import Sequence

from zbcompile.ir.schedule_problem import ScheduleProblem

__all__ = ["interleave"]


def interleave(problem: ScheduleProblem, base: Sequence[Sequence[int]], extra: Sequence[Sequence[int]],
               wait: float = 0.0) -> list[list[int]] | None:
    """Per rank, one order holding its `base` codes and its `extra` codes, each chain in its own order,
    found by list scheduling in time: whenever a rank is free it runs the head of `extra` if that is ready,
    else the head of `base` if that is ready, unless the `extra` head is ready within `wait` times the base
    head's cost (then it idles for it). None when the chains deadlock.

    The result is an order the simulator runs exactly as found: every decision is taken at the time the rank
    is free, when every pass that ends by then has been placed (ranks are visited in time order).
    """
    deps, cost, rank_of, comm = problem.deps, problem.cost, problem.rank_of, problem.comm
    end: list[float | None] = [None] * len(cost)
    p = len(base)
    at_base, at_extra = [0] * p, [0] * p
    free = [0.0] * p
    orders: list[list[int]] = [[] for _ in range(p)]
    waiting: dict[int, list[int]] = {}
    heap = [(0.0, r) for r in range(p)]
    left = sum(map(len, base)) + sum(map(len, extra))

    def ready(code: int, r: int) -> tuple[float | None, int]:
        """When `code` could start on rank r by its inputs, or (None, the input not placed yet)."""
        t = 0.0
        for d in deps[code]:
            e = end[d]
            if e is None:
                return None, d
            if rank_of[d] != r:
                e += comm
            if e > t:
                t = e
        return t, -1

    while heap:
        now, r = heapq.heappop(heap)
        if now < free[r]:  # a stale entry: the rank has run something since, and holds an entry at free[r]
            continue
        hx = extra[r][at_extra[r]] if at_extra[r] < len(extra[r]) else None
        hb = base[r][at_base[r]] if at_base[r] < len(base[r]) else None
        rx, wx = ready(hx, r) if hx is not None else (None, -1)
        rb, wb = ready(hb, r) if hb is not None else (None, -1)
        if rx is not None and rx <= now:
            code, at = hx, rx
            at_extra[r] += 1
        elif rb is not None and rb <= now and not (rx is not None and rx < now + wait * cost[hb]):
            code, at = hb, rb
            at_base[r] += 1
        else:  # nothing to run now: look again when a head's input is placed or its known time comes
            later = [x for x in (rx, rb) if x is not None and x > now]
            if later:
                heapq.heappush(heap, (min(later), r))
            for w in (wx, wb):
                if w >= 0:
                    waiting.setdefault(w, []).append(r)
            continue
        start = max(free[r], at)
        end[code] = free[r] = start + cost[code]
        orders[r].append(code)
        left -= 1
        heapq.heappush(heap, (free[r], r))
        for q in waiting.pop(code, ()):
            heapq.heappush(heap, (now, q))
    return orders if left == 0 else None
