"""`zbcompile plan`'s command line: its arguments, their checks, and the run that prints the tables, the timeline
and the files it was asked for (the building blocks are zbcompile/plan.py's). See `zbcompile plan --help`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import Schedule
from zbcompile.plan import (build_schedule, check_mem_limit, compare, compare_table, load_schedule,
                            parse_bytes, result_json, schedule_names, summary_table)
from zbcompile.plan_vocab import VocabModel, compare_vocab, vocab_table
from zbcompile.simulate import Costs, MemoryModel, SimResult, simulate
from zbcompile.timeline import ascii_timeline, svg_timeline

__all__ = ["add_arguments", "run", "positive_int"]


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
        raise argparse.ArgumentTypeError(f"expected a finite non-negative number, got {text!r}")
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
        given = [flag for flag, value in (("--pp", args.pp), ("--chunks", args.chunks)) if value is not None]
        if given:
            raise ScheduleError(f"--load reads the ranks and stages from the file; drop {' and '.join(given)}")
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
