"""Multi-process tests: every schedule under torch.distributed (gloo on 127.0.0.1), against eager.

One set of processes per pipeline size runs tests/distributed/workers/dist_worker.py, which loops over all
schedules (the tied-embedding GPT, a HuggingFace GPT2 for a few), the error cases, a meta-device model, and
finally a rank dying mid-step; each rank writes JSON that the tests below read.
"""

from __future__ import annotations

import os

import pytest

from support.launch import Launches, pipeline_fixtures

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dist_worker.py")
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv", "v-min", "v-half", "v-zb",
             "dualpipe", "dualpipev"]
TOL = 1e-5
_launch = Launches(WORKER, lambda pp: ["--hf"] if pp == 2 else [])

# `run_pp2`: the pp=2 launch, which alone also runs the HuggingFace model (to keep the suite short)
run, run_pp2 = pipeline_fixtures(_launch)


def _cases(results, prefix):
    for r, res in enumerate(results):
        for key, val in res.items():
            if key.startswith(prefix):
                yield r, key, val


def test_gpt_loss_grads_and_adamw_match_eager(run):
    _check_model(run, "gpt")


def test_huggingface_loss_grads_and_adamw_match_eager(run_pp2):
    _check_model(run_pp2, "hf")


def _check_model(run, model: str) -> None:
    pp, results = run
    seen = set()
    for r, key, val in _cases(results, model + "/"):
        assert "error" not in val, f"rank {r} {key}:\n{val['error']}"
        seen.add(key.split("/")[1])
        assert abs(val["loss"] - val["loss_ref"]) <= TOL * abs(val["loss_ref"]), (r, key, val)
        assert val["grad_err"] <= TOL, (r, key, val)
        assert val["param_err"] <= TOL, (r, key, val)
        assert all(0.0 <= b < 1.0 for b in val["bubble"]), (r, key, val)
        assert val["directed"], "P2P must use one process group per direction (NCCL streams)"
    assert seen == (set(SCHEDULES) if model == "gpt" else {"1f1b", "zbv", "dualpipev"})
    # every rank reports the same loss
    for key in {k for _, k, _ in _cases(results, model + "/")}:
        assert len({res[key]["loss"] for res in results}) == 1


def test_p2p_groups_threads_are_scheduled_below_the_main_thread(run):
    """The threads the two P2P groups started (gloo's loop threads: their spin on a held pair lock and their
    wake-up preemptions starved the main threads, see runtime/host.py) get the configured nice value and, in a
    one-thread rank, SCHED_BATCH; the main thread and the default group's threads, which zbcompile did not
    start, keep their scheduling."""
    from zbcompile.runtime.host import io_settings

    nice, mode = io_settings()
    pp, results = run
    for res in results:
        threads = res["threads"]
        base, main_batch = threads.pop(str(res["main_tid"]))   # the process's own nice value (0 unless run niced)
        assert not main_batch
        batch = mode == "1" or (mode == "auto" and res["one_thread"])
        nice_up = nice > base
        tuned = [t for t in threads.values() if t[0] > base or t[1]]
        if nice_up or batch:
            assert len(tuned) >= 2, threads   # a loop thread per P2P group, at least
            assert all(n == (nice if nice_up else base) and b == batch for n, b in tuned), threads
            assert [base, False] in threads.values(), threads   # the default group's threads
        else:   # turned off by the environment, or the process already runs below that nice value
            assert not tuned, threads


def test_errors(run):
    pp, results = run
    err = results[0]["errors"]
    assert f"pp={pp + 1}" in err["pp_mismatch"] and f"has {pp} ranks" in err["pp_mismatch"]
    assert "microbatches" in err["too_few"]
    assert "do not split into 4" in err["not_divisible"]
    assert "compiled for microbatches of shape [1, 16]" in err["wrong_shape"], err["wrong_shape"]


def test_meta_device_model_is_materialized_per_rank(run):
    pp, results = run
    owned = []
    for res in results:
        meta = res["meta"]
        assert meta["real"] and meta["others_meta"]
        assert meta["grad_err"] <= TOL
        assert meta["init_calls"] and set(meta["init_calls"]) == {"Linear"}
        # each rank reset only its own modules' parameters (no init_fn): the global generator is as before compile
        assert meta["rng_kept"], "compile left the global generator moved by this rank's share of the init"
        owned += meta["owned"]
    assert len(owned) == len(set(owned)) == 8  # 4 Linear layers, each on exactly one rank


def test_training_loop_matches_eager(run):
    """Train / clip / AdamW / evaluate(eval mode) twice on a float64 BatchNorm ConvNet under zbv, and a step and a
    clip of a vocabulary-parallel GPT under 1f1b, against eager on every rank (workers/dist_worker.py
    check_training_loop); an inf injected on the last rank only is seen by grads_finite() on every rank."""
    pp, results = run
    for r, res in enumerate(results):
        loop = res["training_loop"]
        assert "error" not in loop, f"rank {r}:\n{loop['error']}"
        for case in ("convnet", "vocab"):
            for a, b in zip(loop[case]["got"], loop[case]["want"], strict=True):
                assert abs(a - b) <= 1e-10 * abs(b), (r, case, loop[case])
        assert loop["convnet"]["param_err"] <= 1e-9, (r, loop["convnet"])
        assert loop["vocab"]["clean"] and not loop["vocab"]["finite_after_inf"], (r, loop["vocab"])


def test_dead_rank_makes_others_fail_fast(run):
    """Every other rank raises RuntimeFailure instead of hanging (a hang ends the launch at its timeout, failing
    the test), saying that the job must restart, and refuses a retry at once; how long that took is printed with
    a failure, not asserted (timings belong to benchmarks)."""
    pp, results = run
    for r in range(pp - 1):
        die = results[r]["die"]
        assert die["raised"], die
        assert "restart the job" in die["message"], die["message"]
        assert "this pipeline failed earlier" in die.get("again", ""), die
