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

`lower_all` then runs the cross-rank pass over all ranks' programs and checks them together:

    order_p2p_by_pair    receives from each peer re-posted in that peer's send order (NCCL ignores tags)

and the per-rank passes that need the final op order (FINISHING):

    static_recv_buffers  receive buffers made once and reused, wherever nothing aliasing them outlives its use
    static_input_buffers the batch copied into input buffers made once, if nothing aliasing it outlives the step

then checks all programs together:

    validate_programs    matched sends / receives, no deadlock
    check_pair_order     per pair (a -> b), b's receive order == a's send order
    check_streams        no deadlock on device streams either (NCCL: one stream per direction of a pair)
"""

from __future__ import annotations

from typing import Callable, Sequence


from zbcompile.program import RankProgram
from zbcompile.passes.lower.buffers import static_input_buffers, static_recv_buffers
from zbcompile.passes.lower.compute import accumulate_grads, build_compute
from zbcompile.passes.lower.emit import emit_fx
from zbcompile.passes.lower.frees import insert_frees, insert_stamps
from zbcompile.passes.lower.order_p2p import order_p2p_by_pair
from zbcompile.passes.lower.p2p import insert_p2p
from zbcompile.passes.lower.reduce import reduce_shared_grads
from zbcompile.passes.lower.streams import check_streams
from zbcompile.passes.lower.validate import check_pair_order, validate_programs
from zbcompile.schedule import Schedule
from zbcompile.stages import StagedModel

__all__ = ["LOWERING", "FINISHING", "lower", "lower_all", "emit_fx", "validate_programs", "check_pair_order",
           "order_p2p_by_pair", "check_streams", "empty_program", "RECV_LOOKAHEAD"]

Pass = Callable[[RankProgram], RankProgram]

# A receive is posted this many compute actions before its consumer. Gloo (and NCCL for large messages)
# moves the data only once the receive is posted, so a late post puts a round trip on the critical path;
# on the near-zero-compute benchmark model, 3-4 instead of 1 cut the step time by 15-25% (1f1b, zb-h1,
# zbv at pp=2). The price is more receive buffers live at once (static_recv_buffers keeps that many more).
RECV_LOOKAHEAD = 4

LOWERING: tuple[Pass, ...] = (
    build_compute,
    insert_p2p,
    accumulate_grads,
    reduce_shared_grads,
    insert_frees,
    insert_stamps,
)

# run on each rank's program after the cross-rank reordering: they depend on where every op finally sits
FINISHING: tuple[Pass, ...] = (
    static_recv_buffers,
    static_input_buffers,
)


def empty_program(schedule: Schedule, staged: StagedModel, rank: int, *,
                  recv_lookahead: int = RECV_LOOKAHEAD) -> RankProgram:
    return RankProgram(schedule, staged, rank, inputs=(), ops=(), recv_lookahead=recv_lookahead)


def lower(schedule: Schedule, staged: StagedModel, rank: int, *, passes: Sequence[Pass] = LOWERING,
          recv_lookahead: int = RECV_LOOKAHEAD) -> RankProgram:
    """Run `passes` for one rank, checking the program after each."""
    program = empty_program(schedule, staged, rank, recv_lookahead=recv_lookahead)
    for p in passes:
        program = _apply(p, program)
    return program


def _apply(p: Pass, program: RankProgram) -> RankProgram:
    return p(program).replace(passes=program.passes + (p.__name__,)).check(p.__name__)


def lower_all(schedule: Schedule, staged: StagedModel, *, passes: Sequence[Pass] = LOWERING,
              recv_lookahead: int = RECV_LOOKAHEAD, pair_order: bool = True,
              finishing: Sequence[Pass] = FINISHING) -> tuple[RankProgram, ...]:
    """Every rank's program, validated together.

    pair_order: post receives in each peer's send order (order_p2p_by_pair), which NCCL needs and gloo
    does not mind; on by default for every backend so that one schedule has one program. False leaves
    receives in the receiver's own order (tag-matching backends only).
    """
    programs = tuple(lower(schedule, staged, r, passes=passes, recv_lookahead=recv_lookahead)
                     for r in range(schedule.num_ranks))
    if pair_order:
        name = order_p2p_by_pair.__name__
        programs = tuple(p.replace(passes=p.passes + (name,)).check(name) for p in order_p2p_by_pair(programs))
    for f in finishing:
        programs = tuple(_apply(f, p) for p in programs)
    validate_programs(programs)
    if pair_order:
        check_pair_order(programs)
        check_streams(programs)
    return programs
