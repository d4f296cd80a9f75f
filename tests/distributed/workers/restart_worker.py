"""One rank of tests/distributed/test_launch.py's restart test (torchrun --max-restarts, cold ranks): a user's own
loop where zb.compile starts the process group from torchrun's environment, saving a zbcompile.checkpoint every
2 steps; on the first attempt rank 1 kills itself after step 3. The restarted attempt resumes from the step-2
checkpoint and trains to step 4. Writes `<out>/rank<r>.json`: the attempt that finished, and its parameters."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

torch.set_num_threads(1)

import zbcompile as zb  # noqa: E402
from zbcompile import checkpoint  # noqa: E402

STEPS = 4


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, dtype=torch.float64) for _ in range(4)])
    return model, torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def main(out: str, saved: str) -> None:
    attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ["RANK"])
    model, x, y = model_and_batch()
    pipe = zb.compile(model, schedule="1f1b", microbatches=4, loss_fn=loss_fn, example=((x[:2],), (y[:2],)),
                      timeout=20)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    done = int(checkpoint.load(saved, pipe, opt)["step"]) if checkpoint.exists(saved) else 0
    for step in range(done + 1, STEPS + 1):
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            checkpoint.save(saved, pipe, opt, extra={"step": step})
        if step == 3 and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)   # a rank dies between two steps
    params = {n: p.detach().tolist() for n, p in pipe.named_parameters()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"attempt": attempt, "resumed_after": done, "params": params}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
