"""backend="inductor" multi-process: `zbcompile.compile(..., backend="inductor")` as users call it under
torch.distributed (gloo, 2 ranks; tests/distributed/workers/inductor_worker.py) trains like eager microbatch
training, every rank reporting the same loss, and an unknown backend is a UsageError on every rank.

Tolerance 1e-4 relative, as in tests/runtime/test_inductor.py (inductor reassociates float32 sums).
"""

from __future__ import annotations

import os

import pytest

from support.launch import Launches

TOL = 1e-4

_launch = Launches(os.path.join(os.path.dirname(__file__), "workers", "inductor_worker.py"))


@pytest.mark.dist
@pytest.mark.slow
def test_compile_with_inductor_multi_process(tmp_path_factory):
    _, results = _launch(2, tmp_path_factory)
    for name in ("zbv", "1f1b"):
        vals = [res[name] for res in results]
        for r, v in enumerate(vals):
            assert "error" not in v, f"rank {r} {name}:\n{v['error']}"
            assert abs(v["loss"] - v["loss_ref"]) <= TOL * abs(v["loss_ref"]), (name, r, v["loss"], v["loss_ref"])
            assert v["grad_err"] <= TOL, (name, r, v["grad_err"])
        assert len({v["loss"] for v in vals}) == 1, (name, "ranks report different losses")
    for r, res in enumerate(results):
        bad = res["bad_backend"]
        assert "UsageError" in bad.get("type", ()) and "'inductor'" in bad["message"], (r, bad)
