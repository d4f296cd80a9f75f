"""The Zero Bubble authors' greedy list scheduler for zb-auto (see the package docstring).

It places F, B and W passes rank by rank in microbatch rounds under a memory cap, timing each as it goes;
three switches steer its choices, and every combination is tried to seed the search.
"""

from __future__ import annotations

import itertools
from typing import Any

from zbcompile.ir.schedule import Kind
from zbcompile.ir.schedule_problem import ActionCodes

from .._search import EPS

__all__ = ["greedy_seeds"]

F, B, W = 0, 1, 2
_KINDS = (Kind.F, Kind.B, Kind.W)


class _Greedy:
    """One run of the greedy: places passes rank by rank in microbatch rounds, timing each as it goes.

    Switches (the 8 combinations are tried; `asked` records which ones a run read, so a combination that
    differs from a finished run only in switches that run never read is known to repeat it and is skipped):
      early_f   warm-up F's may start while they would end after the first B arrives (else they stop
                once the rank's clock reaches that arrival)
      b_first   a rank 2+ F's ahead of the next one skips its F when the F would delay the next rank's B
      fill_over before an F or B, one more W that overshoots its dependency's arrival is run when the
                idle gap is within this rank's share of the worst bubble so far
    """

    SWITCHES = ("early_f", "b_first", "fill_over")

    def __init__(self, p: int, m: int, cs: Any, limit: int, switches: dict[str, bool], codes: ActionCodes):
        self.p, self.m, self.cs, self.limit, self.codes = p, m, cs, limit, codes
        self.switches = switches
        self.asked: set[str] = set()
        self.cost = [cs.of(r) for r in range(p)]
        self.end_f = [[0.0] * m for _ in range(p)]
        self.end_b = [[0.0] * m for _ in range(p)]
        self.free = [0.0] * p
        self.done = [[0, 0, 0] for _ in range(p)]   # F, B, W placed per rank
        self.held = [0] * p
        self.idle = [0.0] * p                      # idle time after the rank's first F
        self.worst_idle = 0.0
        self.orders: list[list[int]] = [[] for _ in range(p)]

    def ask(self, switch: str) -> bool:
        self.asked.add(switch)
        return self.switches[switch]

    def put(self, r: int, kind: int) -> None:
        done = self.done[r]
        mb = done[kind]
        free = start = self.free[r]
        if kind == F:
            if r > 0:
                start = max(start, self.end_f[r - 1][mb] + self.cs.comm)
            end = self.end_f[r][mb] = start + self.cost[r][F]
            self.held[r] += 1
        elif kind == B:
            if r < self.p - 1:
                start = max(start, self.end_b[r + 1][mb] + self.cs.comm)
            end = self.end_b[r][mb] = start + self.cost[r][B]
        else:
            end = start + self.cost[r][W]
            self.held[r] -= 1
        if start > free and done[F]:
            idle = self.idle[r] = self.idle[r] + start - free
            if idle > self.worst_idle:
                self.worst_idle = idle
        self.free[r] = end
        done[kind] += 1
        self.orders[r].append(self.codes.code(_KINDS[kind], r, mb))

    def has_w(self, r: int) -> bool:
        return self.done[r][W] < self.done[r][B]

    def fill_before(self, r: int, arrival: float) -> None:
        """Run W's while they end before `arrival` (the time the next pass's input lands), then maybe one more."""
        w = self.cs.w[r]
        while self.has_w(r) and self.free[r] + w <= arrival + EPS:
            self.put(r, W)
        if self.has_w(r) and self.free[r] < arrival - EPS:
            within_slack = arrival - self.free[r] <= self.worst_idle - self.idle[r] + EPS
            if not within_slack or self.ask("fill_over"):
                self.put(r, W)

    def run(self) -> list[list[int]]:
        p, m = self.p, self.m
        self.warm_up()
        for i in range(1, m):
            issue = [self.wants_f(r) for r in range(p)]
            for r in range(p - 2, -1, -1):
                issue[r] = issue[r] and issue[r + 1]
            for r in range(p):
                if issue[r]:
                    while self.held[r] + 1 > self.limit:
                        self.put(r, W)
                    if r > 0:
                        self.fill_before(r, self.end_f[r - 1][self.done[r][F]] + self.cs.comm)
                    self.put(r, F)
            for r in range(p - 1, -1, -1):
                if r < p - 1:
                    self.fill_before(r, self.end_b[r + 1][i] + self.cs.comm)
                if r == 0 and self.done[0][F] == m:
                    while self.has_w(0):
                        self.put(0, W)
                self.put(r, B)
        for r in range(p):
            while self.has_w(r):
                self.put(r, W)
        return self.orders

    def score(self) -> tuple[float, float]:
        """(makespan, bubble rate) of the placed passes; equal to `ScheduleProblem.retime` of the orders (a test
        checks)."""
        bubble = 0.0
        for r in range(self.p):
            first = self.end_f[r][0] - self.cs.f[r]
            span = self.free[r] - first
            busy = self.m * sum(self.cs.of(r))
            if span > 0:
                bubble = max(bubble, 1.0 - busy / span)
        return max(self.free), bubble

    def warm_up(self) -> None:
        """Microbatch 0: F0 everywhere, as many extra F's per rank as fit before B0 comes back, then B0."""
        p, m, cs = self.p, self.m, self.cs
        for r in range(p):
            self.put(r, F)
        extra = [0] * p
        back = self.end_f[p - 1][0] + cs.b[p - 1]  # when B0 of the last stage ends
        for r in range(p - 2, -1, -1):
            clock, held = self.free[r], self.held[r]
            arrival = back + cs.comm
            while 1 + extra[r] < m and held + 1 <= self.limit:
                if (clock + cs.f[r] > arrival + EPS) if self.ask("early_f") else (clock >= arrival - EPS):
                    break
                held += 1
                clock += cs.f[r]
                extra[r] += 1
            back = max(clock, arrival) + cs.b[r]
        # Each rank runs fewer extra F's than the one before it (1F1B's staircase), unless both run them all.
        for r in range(1, p):
            cap = extra[r - 1] if extra[r - 1] == m - 1 else max(0, extra[r - 1] - 1)
            extra[r] = min(extra[r], cap)
        for r in range(p):
            for _ in range(extra[r]):
                self.put(r, F)
        for r in range(p - 1, -1, -1):
            self.put(r, B)

    def wants_f(self, r: int) -> bool:
        p, m, cs = self.p, self.m, self.cs
        nf = self.done[r][F]
        if nf >= m:
            return False
        if not (r + 1 < p and nf >= self.done[r + 1][F] + 2) or not self.ask("b_first"):
            return True
        # The next rank's next F then B are what this rank's F could delay.
        next_b_ready = self.free[r + 1] + cs.f[r + 1] + cs.b[r + 1] + cs.comm
        if self.free[r] >= next_b_ready:
            return False
        forced_w = max(0, self.held[r] + 1 - self.limit)
        if self.free[r] + cs.f[r] + forced_w * cs.w[r] <= next_b_ready + EPS:
            return True
        return next_b_ready - self.free[r] > self.worst_idle - self.idle[r] + EPS


def greedy_seeds(p: int, m: int, cs: Any, limit: int, codes: ActionCodes,
                 tighter_caps: bool = True) -> list[tuple[tuple[float, float], list[list[int]]]]:
    """(score, orders) of the greedy under every switch combination, at the limit and, with `tighter_caps`, a
    few tighter caps; distinct orders only, best first. Orders are per-rank lists of `codes`."""
    caps = range(limit, max(0, limit - 4), -1) if tighter_caps else [limit]
    seen, seeds = set(), []
    for cap in caps:
        runs: list[_Greedy] = []
        for values in itertools.product((True, False), repeat=3):
            switches = dict(zip(_Greedy.SWITCHES, values))
            if any(all(run.switches[k] == v for k, v in switches.items() if k in run.asked) for run in runs):
                continue  # it would retrace a finished run step by step
            greedy = _Greedy(p, m, cs, cap, switches, codes)
            orders = greedy.run()
            runs.append(greedy)
            key = tuple(map(tuple, orders))
            if key not in seen:
                seen.add(key)
                seeds.append((greedy.score(), orders))
    seeds.sort(key=lambda seed: seed[0])
    return seeds
