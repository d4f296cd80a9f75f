"""Schedule generators: pure functions from integers to a validated `Schedule`.

    generate("zb-h1", pp=4, microbatches=8)  ->  Schedule

Each hand-made generator lives with its family (gpipe_1f1b, interleaved, zero_bubble, v_shape, dualpipe);
`zb-auto`, the cost- and memory-aware search, is imported on first use from `zb_auto`.
"""

from __future__ import annotations

from typing import Callable

from zbcompile.errors import ScheduleError
from zbcompile.schedule import Schedule

from .dualpipe import dualpipe, dualpipev
from .gpipe_1f1b import gpipe, one_f_one_b
from .interleaved import interleaved_1f1b
from .v_shape import v_half, v_min, v_zb, zbv
from .zero_bubble import zb_h1, zb_h2

__all__ = ["GENERATORS", "generate", "list_schedules"]


def _zb_auto(pp: int, microbatches: int, *, costs=None, mem_limit=None) -> Schedule:
    """Imported lazily so that this registry works before and without the zb_auto module."""
    try:
        from .zb_auto import zb_auto
    except ImportError as err:
        raise ScheduleError(f"zb-auto is not available ({err}); pick one of the hand-made schedules: "
                            f"{', '.join(n for n in GENERATORS if n != 'zb-auto')}") from err
    return zb_auto(pp, microbatches, costs=costs, mem_limit=mem_limit)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "v-min": v_min,
    "v-half": v_half,
    "v-zb": v_zb,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
    "zb-auto": _zb_auto,
}

_DESCRIPTIONS = {
    "gpipe": "all forwards, then all backwards; peak memory m",
    "1f1b": "one forward, one fused backward; peak p, bubble (p-1)/(m+p-1); any m >= 1",
    "interleaved-1f1b": "Megatron virtual pipeline with --chunks v >= 2 (default 2); bubble (p-1)/(vm+p-1); m >= p",
    "zb-h1": "handcrafted zero bubble, B/W split; peak p, bubble (p-1)/(3m+p-1); any m >= 1",
    "zb-h2": "handcrafted zero bubble, B/W split; peak 2p-1, zero bubble once m >= 2p-1; any m >= 1",
    "zbv": "handcrafted ZB-V on the V placement; peak p, zero bubble once m >= 2p; any m >= 1",
    "v-min": "controllable-memory V, peak (p+4)//3 (a third of 1F1B); any m >= 1",
    "v-half": "controllable-memory V, peak (p+2)//2 (half of 1F1B); any m >= 1",
    "v-zb": "controllable-memory V at peak p (ZB-V's order); zero bubble once m >= 2p",
    "dualpipe": "DeepSeek DualPipe, two mirrored pipelines over even p; peak p+1; m >= 2 (2p for its steady state)",
    "dualpipev": "DualPipe folded into a V (DualPipeV); peak p+0.5; m >= 1 (2p for its steady state)",
    "zb-auto": "automatic zero-bubble search under --costs and --mem-limit",
}


_TWO_STAGES_PER_RANK = {"zbv", "v-min", "v-half", "v-zb", "dualpipe", "dualpipev"}


def list_schedules() -> dict[str, str]:
    """Schedule name -> one-line description, in registry order (the CLI prints this)."""
    return {name: _DESCRIPTIONS[name] for name in GENERATORS}


def generate(name: str, pp: int, microbatches: int, *, chunks: int | None = None, costs=None,
             mem_limit: float | None = None) -> Schedule:
    """Build schedule `name` for `pp` ranks and `microbatches`; raises ScheduleError on bad input.

    `chunks` is read by interleaved-1f1b only; `mem_limit` by zb-auto only; `costs` by zb-auto and by zbv
    and v-zb (which polish their order for them under their own peak); the other hand-made schedules are
    fixed orders, whatever the costs.
    """
    gen = GENERATORS.get(name)
    if gen is None:
        raise ScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(GENERATORS)}")
    if name == "interleaved-1f1b":
        return gen(pp, microbatches, chunks)
    own = 2 if name in _TWO_STAGES_PER_RANK else 1
    if chunks is not None and chunks != own:
        raise ScheduleError(f"schedule {name!r} holds {own} stage(s) per rank and cannot take --chunks {chunks}; "
                            f"drop --chunks, or pick interleaved-1f1b for a chosen number of chunks")
    if name == "zb-auto":
        return gen(pp, microbatches, costs=costs, mem_limit=mem_limit)
    if name in ("zbv", "v-zb"):
        return gen(pp, microbatches, costs=costs)
    return gen(pp, microbatches)
