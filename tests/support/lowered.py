"""The test GPT lowered for data-parallel replicas, once per process for both dp lowering files
(tests/lower/test_dp_reduce.py, tests/lower/test_dp_shard.py): every rank's program of a schedule."""

from __future__ import annotations

import functools

from support.models import gpt
from zbcompile.compiler import split_for
from zbcompile.passes.lower import DataParallel, lower_all
from zbcompile.passes.schedules import generate

# (schedule, pp); a "-vocab" suffix: the schedule with vocabulary parallelism
DP_CASES = [("1f1b", 2), ("zb-h1", 2), ("zbv", 2), ("interleaved-1f1b", 2), ("dualpipev", 2), ("zbv", 4),
            ("1f1b-vocab", 2)]


@functools.lru_cache(maxsize=None)
def lowered_gpt(name: str, pp: int, dp: DataParallel | None):
    """Every rank's program of `name` at `pp` ranks and 2 pp microbatches, lowered with `dp` (checked after every
    pass)."""
    vocab = name.endswith("-vocab")
    sched = generate(name.removesuffix("-vocab"), pp, 2 * pp, vocab=vocab)
    case = gpt(layers=4, batch=1)
    return lower_all(sched, split_for(case.model, case.loss_fn, case.example, sched), dp=dp, check_each_pass=True)
