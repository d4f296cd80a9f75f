"""One rank of tests/distributed/test_dist_user_models.py (torchrun environment): `zbcompile.compile` with the automatic
split on the user-model classes of tests/split/test_user_models.py, one 1F1B step each against eager; writes
`<out>/rank<r>.json`."""

from __future__ import annotations

import copy
import traceback

import torch

torch.set_num_threads(1)

from support.launch import worker_main  # noqa: E402
from support.models import dict_lm, marked_mlp, rope_net  # noqa: E402

import zbcompile.api as zb  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def check(case, m: int) -> dict:
    """Compile `case` for 1F1B with m microbatches (the example: one microbatch), step once on the whole
    batch; loss, the worst gradient error over this rank's parameters, and which state this rank holds."""
    model, loss_fn, (x, y), _ = case
    ref = copy.deepcopy(model)
    loss_ref = loss_fn(ref(x), y)
    loss_ref.backward()
    pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=m, loss_fn=loss_fn,
                      example=((x[: x.shape[0] // m],), (y[: y.shape[0] // m],)))
    loss = pipe.step(x, y)
    grads = dict(ref.named_parameters())
    errs = [(rel(p.grad, grads[n].grad), n) for n, p in pipe.named_parameters() if grads[n].grad is not None]
    ungraded = [n for n, p in pipe.named_parameters() if grads[n].grad is None and p.grad is not None]
    real = sorted(n for n, t in pipe.model.state_dict().items() if not t.is_meta)
    return dict(loss=loss, loss_ref=loss_ref.item(), grad_err=max(errs)[0], where=max(errs)[1],
                ungraded_with_grad=ungraded, split_points=list(pipe.staged.meta["split_points"]), real=real)


def run(rank: int, pp: int, out: str) -> dict:
    m = 2 * pp
    results = {}
    for tag, case in (("dict", dict_lm(layers=2 * pp, batch=m)), ("marked", marked_mlp(marks=(1,), batch=m)),
                      ("unused", rope_net(batch=m))):
        try:
            results[tag] = check(case, m)
        except Exception:
            results[tag] = dict(error=traceback.format_exc())
    return results


if __name__ == "__main__":
    worker_main(run)
