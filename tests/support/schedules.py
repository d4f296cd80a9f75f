"""Hand-built schedules whose timings can be worked out by hand, for the simulator, vocabulary and plan tests
(tests/schedule/)."""

from __future__ import annotations

from zbcompile.ir.schedule import Action, Kind, Schedule, loop_placement


def acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(t) for t in text.split())


def one_f_one_b(p: int, m: int, split: bool = False) -> Schedule:
    """Plain 1F1B: p-1-r warm-up forwards on rank r, then one forward / one backward; `split` runs B then W
    where 1F1B runs BW."""
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        row = [Action(Kind.F, r, i) for i in range(warm)]
        for b in range(m):
            if warm + b < m:
                row.append(Action(Kind.F, r, warm + b))
            row += [Action(Kind.B, r, b), Action(Kind.W, r, b)] if split else [Action(Kind.BW, r, b)]
        ranks.append(tuple(row))
    return Schedule("1f1b", m, loop_placement(p), tuple(ranks)).validate()
