"""Lowering: a Schedule and a StagedModel -> one straight-line program per rank.

`build_compute` is the front end (each rank's actions as RUN ops, the stage graphs they call copied into the
program's graph table); then the lowering is a list of named, pure passes over the tuple of all ranks'
programs (checked after each with `check_each_pass=True`, as the suite does, and always at the end). A
pass is either cross-rank (it reads every rank's program: messages must agree on both sides) or per-rank
(wrapped by `each`). Options are pass arguments (`lookahead=`).

    insert_p2p           receives posted early / waited late, batched sends, deterministic tags   (cross-rank)
    accumulate_grads     per-microbatch parameter grads -> one sum -> Parameter.grad               (per rank)
    reduce_shared_grads  sum grads of parameters several ranks hold (tied weights, DualPipe)       (cross-rank)
    (with dp, first: finish_grads_in_groups: each rank's trailing W's split into gradient groups)
    reduce_over_replicas with data parallelism (`Lowering.dp`): each bucket of final gradients     (per rank)
                         averaged over the replicas, posted where it is final, waited at the end
    gather_params        sharded data parallelism: the parameters all-gathered from the replicas'  (per rank)
                         shards before the actions that read them (passes/lower/dp_shard.py)
    insert_frees         explicit frees of activation memory after its last use                   (per rank)
    insert_stamps        per-action start / end timing points                                     (per rank)
    order_p2p_by_pair    receives from each peer re-posted in that peer's send order (NCCL)       (cross-rank)

With vocabulary parallelism the list starts with

    insert_collectives   the vocabulary layers' reduce / broadcast / all-gather around S, T, IF, IB (cross-rank)

then FINISHING, which depends on where every op finally sits:

    static_recv_buffers  receive buffers made once and reused, wherever nothing aliasing them outlives its use
    static_input_buffers the batch copied into input buffers made once, if nothing aliasing it outlives the step
    box_graphs           graphs in fx's boxed calling convention, ops called through their C++ entry points

or CAPTURE_FINISHING, for a step captured as one CUDA graph (passes/analysis/capture.py checks it):

    capture_ready        SET_GRAD accumulates into .grad instead of taking ownership; untimed waits
    ...                  then FINISHING

then, if asked (`lower_all(..., backend="inductor")`), per rank:

    compile_graphs       every stage graph run as the backend's compiled code (the emitter compiles the graphs
                         of the program it emits, once per distinct graph); gm stays the aten graph

then, if asked (`lower_all(..., offload=OffloadChoice(...))`), per rank:

    insert_offload       F's saved activations copied to a host pool after F and back before their B / W,
                         on the rank's copy stream; host slots coloured like the receive buffers

and `lower_all` checks all programs together:

    validate_programs    matched sends / receives, no deadlock
    check_pair_order     per pair (a -> b), b's receive order == a's send order
    check_streams        no deadlock on device streams either (NCCL: one stream per direction of a pair)

Later passes (vocab-parallel reductions, CUDA-graph finishing, overlapped F&B) slot into these lists;
`emit_fx` turns a finished program into the fx GraphModule that runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from zbcompile.errors import UsageError
from zbcompile.passes.lower.buffers import static_input_buffers, static_recv_buffers
from zbcompile.passes.lower.capture import capture_ready
from zbcompile.passes.lower.compiled import BACKENDS, check_backend, compile_graphs
from zbcompile.passes.lower.compute import accumulate_grads, build_compute
from zbcompile.passes.lower.dp_reduce import DataParallel, finish_grads_in_groups, reduce_over_replicas
from zbcompile.passes.lower.dp_shard import GATHER_POLICIES, gather_params
from zbcompile.passes.lower.emit import emit_fx
from zbcompile.passes.lower.frees import insert_frees, insert_stamps
from zbcompile.passes.lower.offload import OffloadChoice, insert_offload
from zbcompile.passes.lower.order_p2p import order_p2p_by_pair
from zbcompile.passes.lower.p2p import insert_p2p
from zbcompile.passes.lower.reduce import reduce_shared_grads
from zbcompile.passes.lower.streams import check_streams
from zbcompile.passes.lower.validate import check_pair_order, validate_programs
from zbcompile.passes.lower.variants import box_graphs
from zbcompile.passes.lower.vocab import insert_collectives
from zbcompile.ir.program import RankProgram
from zbcompile.ir.schedule import Schedule
from zbcompile.ir.stages import StagedModel

__all__ = ["LOWERING", "FINISHING", "CAPTURE_FINISHING", "Lowering", "pipeline", "capture_ready", "lower_all",
           "run_passes", "each",
           "emit_fx", "build_compute",
           "validate_programs", "check_pair_order", "order_p2p_by_pair", "check_streams", "RECV_LOOKAHEAD",
           "OffloadChoice", "insert_offload", "offload_programs", "compile_graphs", "BACKENDS", "DataParallel",
           "reduce_over_replicas", "gather_params", "GATHER_POLICIES"]

Programs = tuple[RankProgram, ...]
Pass = Callable[[Programs], Programs]

# A receive is posted this many compute actions before its consumer. Gloo (and NCCL for large messages)
# moves the data only once the receive is posted, so a late post puts a round trip on the critical path;
# on the near-zero-compute benchmark model, 3-4 instead of 1 cut the step time by 15-25% (1f1b, zb-h1,
# zbv at pp=2). The price is more receive buffers live at once (static_recv_buffers keeps that many more).
RECV_LOOKAHEAD = 4


def each(per_rank: Callable[[RankProgram], RankProgram]) -> Pass:
    """A per-rank pass lifted to all programs; keeps the pass's name."""
    @functools.wraps(per_rank)
    def run(programs: Sequence[RankProgram]) -> Programs:
        return tuple(per_rank(p) for p in programs)
    return run


LOWERING: tuple[Pass, ...] = (
    insert_p2p,
    each(accumulate_grads),
    reduce_shared_grads,
    each(insert_frees),
    each(insert_stamps),
    order_p2p_by_pair,
)

# per rank, after every op has its final place
FINISHING: tuple[Pass, ...] = (
    each(static_recv_buffers),
    each(static_input_buffers),
    each(box_graphs),
)

# FINISHING for CUDA-graph capture of the whole step: capture_ready must come before the buffer passes, which
# read which ops keep their inputs
CAPTURE_FINISHING: tuple[Pass, ...] = (each(capture_ready), *FINISHING)


def run_passes(programs: Sequence[RankProgram], passes: Sequence[Pass], *, check: bool = True) -> Programs:
    """Apply `passes` in order, recording each in `RankProgram.passes` and, with `check`, checking every
    program after each (values defined once, before use, not used after a free)."""
    programs = tuple(programs)
    for p in passes:
        name = _name(p)
        programs = tuple(q.replace(passes=q.passes + (name,)) for q in p(programs))
        if check:
            remote_ok = not any("insert_p2p" in q.passes for q in programs)
            for q in programs:
                q.check(name, remote_ok=remote_ok)
    return programs


@dataclasses.dataclass(frozen=True)
class Lowering:
    """What the lowering's pass list is built from: the compile options that shape the programs.

    recv_lookahead: insert_p2p's `lookahead` (how many RUN ops before its consumer a receive is posted).
    pair_order: post receives in each peer's send order (order_p2p_by_pair), which NCCL needs and gloo does
        not mind; on by default for every backend so that one schedule has one program. False leaves receives
        in the receiver's own order (tag-matching backends only).
    capture: finish for CUDA-graph capture of the whole step (CAPTURE_FINISHING instead of FINISHING).
    backend: compile every stage graph with this compiler (passes/lower/compiled.py: "inductor"), or None to
        run the aten graphs; anything else raises UsageError before any lowering.
    offload: activation offload (passes/lower/offload.py) after the finishing passes: one OffloadChoice for
        every rank, or one per rank (None: none on that rank); None offloads nothing.
    dp: with data-parallel replicas, how their gradient reductions are bucketed and placed
        (passes/lower/dp_reduce.py); None (a single replica) adds no op, so the programs are as without dp.
    """

    recv_lookahead: int = RECV_LOOKAHEAD
    pair_order: bool = True
    capture: bool = False
    backend: str | None = None
    offload: Sequence[OffloadChoice | None] | OffloadChoice | None = None
    dp: DataParallel | None = None

    def __post_init__(self) -> None:
        check_backend(self.backend)


def pipeline(lowering: Lowering, schedule: Schedule, staged: StagedModel, *, passes: Sequence[Pass] = LOWERING,
             finishing: Sequence[Pass] | None = None) -> tuple[Pass, ...]:
    """The named passes after build_compute, in order, for `lowering` (see the module docstring): with
    vocabulary parallelism insert_collectives first. `passes` / `finishing` replace the LOWERING / FINISHING
    lists (the tests run prefixes of them)."""
    if finishing is None:
        finishing = CAPTURE_FINISHING if lowering.capture else FINISHING
    bound = [functools.partial(p, lookahead=lowering.recv_lookahead) if p is insert_p2p else p for p in passes
             if lowering.pair_order or p is not order_p2p_by_pair]
    if lowering.dp is not None and reduce_shared_grads in bound:
        bound.insert(bound.index(reduce_shared_grads) + 1, reduce_over_replicas(lowering.dp))
        if lowering.dp.shard:
            bound.insert(bound.index(reduce_shared_grads) + 2, each(gather_params(lowering.dp)))
        if lowering.dp.overlap and lowering.dp.w_pieces > 1 and lowering.offload is None:
            # first: the p2p pass posts receives by the final order of the compute (offload reads each action's
            # one W, so the split W's are left out there)
            bound.insert(0, each(finish_grads_in_groups(lowering.dp)))
    before = [insert_collectives(schedule, staged.vocab)] if schedule.vocab_shards else []
    after = [each(compile_graphs(lowering.backend))] if lowering.backend is not None else []
    if lowering.offload is not None:
        after.append(_offload_pass(lowering.offload, schedule.num_ranks))
    return (*before, *bound, *finishing, *after)


def lower_all(schedule: Schedule, staged: StagedModel, lowering: Lowering | None = None, *,
              passes: Sequence[Pass] = LOWERING, finishing: Sequence[Pass] | None = None,
              check_each_pass: bool = False, **options) -> Programs:
    """Every rank's program, validated together: build_compute, then `pipeline(lowering)`.

    lowering: the Lowering record, or its fields as keywords (`lower_all(s, m, backend="inductor")`).
    check_each_pass: check every program after every pass, naming the pass that broke it (the suite does,
    for every schedule; it costs about a fifth of the lowering at pp=32). Without it each program is checked
    once at the end; the cross-rank validation always runs.
    """
    if lowering is None:
        lowering = Lowering(**options)
    elif options:
        raise UsageError(f"lower_all: give a Lowering or its fields as keywords, not both ({', '.join(options)})")
    # an overlapped F&B step (DualPipe) runs as its sub-actions one after the other until a pass fuses them
    schedule = schedule.flatten()
    programs = tuple(build_compute(schedule, staged, r) for r in range(schedule.num_ranks))
    if check_each_pass:
        for q in programs:
            q.check("build_compute", remote_ok=True)
    steps = pipeline(lowering, schedule, staged, passes=passes, finishing=finishing)
    programs = run_passes(programs, steps, check=check_each_pass)
    return _validated(programs, lowering.pair_order, checked=check_each_pass)


def offload_programs(programs: Sequence[RankProgram], offload: Sequence[OffloadChoice | None] | OffloadChoice,
                     *, pair_order: bool = True) -> Programs:
    """Finished programs with activation offload added (what `lower_all(..., offload=)` does last), validated
    again: for trying offload choices without lowering again."""
    return _validated(run_passes(programs, [_offload_pass(offload, len(programs))], check=False), pair_order)


def _validated(programs: Programs, pair_order: bool, checked: bool = False) -> Programs:
    """The checks every lowered set of programs passes before it is returned."""
    if not checked:
        for q in programs:
            q.check(q.passes[-1] if q.passes else "")
    validate_programs(programs)
    if pair_order:
        check_pair_order(programs)
        check_streams(programs)
    return programs


def _offload_pass(offload: Sequence[OffloadChoice | None] | OffloadChoice, ranks: int) -> Pass:
    """insert_offload with each rank's choice, as a pass over all programs (named insert_offload)."""
    choices = (offload,) * ranks if isinstance(offload, OffloadChoice) else tuple(offload)
    if len(choices) != ranks or not all(c is None or isinstance(c, OffloadChoice) for c in choices):
        raise UsageError(f"offload= takes one OffloadChoice for every rank or a sequence of {ranks} (one per rank, "
                         f"None for none), got {offload!r}")

    def run(programs: Sequence[RankProgram]) -> Programs:
        return tuple(p if c is None else insert_offload(p, c) for p, c in zip(programs, choices))
    run.__name__ = insert_offload.__name__
    return run


def _name(p) -> str:
    return getattr(p, "__name__", None) or getattr(getattr(p, "func", None), "__name__", repr(p))
