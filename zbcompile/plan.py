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

The functions here (`build_schedule`, `compare`, `compare_table`, ...) are what benchmarks reuse.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from zbcompile._format import format_memory as format_bytes
from zbcompile.errors import ScheduleError, ZBCompileError
from zbcompile.passes.schedules import SCHEDULES, generate, list_schedules
from zbcompile.plan_vocab import VocabModel, compare_vocab, vocab_table
from zbcompile.ir.schedule import Schedule
from zbcompile.simulate import Costs, MemoryModel, SimResult, simulate
from zbcompile.timeline import ascii_timeline, svg_timeline

__all__ = [
    "PlanRow", "build_schedule", "load_schedule", "compare", "compare_table", "summary_table",
    "result_json", "parse_bytes", "positive_int", "add_arguments", "run",
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
    return generate(name, pp, microbatches, chunks=chunks, costs=costs, mem_limit=mem_limit)


def load_schedule(path: str | Path, microbatches: int | None = None) -> Schedule:
    """Read our text form (first line `# zbcompile schedule ...`) or torch's compute-only CSV."""
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
        schedule = Schedule.from_torch_csv(text, name=path.stem, num_microbatches=microbatches)
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


# ---- command line --------------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """An argparse type: a count of 1 or more, else the one-line usage error (`plan`, `inspect`)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def _arg(parse):
    """Turn our ScheduleError into argparse's error, so bad values are reported as usage errors."""
    def convert(text: str):
        try:
            return parse(text)
        except ScheduleError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--schedule", metavar="NAME", help="schedule to generate (see --compare for the list)")
    what.add_argument("--compare", action="store_true", help="every schedule side by side")
    what.add_argument("--load", metavar="FILE", help="simulate a saved schedule: torch's CSV or our text form")
    parser.add_argument("--pp", type=positive_int, metavar="P", help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=positive_int, metavar="M", help="microbatches per step")
    parser.add_argument("--chunks", type=positive_int, metavar="V",
                        help="stages per rank for interleaved-1f1b (with --compare, schedules that hold a "
                             "fixed number per rank say so in their row)")
    parser.add_argument("--costs", type=_arg(Costs.parse), default=Costs(), metavar="F=..,B=..,W=..,comm=..",
                        help="per-1F1B-stage times (default all 1, comm 0)")
    parser.add_argument("--mem-limit", type=_non_negative_float, metavar="X",
                        help="activation memory limit per rank in 1F1B-stage units (zb-auto plans under it)")
    parser.add_argument("--b-frees", type=_non_negative_float, default=0.0, metavar="FRACTION",
                        help="share of an F's activations its B frees (default 0: W frees everything)")
    parser.add_argument("--act-bytes", type=_arg(parse_bytes), metavar="SIZE",
                        help="bytes of one 1F1B stage's activations per microbatch, e.g. 1.5GiB")
    parser.add_argument("--width", type=positive_int, metavar="COLS", help="ASCII timeline width")
    parser.add_argument("--csv", metavar="FILE", help="write torch's compute-only CSV")
    parser.add_argument("--svg", metavar="FILE", help="write the timeline as SVG")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    dp = parser.add_argument_group("data parallelism across pipelines")
    dp.add_argument("--dp-comm", type=_non_negative_float, metavar="T",
                    help="time to all-reduce one 1F1B stage's gradients over the replicas (cost units): prints the "
                         "step with the reductions at the end, placed where each stage's gradients are final, and "
                         "with the cooldown's W's in gradient groups (zbcompile/plan_dp.py)")
    dp.add_argument("--dp-pieces", type=positive_int, default=None, metavar="K",
                    help="gradient groups per deferred W for --dp-comm (compile's dp_w_pieces; default 4)")
    boundary = parser.add_argument_group("the step boundary (optimizer step)")
    boundary.add_argument("--step-boundary", type=_non_negative_float, metavar="OPT",
                          help="the optimizer step's time (cost units): prints the steady-state time per iteration "
                               "with a synchronous step (every rank waits for the global norm and inf flag) and "
                               "with post-validation (zbcompile/plan_boundary.py)")
    boundary.add_argument("--boundary-latency", type=_non_negative_float, default=None, metavar="L",
                          help="with --step-boundary: one norm / inf message (one hop; the synchronous step's "
                               "all-reduce counts once; default 0)")
    vocab = parser.add_argument_group("vocabulary parallelism")
    vocab.add_argument("--vocab-parallel", action="store_true",
                       help="compare the schedule(s) with the output layer on the last stage and sharded over "
                            "all ranks (S, T, IF, IB passes)")
    vocab.add_argument("--vocab-ratio", type=_non_negative_float, default=None, metavar="R",
                       help="the output layer's F+B+W time in transformer blocks' (V/(12h+2s); default 4.6, "
                            "about Gemma-2-9B)")
    vocab.add_argument("--layers", type=positive_int, metavar="N",
                       help="transformer blocks in the model, to convert the ratio into stages (default 8 per "
                            "rank)")
    vocab.add_argument("--vocab-act-ratio", type=_non_negative_float, metavar="R",
                       help="the output layer's activations per microbatch in blocks' (default: --vocab-ratio)")


# (flag, the flag it only applies with, its default): given without that flag it would change nothing
_DEPENDENT = (("--dp-pieces", "--dp-comm", 4), ("--boundary-latency", "--step-boundary", 0.0),
              ("--vocab-ratio", "--vocab-parallel", 4.6), ("--layers", "--vocab-parallel", None),
              ("--vocab-act-ratio", "--vocab-parallel", None))


def _attr(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _check_dependent(args: argparse.Namespace) -> None:
    """ScheduleError for a flag given without the one it applies with; then the defaults filled in."""
    for flag, needs, default in _DEPENDENT:
        given, base = getattr(args, _attr(flag)), getattr(args, _attr(needs))
        if given is not None and (base is None or base is False):
            raise ScheduleError(f"{flag} applies only with {needs}; add {needs} or drop {flag}")
        if given is None:
            setattr(args, _attr(flag), default)


def run(args: argparse.Namespace) -> int:
    _check_dependent(args)
    _check_one_report(args)
    memory = MemoryModel(args.b_frees, args.act_bytes)
    if args.vocab_parallel:
        return _run_vocab(args, memory)
    if args.dp_comm is not None:
        return _run_dp(args)
    if args.step_boundary is not None:
        return _run_boundary(args)
    if args.compare:
        return _run_compare(args, memory)
    if args.load:
        if args.pp is not None:
            raise ScheduleError("--load reads the ranks from the file; drop --pp")
        schedule = load_schedule(args.load, args.microbatches)
    else:
        _require(args, "--schedule")
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, chunks=args.chunks,
                                  costs=args.costs, mem_limit=args.mem_limit)
    result = simulate(schedule, args.costs, memory)
    over = check_mem_limit(result, args.mem_limit)
    if over:
        raise ScheduleError(f"schedule {schedule.name!r} {over}; raise the limit or compare schedules "
                            f"with --compare")
    written = _write_files(args, result)
    if args.json:
        print(json.dumps(result_json(result), indent=2))
        return 0
    print(summary_table(result))
    print()
    print(ascii_timeline(result, args.width))
    for line in written:
        print(line)
    return 0


def _check_one_report(args: argparse.Namespace) -> None:
    """ScheduleError for flags a report would drop: --vocab-parallel, --dp-comm and --step-boundary are reports
    of their own (one of them), and the last two write no timeline (--svg / --csv)."""
    modes = [flag for flag, on in (("--vocab-parallel", args.vocab_parallel), ("--dp-comm", args.dp_comm is not None),
                                   ("--step-boundary", args.step_boundary is not None)) if on]
    if len(modes) > 1:
        raise ScheduleError(f"{' and '.join(modes)} are reports of their own: give one of them per run")
    if modes and modes[0] != "--vocab-parallel" and (args.svg or args.csv):
        raise ScheduleError(f"{modes[0]} prints a table per schedule and draws no timeline: drop --svg / --csv "
                            "(plan --schedule NAME writes them)")


def _require(args: argparse.Namespace, mode: str) -> None:
    missing = [flag for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches)) if value is None]
    if missing:
        raise ScheduleError(f"{mode} needs {' and '.join(missing)}")


def _run_compare(args: argparse.Namespace, memory: MemoryModel) -> int:
    _require(args, "--compare")
    if args.csv or args.svg:
        raise ScheduleError("--csv and --svg write one schedule; use --schedule NAME with them, not --compare")
    rows = compare(args.pp, args.microbatches, chunks=args.chunks, costs=args.costs, memory=memory,
                   mem_limit=args.mem_limit)
    if args.json:
        out = {"pp": args.pp, "microbatches": args.microbatches, "costs": str(args.costs),
               "mem_limit": args.mem_limit,
               "schedules": [{"schedule": r.name, "note": r.reason,
                              **(result_json(r.result) if r.result else {})} for r in rows]}
        print(json.dumps(out, indent=2))
        return 0
    print(f"p={args.pp}, m={args.microbatches}, costs {args.costs}"
          + (f", mem limit {args.mem_limit:g} units" if args.mem_limit is not None else ""))
    print(compare_table(rows))
    return 0


def _write_files(args: argparse.Namespace, result: SimResult) -> list[str]:
    written = []
    for path, text in ((args.csv, lambda: result.schedule.to_torch_csv()), (args.svg, lambda: svg_timeline(result))):
        if not path:
            continue
        try:
            Path(path).write_text(text())
        except OSError as exc:
            raise ScheduleError(f"cannot write {path!r}: {exc.strerror or exc}") from None
        written.append(f"wrote {path}")
    return written



def _run_dp(args: argparse.Namespace) -> int:
    from zbcompile.plan_dp import dp_row, dp_table

    rows = [dp_row(s, args.costs, args.dp_comm, args.dp_pieces) for s in _generated(args, "--dp-comm")]
    return _report(args, rows, dp_table(rows, args.dp_comm, args.dp_pieces),
                   dp_comm=args.dp_comm, pieces=args.dp_pieces)


def _run_boundary(args: argparse.Namespace) -> int:
    from zbcompile.plan_boundary import boundary_row, boundary_table

    rows = [boundary_row(s, args.costs, args.step_boundary, args.boundary_latency)
            for s in _generated(args, "--step-boundary")]
    return _report(args, rows, boundary_table(rows, args.step_boundary, args.boundary_latency),
                   optimizer_step=args.step_boundary, latency=args.boundary_latency)


def _generated(args: argparse.Namespace, mode: str) -> list:
    """The schedule --schedule names, or with --compare every schedule that can be generated for pp / m (a
    `mode` that times generated schedules refuses --load)."""
    if args.load:
        raise ScheduleError(f"{mode} generates the schedules it times; use --schedule NAME or --compare")
    _require(args, mode)
    out = []
    memory = MemoryModel(args.b_frees, args.act_bytes)
    for name in (schedule_names() if args.compare else [args.schedule]):
        try:
            schedule = build_schedule(name, args.pp, args.microbatches, chunks=args.chunks, costs=args.costs,
                                      mem_limit=args.mem_limit)
            over = check_mem_limit(simulate(schedule, args.costs, memory), args.mem_limit)
            if over:   # as the plain report refuses it; --compare leaves it out
                raise ScheduleError(f"schedule {name!r} {over}; raise the limit or compare schedules with "
                                    "--compare")
            out.append(schedule)
        except ScheduleError:
            if not args.compare:
                raise
    if not out:
        raise ScheduleError(f"{mode}: no schedule can be generated for p={args.pp}, m={args.microbatches}"
                            + (f" within --mem-limit {args.mem_limit:g}" if args.mem_limit is not None else ""))
    return out


def _report(args: argparse.Namespace, rows, table: str, **fields) -> int:
    """A per-schedule comparison: JSON (the run's fields, then each row's, with its properties) or the table."""
    if args.json:
        print(json.dumps({"pp": args.pp, "microbatches": args.microbatches, "costs": str(args.costs), **fields,
                          "schedules": [r.to_json() for r in rows]}, indent=2))
        return 0
    print(f"p={args.pp}, m={args.microbatches}, costs {args.costs}")
    print(table)
    return 0


def _run_vocab(args: argparse.Namespace, memory: MemoryModel) -> int:
    if args.load:
        raise ScheduleError("--vocab-parallel generates the schedules it compares; use --schedule NAME or --compare")
    _require(args, "--vocab-parallel")
    if args.csv:
        raise ScheduleError("--vocab-parallel writes no CSV: torch's CSV has no vocabulary passes; drop --csv")
    layers = args.layers or 8 * args.pp
    model = VocabModel(args.vocab_ratio, layers / args.pp, args.vocab_act_ratio)
    names = schedule_names() if args.compare else [args.schedule]
    built: list[tuple[str, Schedule | str]] = []
    for name in names:
        try:
            built.append((name, build_schedule(name, args.pp, args.microbatches, chunks=args.chunks,
                                               costs=args.costs, mem_limit=args.mem_limit)))
        except ScheduleError as exc:
            if not args.compare:
                raise
            built.append((name, str(exc).splitlines()[0]))
    rows = compare_vocab(built, args.costs, memory, model)
    written = _write_files(args, rows[0].vocab) if not args.compare and rows[0].vocab is not None else []
    if args.json:
        out = {"pp": args.pp, "microbatches": args.microbatches, "costs": str(args.costs),
               "vocab_ratio": model.ratio, "layers": layers, "vocab_act_ratio": args.vocab_act_ratio,
               "schedules": [{"schedule": r.name, "note": r.reason,
                              "last_stage": result_json(r.baseline) if r.baseline else None,
                              "vocab_parallel": result_json(r.vocab) if r.vocab else None} for r in rows]}
        print(json.dumps(out, indent=2))
        return 0
    print(f"p={args.pp}, m={args.microbatches}, costs {args.costs}; output layer {model.ratio:g} blocks' "
          f"F+B+W ({model.stages:.3g} stages at {model.layers_per_stage:g} blocks per stage)")
    print(vocab_table(rows))
    if not args.compare and rows[0].vocab is not None:
        print()
        print(ascii_timeline(rows[0].vocab, args.width))
        for line in written:
            print(line)
    elif args.svg:
        raise ScheduleError("--svg writes one schedule; use --schedule NAME with it, not --compare")
    return 0
