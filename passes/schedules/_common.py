"""Helpers shared by the hand-made generators: argument checks and action constructors."""

from __future__ import annotations

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import Action, Kind


def check_pp(name: str, pp: int, *, even: bool = False) -> None:
    """Every generator needs a real pipeline: at least two ranks (and an even count where asked)."""
    if not isinstance(pp, int) or pp < 2:
        raise ScheduleError(f"{name} needs pp >= 2 pipeline ranks; got {pp!r}: use pp >= 2 or run without "
                            f"pipeline parallelism")
    if even and pp % 2:
        raise ScheduleError(f"{name} needs an even pp (its two directions pair rank r with rank pp-1-r); "
                            f"got pp={pp}: pick an even pp or use dualpipev")


def check_microbatches(name: str, pp: int, m: int, minimum: int, rule: str, alternative: str) -> None:
    """Raise unless m >= minimum; `rule` spells the minimum (e.g. '2*pp'), `alternative` says what else to do."""
    if not isinstance(m, int) or m < minimum:
        spelled = str(minimum) if rule == str(minimum) else f"{rule} = {minimum}"
        raise ScheduleError(f"{name} needs microbatches >= {spelled} for pp={pp}; got {m!r}: "
                            f"raise --microbatches{alternative}")


def F(stage: int, mb: int) -> Action:
    return Action(Kind.F, stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action(Kind.B, stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action(Kind.W, stage, mb)


def BW(stage: int, mb: int) -> Action:
    return Action(Kind.BW, stage, mb)
