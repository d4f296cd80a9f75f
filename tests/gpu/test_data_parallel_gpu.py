"""The data-parallel ops on a real GPU (marked gpu; skipped where torch sees no CUDA device, never faked).

One GPU holds one replica, so the programs lowered for two replicas run as the only one, on CUDA: the all-reduce
buckets, the reduce-scatter layout, the parameter gathers and their copies out, and the microbatch policy's
backward that redoes the weights' views, all on device tensors, give the plain program's gradients (to the
last bits the atomics of CUDA's backward kernels leave free).
Two replicas over NCCL need two GPUs (tests/distributed/test_data_parallel.py runs them on gloo).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from support.models import gpt  # noqa: E402
from support.threaded import run_threaded  # noqa: E402
from zbcompile.compiler import split_for  # noqa: E402
from zbcompile.passes.schedules import generate  # noqa: E402


@pytest.mark.parametrize("options", [dict(), dict(dp_shard=True), dict(dp_shard=True, dp_gather="microbatch")],
                         ids=["replicated", "sharded-step", "sharded-microbatch"])
def test_dp_programs_as_one_replica_on_cuda_give_the_plain_gradients(options):
    case = gpt(layers=4, batch=4, device="cuda")
    sched = generate("zbv", 2, 4)
    example = tuple(t.cuda() for t in case.example)
    staged = split_for(case.model, case.loss_fn, example, sched)
    batch = tuple(torch.cat([t] * 4) for t in example)
    _, plain, _ = run_threaded(case.model, staged, sched, batch, device="cuda")
    _, dp, _ = run_threaded(case.model, staged, sched, batch, device="cuda", replicas=2, **options)
    for a, b in zip(plain, dp):
        ga = {n: p.grad for n, p in a.named_parameters() if p.grad is not None}
        gb = {n: p.grad for n, p in b.named_parameters() if p.grad is not None}
        assert ga.keys() == gb.keys(), set(ga) ^ set(gb)
        for n in ga:   # not bitwise as on CPU: CUDA's embedding and attention backward add with atomics
            torch.testing.assert_close(gb[n], ga[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
        assert all(g.is_cuda for g in gb.values())
