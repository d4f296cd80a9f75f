"""`zbcompile plan`: generate (or load) a schedule, simulate it, and show what it costs.

    zbcompile plan --schedule zb-h1 --pp 4 --microbatches 8 --costs F=1,B=1.1,W=0.6,comm=0.05
    zbcompile plan --compare --pp 8 --microbatches 24 --mem-limit 8
    zbcompile plan --load schedule.csv --svg schedule.svg
    zbcompile plan --schedule 1f1b --pp 4 --microbatches 16 --vocab-parallel --vocab-ratio 4.6 --layers 32

Prints a summary (makespan, the papers' bubble rate, the idle share, peak activation memory per rank)
and an ASCII timeline; `--compare` puts every schedule side by side for the same inputs, naming the reason
in the row when a schedule cannot run there. Memory is counted in 1F1B-stage units (1 = the activations
one 1F1B stage keeps for one microbatch), and so is `--mem-limit`. `--vocab-parallel` simulates the chosen
schedule(s) with the output layer on the last stage and with vocabulary parallelism (`zbcompile.plan_vocab`).

The functions here (`build_schedule`, `compare`, `compare_table`, ...) are what benchmarks reuse; the command
line's arguments and its run are in zbcompile/plan_cli.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from zbcompile._format import format_memory as format_bytes
from zbcompile.errors import ScheduleError, ZBCompileError
from zbcompile.passes.schedules import SCHEDULES, generate, list_schedules
from zbcompile.ir.schedule import Schedule
from zbcompile.simulate import Costs, MemoryModel, SimResult, simulate

__all__ = [
    "PlanRow", "build_schedule", "load_schedule", "compare", "compare_table", "summary_table",
    "result_json", "parse_bytes",
]


# ---- building blocks (also used by benchmarks/) ---------------------------------------------------------
def schedule_names() -> list[str]:
    """Every schedule name the generators know, in their order."""
    return list(list_schedules())


def build_schedule(name: str, pp: int, microbatches: int, *, chunks: int | None = None,
                   costs: Costs | None = None, mem_limit: float | None = None) -> Schedule:
    """Generate schedule `name`; an unknown name is a ScheduleError listing the known ones."""
    names = list(list_schedules())
    if name not in names:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(names)}")
    spec = SCHEDULES.get(name)   # mem_limit for the schedules that plan under it; the others' fit is checked after
    reads = spec is None or "mem_limit" in spec.accepts
    return generate(name, pp, microbatches, chunks=chunks, costs=costs, mem_limit=mem_limit if reads else None)


def load_schedule(path: str | Path, microbatches: int | None = None) -> Schedule:
    """Read our text form (first line `# zbcompile schedule ...`) or torch's compute-only CSV. `microbatches`,
    where given, must be the file's number (ScheduleError otherwise: the file says how many)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScheduleError(f"cannot read schedule file {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"schedule file {str(path)!r} is not text (not UTF-8): give our text form "
                            "('# zbcompile schedule ...') or torch's CSV") from None
    if text.lstrip().startswith("# zbcompile schedule"):
        schedule = Schedule.from_text(text)
    else:
        schedule = Schedule.from_torch_csv(text, name=path.stem)
    if microbatches is not None and microbatches != schedule.num_microbatches:
        raise ScheduleError(f"schedule file {str(path)!r} holds {schedule.num_microbatches} microbatch(es), not "
                            f"--microbatches {microbatches}: drop --microbatches (the file says how many)")
    return schedule.validate()


def check_mem_limit(result: SimResult, mem_limit: float | None) -> str | None:
    """Why `result` does not fit under `mem_limit` units, or None when it does."""
    if mem_limit is None:
        return None
    peak = max(result.peak_memory, default=0.0)
    if peak <= mem_limit + 1e-9:
        return None
    rank = result.peak_memory.index(peak)
    return f"needs {peak:g} units on rank {rank}, above --mem-limit {mem_limit:g}"


@dataclass(frozen=True)
class PlanRow:
    """One schedule in a comparison: its simulation, or the reason it has none (or does not fit)."""

    name: str
    result: SimResult | None
    reason: str | None = None


def compare(pp: int, microbatches: int, *, chunks: int | None = None, costs: Costs = Costs(),
            memory: MemoryModel = MemoryModel(), mem_limit: float | None = None,
            names: list[str] | None = None) -> list[PlanRow]:
    """Generate and simulate every schedule (or `names`) for the same inputs.

    A schedule that cannot be built at this p/m, or that exceeds `mem_limit`, gets a row with the reason.
    Raises ScheduleError when `mem_limit` is below what every schedule needs.
    """
    rows = []
    for name in names or schedule_names():
        try:
            schedule = build_schedule(name, pp, microbatches, chunks=chunks, costs=costs, mem_limit=mem_limit)
            result = simulate(schedule, costs, memory)
        except ZBCompileError as exc:
            rows.append(PlanRow(name, None, str(exc).splitlines()[0]))
            continue
        rows.append(PlanRow(name, result, check_mem_limit(result, mem_limit)))
    if rows and all(row.result is None for row in rows):
        reasons = list(dict.fromkeys(row.reason for row in rows))
        raise ScheduleError(f"no schedule can be built at p={pp}, m={microbatches}: {'; '.join(reasons[:3])}")
    if mem_limit is not None and not any(row.reason is None for row in rows):
        needs = [max(row.result.peak_memory) for row in rows if row.result is not None]
        least = [f"the least a schedule here needs is {min(needs):g}"] if needs else []
        failed = [row.reason if row.reason.startswith(row.name) else f"{row.name}: {row.reason}"
                  for row in rows if row.result is None and row.reason]
        raise ScheduleError(f"--mem-limit {mem_limit:g} is below what any schedule needs at p={pp}, "
                            f"m={microbatches} ({'; '.join(least + failed)})")
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


_NOTE_WIDTH = 64  # wrap long reasons instead of stretching the table


def closed_form(name: str, pp: int, microbatches: int, chunks: int | None = None) -> tuple[float | None, float | None]:
    """The papers' (bubble rate, peak memory) under unit costs and no communication, where they give one
    (the generator's `ScheduleSpec.closed_form`; (None, None) for an unknown name or none stated).

    Memory is in 1F1B-stage units, at most `microbatches` (no rank holds more activations than there are
    microbatches, whatever the steady state's peak). `chunks` is interleaved-1f1b's (default 2).
    """
    spec = SCHEDULES.get(name)
    if spec is None or spec.closed_form is None:
        return None, None
    bubble, memory = spec.closed_form(pp, microbatches, chunks or 2)
    return bubble, (None if memory is None else min(memory, microbatches))


def compare_table(rows: list[PlanRow], tablefmt: str = "simple") -> str:
    """Side-by-side table: makespan, both bubble rates, peak memory (max / min over ranks, and bytes), and
    the papers' closed forms under unit costs next to them."""
    with_bytes = any(r.result is not None and r.result.peak_bytes is not None for r in rows)
    head = ["schedule", "stages", "makespan", "bubble rate", "bubble share", "peak mem (max)", "peak mem (min)"]
    head += ["peak bytes (max)"] if with_bytes else []
    head += ["paper (unit costs)", "note"]
    body = []
    for row in rows:
        res = row.result
        if res is None:
            body.append([row.name] + ["-"] * (len(head) - 2) + [row.reason])
            continue
        line = [row.name, res.schedule.num_stages, f"{res.makespan:g}", _pct(res.bubble_rate),
                _pct(res.bubble_share), f"{max(res.peak_memory):g}", f"{min(res.peak_memory):g}"]
        line += [format_bytes(max(res.peak_bytes))] if with_bytes and res.peak_bytes else ["-"] * with_bytes
        body.append(line + [_paper(row.name, res.schedule), row.reason or ""])
    widths = [None] * (len(head) - 1) + [_NOTE_WIDTH]
    return tabulate(body, headers=head, tablefmt=tablefmt, disable_numparse=True, maxcolwidths=widths)


def _paper(name: str, schedule: Schedule) -> str:
    chunks = schedule.num_stages // schedule.num_ranks
    bubble, memory = closed_form(name, schedule.num_ranks, schedule.num_microbatches, chunks)
    parts = [_pct(bubble) if bubble is not None else "", f"mem {memory:g}" if memory is not None else ""]
    return " / ".join(p for p in parts if p) or "-"


def summary_table(result: SimResult, tablefmt: str = "simple") -> str:
    """The headline numbers, then one line per rank."""
    s = result.schedule
    peak = max(result.peak_memory, default=0.0)
    head = [
        ["schedule", s.name],
        ["ranks x stages x microbatches", f"{s.num_ranks} x {s.num_stages} x {s.num_microbatches}"],
        ["costs", str(result.costs)],
        ["makespan", f"{result.makespan:g}"],
        ["bubble rate (worst rank, papers')", _pct(result.bubble_rate)],
        ["bubble share (all ranks, whole run)", _pct(result.bubble_share)],
        ["peak memory (units, worst rank)", f"{peak:g}"],
    ]
    if result.peak_bytes is not None:
        head.append(["peak memory (bytes, worst rank)", format_bytes(max(result.peak_bytes, default=0.0))])
    cols = ["rank", "busy", "span", "bubble", "peak mem (units)"]
    cols += ["peak bytes"] if result.peak_bytes is not None else []
    ranks = []
    for r in range(s.num_ranks):
        line = [r, f"{result.busy[r]:g}", f"{result.span[r]:g}", _pct(result.rank_bubbles[r]),
                f"{result.peak_memory[r]:g}"]
        line += [format_bytes(result.peak_bytes[r])] if result.peak_bytes is not None else []
        ranks.append(line)
    return (tabulate(head, tablefmt=tablefmt, disable_numparse=True) + "\n\n"
            + tabulate(ranks, headers=cols, tablefmt=tablefmt, disable_numparse=True))


def result_json(result: SimResult) -> dict:
    """Machine-readable summary of one simulation."""
    s = result.schedule
    return {
        "schedule": s.name,
        "pp": s.num_ranks,
        "microbatches": s.num_microbatches,
        "stages": s.num_stages,
        "pipelines": s.pipelines,
        "costs": {"f": result.costs.f, "b": result.costs.b, "w": result.costs.w, "comm": result.costs.comm},
        "makespan": result.makespan,
        "bubble_rate": result.bubble_rate,
        "bubble_share": result.bubble_share,
        "peak_memory": max(result.peak_memory, default=0.0),
        "peak_bytes": max(result.peak_bytes, default=0.0) if result.peak_bytes is not None else None,
        "ranks": [
            {"rank": r, "busy": result.busy[r], "span": result.span[r], "bubble": result.rank_bubbles[r],
             "peak_memory": result.peak_memory[r],
             "peak_bytes": result.peak_bytes[r] if result.peak_bytes is not None else None}
            for r in range(s.num_ranks)
        ],
    }


_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """`"512MiB"`, `"1.5GB"`, `"2e9"` -> bytes (KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)."""
    match = _BYTES_RE.match(text)
    if not match:
        raise ScheduleError(f"cannot parse {text!r} as a size: expected a number with an optional unit "
                            f"such as 2e9, 512MiB or 1.5GB")
    number, unit = float(match.group(1)), (match.group(2) or "b").lower()
    if unit == "b":
        return number
    base = 1024 if "i" in unit else 1000
    return number * base ** ("kmgt".index(unit[0]) + 1)
