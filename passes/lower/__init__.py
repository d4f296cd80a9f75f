"""Lowering: a Schedule and a StagedModel -> one straight-line program per rank.

The lowering is the list of named, pure passes below, each `RankProgram -> RankProgram`, checked after
every pass; `emit_fx` then prints the result as an fx GraphModule. Later passes (activation offload /
reload, vocab-parallel reductions, static buffers for CUDA graphs, overlapped F&B) slot into LOWERING.

    build_compute        RUN op per action; loss sum; buffer copies
    insert_p2p           receives posted early / waited late, batched sends, deterministic tags
    accumulate_grads     per-microbatch parameter grads -> one sum -> Parameter.grad
    reduce_shared_grads  sum grads of parameters several ranks hold (tied weights, DualPipe mirrors)
    insert_frees         explicit frees of activation memory after its last use
    insert_stamps        per-action start / end timing points

`lower_all` also runs `validate_programs` across ranks (matched sends / receives, no deadlock).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import fx

from zbcompile.program import RankProgram
from zbcompile.passes.lower.compute import accumulate_grads, build_compute
from zbcompile.passes.lower.emit import emit_fx
from zbcompile.passes.lower.frees import insert_frees, insert_stamps
from zbcompile.passes.lower.p2p import insert_p2p
from zbcompile.passes.lower.reduce import reduce_shared_grads
from zbcompile.passes.lower.validate import validate_programs
from zbcompile.schedule import Schedule
from zbcompile.stages import StagedModel

__all__ = ["LOWERING", "lower", "lower_all", "emit_fx", "validate_programs", "empty_program"]

Pass = Callable[[RankProgram], RankProgram]

LOWERING: tuple[Pass, ...] = (
    build_compute,
    insert_p2p,
    accumulate_grads,
    reduce_shared_grads,
    insert_frees,
    insert_stamps,
)


def empty_program(schedule: Schedule, staged: StagedModel, rank: int, *, recv_lookahead: int = 1) -> RankProgram:
    return RankProgram(schedule, staged, rank, inputs=(), ops=(), recv_lookahead=recv_lookahead)


def lower(schedule: Schedule, staged: StagedModel, rank: int, *, passes: Sequence[Pass] = LOWERING,
          recv_lookahead: int = 1) -> RankProgram:
    """Run `passes` for one rank, checking the program after each."""
    program = empty_program(schedule, staged, rank, recv_lookahead=recv_lookahead)
    for p in passes:
        program = p(program)
        program = program.replace(passes=program.passes + (p.__name__,)).check(p.__name__)
    return program


def lower_all(schedule: Schedule, staged: StagedModel, *, passes: Sequence[Pass] = LOWERING,
              recv_lookahead: int = 1) -> tuple[RankProgram, ...]:
    """Every rank's program, validated together."""
    programs = tuple(lower(schedule, staged, r, passes=passes, recv_lookahead=recv_lookahead)
                     for r in range(schedule.num_ranks))
    validate_programs(programs)
    return programs


def lower_to_fx(schedule: Schedule, staged: StagedModel, rank: int, **kw) -> fx.GraphModule:
    return emit_fx(lower(schedule, staged, rank, **kw))
