"""Human-readable counts for reports and tables: FLOPs with decimal prefixes, bytes with binary ones.

    format_flops(1234567)    -> '1.2 MFLOP'       (the split report and the cost tables)
    format_bytes(3565158)    -> '3.4 MiB'
    format_memory(3565158)   -> '3.40 MiB'        (the `plan` tables: two decimals, at most TiB)

Counts below one prefix step print as whole numbers ('512 B'); a symbolic count (a sympy expression in the
graph's size symbols) prints as its expression with the base unit ('(2*s0) B').
"""

from __future__ import annotations

import sympy

__all__ = ["format_flops", "format_bytes", "format_memory"]

_FLOP_UNITS = ("FLOP", "KFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP")
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_flops(x) -> str:
    """1234567 -> '1.2 MFLOP' (decimal prefixes); symbolic counts print their expression."""
    return _human(x, _FLOP_UNITS, 1000, digits=1)


def format_bytes(x) -> str:
    """3565158 -> '3.4 MiB' (binary prefixes); symbolic sizes print their expression."""
    return _human(x, _BYTE_UNITS, 1024, digits=1)


def format_memory(x: float) -> str:
    """3565158 -> '3.40 MiB': two decimals and no prefix past TiB, as the plan tables print memory."""
    return _human(x, _BYTE_UNITS[:5], 1024, digits=2)


def _human(x, units: tuple[str, ...], base: int, *, digits: int) -> str:
    """`x` scaled down by `base` until below it (or out of units), with `digits` decimals past the base unit."""
    if isinstance(x, sympy.Basic):
        return f"({x}) {units[0]}"
    i, scaled = 0, float(x)
    while not abs(scaled) < base and i < len(units) - 1:   # `not <`: a NaN climbs to the last unit, as plan's did
        i, scaled = i + 1, scaled / base
    return f"{scaled:.0f} {units[0]}" if i == 0 else f"{scaled:.{digits}f} {units[i]}"
