"""One rank of tests/distributed/test_checkpoint_faults.py (torchrun environment), in one of two modes.

    --crash POINT --victim R --dir D   train a step, save checkpoint A into D (complete), train a second step, then
                                       save B into D while rank R kills itself with SIGKILL at POINT (after
                                       writing `<out>/killed`); a run that gets through writes its JSON
    --verify D1,D2,...                 load each directory into a freshly compiled pipe: it must hold A or B
                                       (compared with eager training of the same model), and the next step's loss
                                       must equal eager's next step from there; then damaged copies of a good
                                       checkpoint, each refused by name with nothing changed on any rank

The model: an 8-layer MLP under 1f1b at pp=2, AdamW; batch k is drawn from seed k.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import signal
import time
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from support.launch import write_results  # noqa: E402
from support.models import eager_accumulated, mlp  # noqa: E402

import zbcompile.api as zb  # noqa: E402
from zbcompile import checkpoint  # noqa: E402
from zbcompile import checkpoint_files as files  # noqa: E402
from zbcompile.errors import CheckpointError  # noqa: E402

M = 4


def batch(k: int):
    g = torch.Generator().manual_seed(k)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def build():
    model, loss_fn, (x, y), _ = mlp(layers=8, batch=8)
    pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=M, loss_fn=loss_fn,
                      example=((x[:2],), (y[:2],)), timeout=60)
    return model, loss_fn, pipe, adamw(pipe.parameters())


def train(pipe, opt, k: int) -> float:
    loss = pipe.step(*batch(k))
    opt.step()
    opt.zero_grad()
    return loss


def die(out: str, point: str):
    Path(out, "killed").write_text(point)
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str, out: str) -> None:
    """Make this rank kill itself at `point` of the next save."""
    if point == "before_write":
        dcp.save = lambda *a, **k: die(out, point)
    elif point == "during_write":   # this rank's data files written, nothing else (no metadata)
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        real = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            fut = real(self, plan, planner)
            fut.wait()
            die(out, point)
        FileSystemWriter.write_data = write_data
    elif point == "after_write":    # every file written, before the checksums
        files.item_checksums = lambda *a, **k: die(out, point)
    elif point == "before_commit":  # checksummed, the manifest not yet written (rank 0 commits)
        files.write_manifest = lambda *a, **k: die(out, point)
    elif point == "between_renames":   # the old checkpoint moved aside, the new one not yet in its place
        def commit(stage, path):
            os.rename(path, files.previous(path))
            die(out, point)
        files.commit = commit
    elif point == "after_commit":   # committed, before the ranks' last exchange
        real_commit = files.commit

        def commit(stage, path):
            real_commit(stage, path)
            die(out, point)
        files.commit = commit
    else:
        raise SystemExit(f"unknown point {point}")


def crash(rank: int, out: str, point: str, victim: int, where: str) -> dict:
    _, _, pipe, opt = build()
    train(pipe, opt, 0)
    checkpoint.save(where, pipe, opt)            # A: complete
    train(pipe, opt, 1)
    if rank == victim:
        arm(point, out)
    try:
        checkpoint.save(where, pipe, opt)        # B: a rank dies somewhere inside
        return dict(saved=True)
    except CheckpointError as e:
        return dict(error=str(e))


def eager_states(model, loss_fn):
    """Eager training: the parameters after step 1 (A) and 2 (B), and the loss of the step after each."""
    ref = copy.deepcopy(model)
    opt = adamw(ref.parameters())
    out = {}
    for k, tag in ((0, "A"), (1, "B")):
        eager_accumulated(ref, loss_fn, *batch(k), M)
        opt.step()
        opt.zero_grad()
        nxt, nxt_opt = copy.deepcopy((ref, opt))   # one memo: the copy's optimizer steps the copy's parameters
        params = {n: p.detach().clone() for n, p in ref.named_parameters()}
        out[tag] = (params, eager_accumulated(nxt, loss_fn, *batch(k + 1), M))
    return out


def which(pipe, states) -> str:
    for tag, (params, _) in states.items():
        if all(torch.allclose(p, params[n], rtol=1e-6, atol=1e-7) for n, p in pipe.named_parameters()):
            return tag
    return "neither"


def damage(good: Path, tmp: Path) -> dict[str, Path]:
    """Copies of `good`, each damaged one way (rank 0 writes them)."""
    cases = {}
    for name in ("flipped", "truncated", "missing_file", "metadata", "manifest"):
        d = tmp / name
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(good, d)
        cases[name] = d
    data = sorted(f for f in os.listdir(good) if f.endswith(".distcp"))
    with open(cases["flipped"] / data[0], "r+b") as fh:   # 64 bytes in the middle of the first data file
        fh.seek(os.path.getsize(good / data[0]) // 2)
        chunk = fh.read(64)
        fh.seek(-len(chunk), 1)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    with open(cases["truncated"] / data[-1], "r+b") as fh:
        fh.truncate(os.path.getsize(good / data[-1]) // 2)
    os.remove(cases["missing_file"] / data[0])
    with open(cases["metadata"] / ".metadata", "r+b") as fh:
        fh.seek(10)
        fh.write(b"\x00" * 16)
    (cases["manifest"] / files.MANIFEST).write_text("{not json")
    return cases


def verify(rank: int, out: str, dirs: list[str]) -> dict:
    model, loss_fn, pipe, opt = build()
    states = eager_states(model, loss_fn)
    results = {}
    for d in dirs:
        try:
            checkpoint.load(d, pipe, opt)
            tag = which(pipe, states)
            k = {"A": 1, "B": 2}.get(tag)
            loss = pipe.step(*batch(k)) if k else None
            opt.zero_grad()
            results[d] = dict(holds=tag, loss=loss, want=states[tag][1] if k else None)
        except Exception:
            results[d] = dict(error=traceback.format_exc())
    good = Path(dirs[0])
    tmp = Path(out) / "damaged"
    cases = damage(good, tmp) if rank == 0 else {n: tmp / n for n in
                                                 ("flipped", "truncated", "missing_file", "metadata", "manifest")}
    dist.barrier()
    cases["mistyped"] = Path(str(good) + "-typo")
    for name, d in cases.items():
        before = [p.detach().clone() for p in pipe.parameters()]
        state = copy.deepcopy(opt.state_dict())
        try:
            checkpoint.load(d, pipe, opt)
            results[name] = dict(loaded=True)
        except CheckpointError as e:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
            same_opt = all(torch.equal(state["state"][i][k], v) for i, s in opt.state_dict()["state"].items()
                           for k, v in s.items() if isinstance(v, torch.Tensor))
            results[name] = dict(refused=str(e), unchanged=unchanged and same_opt)
    results["interrupted"] = save_interrupted(rank, Path(out) / "interrupted", pipe, opt)
    results["other_cwd"] = save_from_other_cwds(rank, Path(out), pipe, opt)
    return results


def save_interrupted(rank: int, path: Path, pipe, opt) -> dict:
    """Ctrl-C on rank 1 while DCP writes its files: DCP reports it as that rank's write failure, and save made it
    a CheckpointError on every rank, so a loop that catches those trained on after the user's Ctrl-C."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystemWriter.write_data

    def write_data(self, *args, **kwargs):
        if rank == 1:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    filesystem.FileSystemWriter.write_data = write_data
    try:
        checkpoint.save(path, pipe, opt)
        return dict(saved=True)
    except (CheckpointError, KeyboardInterrupt) as e:
        return dict(raised=type(e).__name__, message=str(e))
    finally:
        filesystem.FileSystemWriter.write_data = real


def save_from_other_cwds(rank: int, out: Path, pipe, opt) -> dict:
    """Each rank in a working directory of its own saves to the relative path "ckpt": the ranks write to two
    directories, and rank 1 cannot read back what rank 0 indexed. It failed alone while rank 0 waited in the
    save's exchange until the group's timeout."""
    home, mine = os.getcwd(), out / f"cwd{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    os.chdir(mine)
    start = time.perf_counter()
    try:
        checkpoint.save("ckpt", pipe, opt)
        return dict(saved=True)
    except CheckpointError as e:
        return dict(refused=str(e), seconds=time.perf_counter() - start)
    finally:
        os.chdir(home)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--crash")
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--dir")
    ap.add_argument("--verify")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.crash:
        results = crash(rank, args.out, args.crash, args.victim, args.dir)
    else:
        results = verify(rank, args.out, args.verify.split(","))
    write_results(args.out, rank, results)
    os._exit(0)


if __name__ == "__main__":
    main()
