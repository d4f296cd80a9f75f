"""One rank of tests/distributed/test_checkpoint.py, started with the torchrun environment (RANK, WORLD_SIZE, MASTER_*).

--save: train the tied-embedding GPT and a BatchNorm ConvNet two AdamW steps with zbv, save each (torch's own
calls for the GPT, zbcompile.checkpoint.save for the ConvNet), then load both into freshly initialized
pipelines of the same size with 1f1b and other cuts, and try a checkpoint of another model.
--load: load both checkpoints at this launch's pp (torch's own calls for the GPT).
Every load is followed by steps 3 and 4 (step 4's loss shows the optimizer state resumed, not only the
parameters); each rank writes JSON for the test to compare against an uninterrupted eager run.
"""

from __future__ import annotations

import argparse
import os
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

torch.set_num_threads(1)

from support import ckpt as common  # noqa: E402
from support.launch import write_results  # noqa: E402

import zbcompile as zb  # noqa: E402
from zbcompile import checkpoint  # noqa: E402
from zbcompile.errors import CheckpointError  # noqa: E402

OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def pipeline(name: str, schedule: str, split_points=None, perturb: bool = False):
    """A compiled pipeline of model `name` and its AdamW; perturbed: other initial weights and buffers, so that
    only a load can bring back the saved run."""
    model, loss_fn, batches, m = common.case(name)
    if perturb:
        common.perturb(model)
    pipe = zb.compile(model, schedule=schedule, microbatches=m, loss_fn=loss_fn, split_points=split_points,
                      example=common.microbatch(batches[0], m), timeout=60.0)
    return pipe, common.adamw(pipe.parameters())


def train(pipe, opt, batches) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(pipe.step(*batch))
        opt.step()
        opt.zero_grad()
    return losses


def resumed(pipe, opt, name: str) -> dict:
    """Steps 3 and 4 after a load: their losses and the buffers this rank holds afterwards."""
    _, _, batches, _ = common.case(name)
    losses = train(pipe, opt, batches[2:])
    return dict(losses=losses, buffers={k: b.tolist() for k, b in pipe.named_buffers()})


def torch_save(path, pipe, opt) -> None:
    """What a user writes with torch's helpers alone."""
    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def torch_load(path, pipe, opt) -> None:
    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTS)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(pipe, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTS)


def save_phase(ckpt: str, results: dict) -> None:
    for name, save in (("gpt", torch_save), ("cnn", checkpoint.save)):
        pipe, opt = pipeline(name, "zbv")
        _, _, batches, _ = common.case(name)
        train(pipe, opt, batches[:2])
        save(os.path.join(ckpt, name), pipe, opt)
        results[f"{name}/uninterrupted"] = dict(losses=train(pipe, opt, batches[2:]))
    cuts = {"gpt": ["blocks.2"], "cnn": ["features.1"]}
    for name in ("gpt", "cnn"):
        pipe, opt = pipeline(name, "1f1b", split_points=cuts[name], perturb=True)
        checkpoint.load(os.path.join(ckpt, name), pipe, opt)
        results[f"{name}/1f1b"] = resumed(pipe, opt, name)
    results["refused"] = refused(ckpt)


def load_phase(ckpt: str, results: dict) -> None:
    for name, load in (("gpt", torch_load), ("cnn", checkpoint.load)):
        pipe, opt = pipeline(name, "1f1b", perturb=True)
        load(os.path.join(ckpt, name), pipe, opt)
        results[f"{name}/pp{pipe.schedule.num_ranks}"] = resumed(pipe, opt, name)


def refused(ckpt: str) -> dict:
    """The GPT checkpoint loaded into a wider, deeper GPT (other shapes, missing blocks) on every rank, then a
    state dict with one wrong shape given to load_state_dict: both raise, and nothing has changed."""
    pipe, opt = pipeline("gpt_other", "1f1b")
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    out = {}
    try:
        checkpoint.load(os.path.join(ckpt, "gpt"), pipe, opt)
        out["load"] = "no error"
    except CheckpointError as e:
        out["load"] = str(e)
    bad = {k: v.clone() for k, v in pipe.state_dict().items()}
    first = next(iter(bad))
    bad[first] = torch.zeros(3)
    for v in bad.values():
        v.add_(1.0)
    try:
        pipe.load_state_dict(bad)
        out["state_dict"] = "no error"
    except CheckpointError as e:
        out["state_dict"] = str(e)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
    out["optimizer_untouched"] = not opt.state
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    results: dict = {}
    try:
        (save_phase if args.save else load_phase)(args.ckpt, results)
    except Exception:
        results["error"] = traceback.format_exc()
    write_results(args.out, rank, results)
    if "error" not in results:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
