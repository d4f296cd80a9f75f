"""`zbcompile inspect MODULE:FACTORY --pp P --schedule NAME`: show what the compiler makes of a model.

Runs the whole compiler in this one process, without launching ranks: trace and split the model, generate
the schedule, lower it for every rank, then print the stage report and each rank's program (the generated
Python of its fx GraphModule, with sends, receives and frees), and optionally draw the schedule as SVG.

FACTORY is a callable that takes no arguments and returns `(model, loss_fn, example)`, the same three
things `zbcompile.compile` takes; `zbcompile.examples.train_gpt:tiny` is one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from pathlib import Path
from typing import Callable

from zbcompile.errors import ZBCompileError
from zbcompile.plan_cli import positive_int

__all__ = ["add_arguments", "run", "load_factory", "dp_table", "boundary_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a no-argument callable returning (model, loss_fn, example)")
    parser.add_argument("--pp", type=positive_int, required=True, help="pipeline ranks")
    parser.add_argument("--schedule", required=True, help="schedule name (see `zbcompile plan --compare`)")
    parser.add_argument("--microbatches", type=positive_int, default=None,
                        help="microbatches per step (default 2*pp)")
    parser.add_argument("--chunks", type=positive_int, default=None, help="stages per rank for interleaved-1f1b")
    parser.add_argument("--split-points", default=None,
                        help="comma-separated module names to cut before (default: balanced by cost)")
    parser.add_argument("--rank", type=int, default=None, help="print only this rank's program")
    parser.add_argument("--ops", action="store_true",
                        help="print the rank-program IR (one op per line) instead of the generated Python")
    parser.add_argument("--svg", type=Path, default=None, help="also draw the schedule to this SVG file")
    parser.add_argument("--memory", action="store_true",
                        help="print each rank's memory plan (peak activation and total bytes, the op at the peak) "
                             "instead of the programs; with --svg, draw memory over the step per rank")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="write the memory plan as JSON: {\"ranks\": [{\"rank\": r, \"peak_activation_bytes\": "
                             "..., \"peak_total_bytes\": ..., ...}]}")
    parser.add_argument("--offload", default=None, metavar="BYTES|auto",
                        help="plan activation offload for a per-rank device-memory budget (bytes, or 'auto': what "
                             "hides behind compute) and show the programs / memory with the copies in them")
    parser.add_argument("--device", default=None, choices=("h100", "a100", "cpu"),
                        help="device model for the offload's time estimate (k and slowdown; default h100)")
    parser.add_argument("--capture-check", action="store_true",
                        help="lower for CUDA-graph capture of the whole step (capture_ready) and print per rank "
                             "'capture-safe' or what blocks capture (op or graph node, reason, fix); exits 1 "
                             "when any rank has a problem")
    parser.add_argument("--replay-check", type=int, default=None, metavar="STEPS",
                        help="with the capture check (implies --capture-check): also run STEPS steps (at least 3) "
                             "of every rank's capture-ready program in threads of this process, on the example "
                             "repeated into a batch, and check that from step 2 on each step touches the same "
                             "static memory and posts the same messages, and that nothing it allocates outlives it "
                             "(runtime/replay_check.py)")
    parser.add_argument("--dp", type=positive_int, default=1, metavar="N",
                        help="lower for N data-parallel replicas: shows where each gradient bucket's all-reduce is "
                             "posted and how much of the step's compute is left to hide it")
    parser.add_argument("--dp-bucket-mb", type=float, default=None, metavar="MIB",
                        help="with --dp: at most this many MiB per all-reduce (compile's dp_bucket_mb)")
    parser.add_argument("--dp-shard", choices=("step", "microbatch"), default=None,
                        help="with --dp: sharded data parallelism (compile's dp_shard=True with dp_gather=...): "
                             "also shows where each parameter bucket's all-gather is posted and waited for")
    parser.add_argument("--post-validate", action="store_true",
                        help="the post-validated step (step(..., post_validate=True)): each rank's warm-up before "
                             "its deadline and what a rollback drains, then the validating programs")
    parser.add_argument("--vocab-parallel", action="store_true",
                        help="shard the embedding and the output layer over every rank (vocabulary parallelism): "
                             "shows the vocabulary passes, their S / T / IF / IB actions and the collectives")


def load_factory(target: str) -> Callable[[], tuple]:
    """Import `module:attr`; the error says which half is wrong."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ZBCompileError(f"inspect: {target!r} is not MODULE:FACTORY (e.g. zbcompile.examples.train_gpt:tiny)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ZBCompileError(f"inspect: cannot import module {module_name!r}: {exc}") from None
    except Exception as exc:   # (a SyntaxError too) the module's own code failed: say where, not a traceback
        raise ZBCompileError(f"inspect: importing module {module_name!r} failed: {type(exc).__name__}: {exc}") \
            from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ZBCompileError(f"inspect: module {module_name!r} has no callable {attr!r}")
    return factory


def run(args: argparse.Namespace) -> int:
    from zbcompile.compiler import compile_programs
    from zbcompile.options import CompileOptions
    from zbcompile.passes.lower import emit_fx
    from zbcompile.split import report

    if args.rank is not None and not 0 <= args.rank < args.pp:
        raise ZBCompileError(f"inspect: --rank {args.rank} is not a rank of a {args.pp}-rank pipeline "
                             f"(0..{args.pp - 1})")
    for flag in ("dp_shard", "dp_bucket_mb"):   # given without --dp they would change nothing
        if getattr(args, flag, None) is not None and getattr(args, "dp", 1) < 2:
            raise ZBCompileError(f"inspect: --{flag.replace('_', '-')} applies only with --dp N (N >= 2 replicas); "
                                 f"add --dp 2 or drop it")
    capture = getattr(args, "capture_check", False) or getattr(args, "replay_check", None) is not None
    _check_modes(args, capture)
    _check_outputs(args)
    model, loss_fn, example = _build(load_factory(args.target))
    options = CompileOptions(schedule=args.schedule, microbatches=args.microbatches or 2 * args.pp,
                             loss_fn=loss_fn, example=example, chunks=args.chunks,
                             split_points=args.split_points.split(",") if args.split_points else None,
                             vocab_parallel=getattr(args, "vocab_parallel", False), cuda_graphs=capture,
                             offload=_offload_budget(args),
                             **({} if getattr(args, "dp_bucket_mb", None) is None else
                                {"dp_bucket_mb": args.dp_bucket_mb}),
                             **({} if getattr(args, "dp_shard", None) is None else
                                {"dp_shard": True, "dp_gather": args.dp_shard}))
    replicas, device = getattr(args, "dp", 1), getattr(args, "device", None) or "h100"
    if options.offload is not None:
        print(f"# activation offload for {args.offload} (time model: {device})")
    # the programs zb.compile would make; capture problems are printed per rank below, not raised
    compiled = compile_programs(model, options, args.pp, time_model=device,
                                lint_capture=False, replicas=replicas)
    schedule, staged, programs = compiled.schedule, compiled.staged, compiled.programs
    if compiled.offload is not None:
        _offload_table(compiled.offload)
    if capture:
        failed = _capture_check(args, programs)
        if getattr(args, "replay_check", None) is not None:
            failed |= _replay_check(args, programs, model, staged, example)
        return 1 if failed else 0
    if args.memory or args.json:
        return _memory(args, programs)
    print(report(staged))
    print()
    if staged.vocab is not None:
        print(_vocab_report(staged.vocab))
        print()
    print(schedule.to_text())
    ranks = range(args.pp) if args.rank is None else [args.rank]
    if replicas > 1:
        print(dp_table(programs, ranks))
        print()
    if getattr(args, "post_validate", False):
        from zbcompile.compiler import compile_boundary

        programs = compile_boundary(compiled)[1]
        print(boundary_table(programs, ranks))
        print()
    for r in ranks:
        stages = [s for s, owner in enumerate(schedule.placement) if owner == r]
        print(f"# ---- rank {r}: stages {stages} " + "-" * 40)
        print(programs[r] if args.ops else emit_fx(programs[r]).code)
    if args.svg:
        _draw(schedule, args.svg)
    return 0


def dp_table(programs, ranks) -> str:
    """Per rank and data-parallel bucket: what it reduces, the action after which it is posted, and the compute
    actions of the step still to run then (what hides the all-reduce; 0: exposed at the end of the step)."""
    from tabulate import tabulate

    from zbcompile.ir.program.ops import OpKind

    rows = []
    for r in ranks:
        runs = [i for i, op in enumerate(programs[r].ops) if op.kind is OpKind.RUN]
        for i, op in enumerate(programs[r].ops):
            if op.kind is OpKind.DP_REDUCE:
                before = [j for j in runs if j < i]
                after = len(runs) - len(before)
                rows.append([r, op.args.bucket, op.note, str(programs[r].ops[before[-1]].action) if before else "-",
                             after])
    text = ("# data-parallel gradient reductions (passes/lower/dp_reduce.py)\n"
            + tabulate(rows, headers=["rank", "bucket", "gradients", "posted after", "actions left to hide it"]))
    gathers = _gather_rows(programs, ranks)
    if gathers:
        text += ("\n\n# parameter all-gathers (passes/lower/dp_shard.py)\n"
                 + tabulate(gathers, headers=["rank", "bucket", "parameters", "posted after", "waited for before"]))
    return text


def boundary_table(programs, ranks) -> str:
    """Per rank of the validating programs (passes/lower/step_boundary.py): the warm-up actions that run before
    its VALIDATE on the optimistically updated parameters (run again after a rollback), and the messages of its
    upstream's longer warm-up that a rollback drains."""
    from tabulate import tabulate

    from zbcompile.ir.program.ops import OpKind

    rows = []
    for r in ranks:
        ops = programs[r].ops
        at = next(i for i, op in enumerate(ops) if op.kind is OpKind.VALIDATE)
        warm = [str(op.action) for op in ops[:at] if op.kind is OpKind.RUN]
        drains = ops[at].args.drains
        rows.append([r, len(warm), " ".join(warm) or "-", len(drains),
                     ", ".join(sorted({f"from {m.peer}" for m in drains})) or "-"])
    return ("# post-validation: the warm-up before each rank's deadline (passes/lower/step_boundary.py)\n"
            + tabulate(rows, headers=["rank", "warm-up actions", "before VALIDATE", "drained on a rollback",
                                      "upstream"]))


def _gather_rows(programs, ranks) -> list[list]:
    """Per rank and parameter gather: what it gathers, the action it is posted after and the one it serves."""
    from zbcompile.ir.program.ops import OpKind

    rows = []
    for r in ranks:
        last, posted, waited = "-", {}, []   # waited: rows whose wait is done, for the next action
        for op in programs[r].ops:
            if op.kind is OpKind.RUN:
                last = str(op.action)
                for row in waited:
                    row[4] = last
                waited = []
            elif op.kind is OpKind.DP_GATHER:
                posted[op.outs[0]] = [r, op.args.bucket, op.note.split(" for ")[0], last, "-"]
                rows.append(posted[op.outs[0]])
            elif op.kind is OpKind.WAIT_GATHER:
                waited.append(posted[op.ins[0]])
    return rows


def _capture_check(args: argparse.Namespace, programs) -> bool:
    """Per rank: 'capture-safe', or the table of what blocks CUDA-graph capture of its step; True if any."""
    from zbcompile.passes.analysis.capture import capture_problems, problems_table

    failed = False
    for r in range(args.pp) if args.rank is None else [args.rank]:
        problems = capture_problems(programs[r])
        failed |= bool(problems)
        print(f"rank {r}: capture-safe" if not problems else f"rank {r}: {len(problems)} problem(s)\n"
              f"{problems_table(problems)}")
    return failed


def _replay_check(args: argparse.Namespace, programs, model, staged, example) -> bool:
    """Run every rank's program `--replay-check` steps under ReplayCheck (ranks as threads of a loopback world);
    print per rank what the steps shared or the first difference; True if any rank failed."""
    import threading

    import torch

    from zbcompile.errors import CaptureError
    from zbcompile.passes.lower import emit_fx
    from zbcompile.runtime.loopback import LoopbackWorld, rank_runtime
    from zbcompile.runtime.replay_check import ReplayCheck

    steps = args.replay_check   # (at least 3: _check_modes)
    if any(p.is_meta for p in model.parameters()):
        raise ZBCompileError("inspect: --replay-check runs the model, whose parameters are on the meta device here; "
                             "use a factory that builds real weights")
    m = programs[0].microbatches
    flat = [t for part in example for t in (part if isinstance(part, (tuple, list)) else (part,))]
    batch = [torch.cat([t] * m) for t in flat]   # the example microbatch, m times
    world = LoopbackWorld(len(programs))
    results: list = [None] * len(programs)

    def run(r: int) -> None:
        try:
            rt, _ = rank_runtime(world, programs, r, emit_fx(programs[r]), model, staged,
                                 device=str(batch[0].device), timeout=60)
            check = ReplayCheck(rt, warmup=1)
            for _ in range(steps):
                check.step(batch)
            static, messages, _ = check.reference
            results[r] = (f"steps 2-{steps} identical ({len(static)} static storages, {len(messages)} messages, "
                          "no escapes)", False)
        except CaptureError as e:
            results[r] = (str(e), True)
            world.abort()
        except Exception as e:   # another rank's failure reaches this one as an aborted wait
            results[r] = (f"stopped: {type(e).__name__}: {e}", True)
            world.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(args.pp) if args.rank is None else [args.rank]:
        print(f"rank {r}: replay check: {results[r][0]}")
    return any(failed for _, failed in results)


def _offload_budget(args: argparse.Namespace) -> int | str | None:
    """--offload as compile's offload option."""
    if not getattr(args, "offload", None):
        return None
    text = args.offload.replace("_", "")
    if text != "auto" and not text.isdigit():
        raise ZBCompileError(f"inspect: --offload {args.offload!r}: give a byte budget (e.g. 3000000) or 'auto'")
    return "auto" if text == "auto" else int(text)


def _offload_table(report) -> None:
    """What each rank offloads and what it costs."""
    from tabulate import tabulate

    rows = [(r.rank, len(r.choice.units or ()), r.choice.prefetch, r.offloaded_bytes / 2**20,
             r.peak_before / 2**20, r.peak_after / 2**20, r.k, r.slowdown) for r in report]
    print(tabulate(rows, headers=("rank", "forwards offloaded", "prefetch", "MiB moved out", "peak MiB before",
                                  "peak MiB after", "k = To/Tc", "modelled slowdown"), floatfmt=".3f"))
    print()


def _memory(args: argparse.Namespace, programs) -> int:
    """The memory plan: a table per rank, memory over the step as SVG, the whole plan as JSON."""
    import json

    from zbcompile.passes.analysis.memory import memory_plan
    from zbcompile.timeline import svg_memory

    plan = memory_plan(programs)
    if args.rank is not None:   # that rank's row, file and drawing only
        plan = dataclasses.replace(plan, ranks=(plan.ranks[args.rank],))
    print(f"# memory plan of {args.schedule} on {args.pp} ranks, {programs[0].microbatches} microbatches "
          "(resident: parameters, buffers, static receive and input buffers; step: what the step allocates)")
    print(plan.table())
    if args.svg:
        _write(args.svg, svg_memory(plan), "svg")
        print(f"# wrote {args.svg}")
    if args.json:
        _write(args.json, json.dumps(plan.to_json(), indent=1), "json")
        print(f"# wrote {args.json}")
    return 0


def _vocab_report(vocab) -> str:
    """The vocabulary layers: what was found, the shard of each rank and the four passes' graphs."""
    from tabulate import tabulate

    rows = [[r, f"[{r * vocab.rows}, {min((r + 1) * vocab.rows, vocab.size)})",
             (r + 1) * vocab.rows - min((r + 1) * vocab.rows, vocab.size)] for r in range(vocab.shards)]
    lines = [f"# vocabulary parallelism: {vocab.pattern}", f"# each rank holds {vocab.rows} rows of "
             f"{', '.join(vocab.params)}",
             tabulate(rows, headers=["rank", "rows", "padding rows"])]
    for key, title in (("if", "IF: partial embedding lookup (then reduce-sum onto the first stage)"),
                       ("s", "S: local logits and softmax statistics (then all-gather)"),
                       ("t", "T: online-softmax combine, loss, weight gradient, input-gradient share (then "
                             "reduce-sum onto the last stage)"),
                       ("ib", "IB: scatter of the first stage's input gradient into the shard's rows")):
        g = vocab.graphs[key]
        lines.append(f"# ---- vocab_{key} ({title}): {', '.join(g.inputs)} -> {', '.join(g.outputs)}")
        lines.append(g.gm.code.strip())
    return "\n".join(lines)


def _build(factory: Callable[[], tuple]) -> tuple:
    import inspect as pyinspect

    try:
        pyinspect.signature(factory).bind()
    except TypeError as e:
        raise ZBCompileError(f"inspect: the factory is called with no arguments, but {e}; give a function of no "
                             "arguments (defaults are fine) that returns (model, loss_fn, example)") from None
    except ValueError:   # no signature to read (a builtin): call it and see
        pass
    try:
        built = factory()
    except Exception as exc:
        raise ZBCompileError(f"inspect: the factory raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(built, tuple) and len(built) == 3):
        raise ZBCompileError("inspect: the factory must return (model, loss_fn, example)")
    from torch import nn

    if not isinstance(built[0], nn.Module):
        raise ZBCompileError(f"inspect: the factory must return (model, loss_fn, example) with an nn.Module "
                             f"model; its first item is a {type(built[0]).__name__}")
    return built


def _check_modes(args: argparse.Namespace, capture: bool) -> None:
    """ZBCompileError, before anything is compiled, for flags the chosen view would drop: --svg / --json write
    the memory plan, which the capture checks do not print; the post-validated step's memory depends on the
    optimizer (its snapshot), which inspect does not have."""
    files = [f"--{flag}" for flag in ("svg", "json") if getattr(args, flag, None) is not None]
    if capture and files:
        raise ZBCompileError(f"inspect: {files[0]} writes the memory plan, which --capture-check / --replay-check "
                             "do not make; run them apart (--memory for the plan)")
    views = [f"--{flag}" for flag in ("memory", "ops") if getattr(args, flag, False)]
    if capture and views:
        raise ZBCompileError(f"inspect: --capture-check / --replay-check print the capture checks only, not what "
                             f"{views[0]} shows; run them apart")
    if args.ops and (args.memory or getattr(args, "json", None) is not None):
        raise ZBCompileError("inspect: --memory / --json show the memory plan instead of the programs that --ops "
                             "prints as op lists; run them apart")
    steps = getattr(args, "replay_check", None)
    if steps is not None and steps < 3:   # (before the capture check runs and prints)
        raise ZBCompileError(f"inspect: --replay-check {steps}: give at least 3 steps (step 1 warms up, step 2 is "
                             "the reference, later steps are compared with it)")
    if args.split_points is not None and not all(args.split_points.split(",")):
        raise ZBCompileError(f"inspect: --split-points {args.split_points!r} holds an empty name: give module names "
                             "separated by commas, none empty (e.g. blocks.2,blocks.4)")
    if getattr(args, "device", None) is not None and getattr(args, "offload", None) is None:
        raise ZBCompileError(f"inspect: --device {args.device} is the time model of activation offload's plan, "
                             "which only --offload makes; add --offload BYTES|auto or drop --device")
    if getattr(args, "post_validate", False) and (args.memory or files):
        raise ZBCompileError("inspect: --post-validate with --memory: a post-validated step also holds the "
                             "snapshot of its optimistic update (the parameters and the optimizer's state) and the "
                             "last step's gradients, which depend on the optimizer; read pipe.memory_plan() after a "
                             "step(..., post_validate=True), or drop one of the flags")


def _check_outputs(args: argparse.Namespace) -> None:
    """ZBCompileError, before anything is compiled, for an output path that cannot be written (a directory, a
    missing or read-only folder, a name the filesystem refuses)."""
    for flag in ("svg", "json"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        try:
            why = ("it is a directory" if path.is_dir() else f"folder {str(path.parent)!r} does not exist"
                   if not path.parent.is_dir() else f"folder {str(path.parent)!r} is not writable"
                   if not os.access(path.parent, os.W_OK) else None)
        except OSError as exc:   # a name too long, a component that is a file
            why = exc.strerror or str(exc)
        if why:
            raise ZBCompileError(f"inspect: cannot write --{flag} {str(path)!r}: {why}; give a file path")


def _write(path: Path, text: str, flag: str) -> None:
    """`text` into `path`, or ZBCompileError naming the flag (what _check_outputs could not foresee)."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise ZBCompileError(f"inspect: cannot write --{flag} {str(path)!r}: {exc.strerror or exc}") from None


def _draw(schedule, path: Path) -> None:
    from zbcompile.simulate import simulate
    from zbcompile.timeline import svg_timeline

    _write(path, svg_timeline(simulate(schedule), title=f"{schedule.name}: p={schedule.num_ranks}, "
                                                       f"m={schedule.num_microbatches}"), "svg")
    print(f"# wrote {path}")
