"""`zbcompile.compile` as users call it, multi-process (gloo on 127.0.0.1), against eager microbatch training.

tests/distributed/test_dist.py checks every schedule from a plain split (`from_staged`); this runs `compile` itself: the
automatic split for several placements, the decorator, a subgroup and a 1-D DeviceMesh, interleaving with 3
chunks, explicit split points, zb-auto with measured-style costs under a memory limit, microbatch counts that
do not divide by pp and the fewest a schedule takes, BatchNorm buffers, tied copies that start different,
and a peer that raises (pp=2) or stalls (pp=4). One launch per pp runs tests/distributed/workers/compile_worker.py.
"""

from __future__ import annotations

import math
import os

import pytest

from support.launch import Launches, pipeline_fixtures

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "compile_worker.py")
TOL = 1e-5
# the last case makes the last rank raise (pp=2) or stall (pp=4): one failure per launch, since a broken step
# leaves messages in flight that a later pipeline on the same groups could receive
_launch = Launches(WORKER, lambda pp: ["--failure", "raise" if pp == 2 else "hang"])

# `run_pp2`: the pp=2 launch, which alone runs every path (see CASES)
run, run_pp2 = pipeline_fixtures(_launch)


def _case(results, key):
    for r, res in enumerate(results):
        assert key in res, f"rank {r} has no result for {key!r}"
        assert "error" not in res[key], f"rank {r} {key}:\n{res[key]['error']}"
    return [res[key] for res in results]


def _matches_eager(vals, key):
    for r, v in enumerate(vals):
        assert abs(v["loss"] - v["loss_ref"]) <= TOL * abs(v["loss_ref"]), (key, r, v["loss"], v["loss_ref"])
        assert v["grad_err"] <= TOL, (key, r, v["grad_err"])
    assert len({v["loss"] for v in vals}) == 1, (key, "ranks report different losses")


# what each launch runs (compile_worker.main): pp=2 every path; pp=4, four processes on this 2-core machine
# each tracing and splitting, the paths whose placement changes with pp
CASES = {2: ["auto/zbv", "auto/zb-h1", "auto/dualpipev", "auto/v-min", "chunks3", "split_points", "zb-auto",
             "subgroup", "mesh", "bn/1f1b", "bn/zbv"],
         4: ["auto/zbv", "auto/dualpipev", "chunks3", "bn/1f1b", "bn/zbv"]}


def test_compile_trains_like_eager(run):
    """Loss and every gradient (and BatchNorm's running statistics) equal eager microbatch training."""
    pp, results = run
    for key in CASES[pp]:
        vals = _case(results, key)
        _matches_eager(vals, key)
        assert all(v["buffer_err"] <= TOL for v in vals), (key, [v["buffer_err"] for v in vals])


def test_every_parameter_and_buffer_is_held(run):
    """After compile, every parameter and buffer of the user's model is real on some rank, and one that several
    ranks hold is a tied weight or a mirrored stage's (DualPipe), nothing else."""
    pp, results = run
    keys = [k for k in results[0] if "all_params" in results[0][k]]
    assert set(CASES[pp]) <= set(keys)
    for k in keys:
        vals = _case(results, k)
        params = [p for v in vals for p in v["params"]]
        buffers = [b for v in vals for b in v["buffers"]]
        canonical = {g[0] for g in vals[0]["tied"]}
        aliases = {a for g in vals[0]["tied"] for a in g[1:]}
        assert set(params) == set(vals[0]["all_params"]) - aliases, (k, set(vals[0]["all_params"]) ^ set(params))
        assert set(buffers) == set(vals[0]["all_buffers"]), k
        shared = {p for p in params if params.count(p) > 1}
        assert shared <= canonical or "dualpipe" in vals[0]["schedule"], (k, shared)
        assert len(buffers) == len(set(buffers)) or "dualpipe" in vals[0]["schedule"], k


def test_microbatch_counts_users_pick(run):
    """Counts that do not divide by pp, and the fewest each schedule takes."""
    pp, results = run
    keys = [k for k in results[0] if k.startswith("m/")]
    assert {k.split("/")[2] for k in keys} >= ({str(2 * pp + 1), "1", str(pp + 1)} if pp == 2 else {"1"})
    for k in keys:
        _matches_eager(_case(results, k), k)


def test_decorator_builds_pipeline_modules(run):
    pp, results = run
    vals = _case(results, "decorator")
    assert all(v["kind"] == "PipelineModule" and v["instance"] for v in vals)   # isinstance(pipe, Net)
    _matches_eager(vals, "decorator")


def test_tied_copies_that_start_different_are_made_equal(run):
    pp, results = run
    vals = _case(results, "different_starts")
    assert all(v["copies_equal"] for v in vals)
    assert "wte.weight" in vals[0]["shared"]   # the tied embedding / head: first and last stage
    _matches_eager(vals, "different_starts")


def test_a_rank_slower_to_compile_than_the_timeout_is_waited_for_at_compile(run_pp2):
    """Inductor builds each rank's own stage graphs, so ranks left compile up to a minute apart, and the first
    step counted that against `timeout` (RuntimeFailure: "peer dead or stalled"). compile now ends together on
    every rank: rank 1, 4 s late with a timeout of 2 s, steps with rank 0, also on a group whose own timeout is
    2 s (as the default group compile makes has), which ended compile's wait at 2 s on gloo."""
    vals = _case(run_pp2[1], "slow_compile")
    assert len({v["loss"] for v in vals}) == 1 and all(math.isfinite(v["loss"]) for v in vals), vals


def test_a_failing_peer_is_named_within_the_timeout(run):
    """pp=2: the last rank's B graph raises; pp=4: it stalls past the timeout (3 s). Its neighbour raises
    RuntimeFailure naming it; every other rank raises RuntimeFailure too, none hangs."""
    pp, results = run
    victim = pp - 1
    vals = [res["failure"] for res in results]
    if pp == 2:
        assert vals[victim]["raised"] == "ValueError", vals[victim]
    for r, v in enumerate(vals):
        if r == victim:
            continue
        assert v["raised"] == "RuntimeFailure", (r, v)
    neighbour = vals[victim - 1]["message"]
    assert f"rank {victim - 1}:" in neighbour and f"rank {victim}" in neighbour, neighbour


def test_dropout_draws_fresh_masks_and_a_seed_repeats_the_run(run_pp2):
    """Dropout in train mode under zbv: on, fresh masks every step, and a fixed seed repeats the losses."""
    pp, results = run_pp2
    for r, v in enumerate(_case(results, "dropout")):
        assert v["first"] == v["again"], (r, v)              # a fixed seed repeats the losses exactly
        assert v["first"] != v["other_seed"], (r, v)         # another seed, other masks
        assert v["first"][0] != v["none"][0], (r, v)         # dropout is on in train mode
        assert v["first"][0] != v["first"][1], (r, v)        # fresh masks from one step to the next


def test_a_group_per_trial_trains_as_eager_and_keeps_no_process_groups_of_the_trials_before(run_pp2):
    """Three trials on a new group each, destroyed after its step (a hyperparameter search): each trains as
    eager, and after each trial the process holds as many process groups as after the first. compile's own
    groups over the pipeline's ranks (two for P2P, one for its last wait) were kept per pipeline group: three
    more groups, 15 open files and 9 threads, every trial."""
    pp, results = run_pp2
    for r, v in enumerate(_case(results, "trials")):
        assert max(v["errs"]) <= TOL, (r, v["errs"])
        assert len(set(v["held"])) == 1, (r, v["held"])
