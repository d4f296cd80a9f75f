"""What the order searches share (zb-auto's improvement and zbv's polish): the score comparison and the
candidate moves of a local search over per-rank orders."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

__all__ = ["EPS", "better", "local_moves"]

EPS = 1e-9  # times closer than this are equal: float noise never counts as an improvement


def better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic `a < b` on (makespan, bubble rate) with the EPS tolerance."""
    if a[0] < b[0] - EPS:
        return True
    return abs(a[0] - b[0]) <= EPS and a[1] < b[1] - EPS


def local_moves(orders: Sequence[Sequence[int]], hole: Callable[[int, int], float],
                kind: Callable[[int], Hashable], is_w: Callable[[int], bool]) -> list[tuple[int, int, int]]:
    """Candidate moves (rank, from, to) of a local search over per-rank orders, most promising first.

    Into every idle gap, largest first: the next pass of each kind from later slots of that rank (any of
    them may fill the hole). Then every W one slot later (a W may be in the way of a critical B or F). Then
    every pass one slot earlier. `hole(r, i)` is the idle time before slot i of rank r; `kind(x)` and
    `is_w(x)` classify an order entry.
    """
    gaps, moves = [], []
    for r, row in enumerate(orders):
        for i in range(1, len(row)):
            idle = hole(r, i)
            if idle > EPS:
                gaps.append((-idle, r, i))
    gaps.sort()
    for _, r, i in gaps:
        row, found = orders[r], set()
        for j in range(i + 1, len(row)):
            k = kind(row[j])
            if k not in found:
                found.add(k)
                moves.append((r, j, i))
                if len(found) == 3:
                    break
    for r, row in enumerate(orders):
        for i in range(1, len(row)):
            if is_w(row[i - 1]):
                moves.append((r, i - 1, i))
    for r, row in enumerate(orders):
        for i in range(1, len(row)):
            moves.append((r, i, i - 1))
    return moves
