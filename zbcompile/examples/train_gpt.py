"""Train a small character-level GPT with a pipeline schedule: zbcompile's main job.

    torchrun --nproc-per-node 2 -m zbcompile.examples.train_gpt --schedule zb-h1

Every rank reads the same batches from the tiny corpus shipped next to this file (bytes as tokens), so
`model.step(x, y)` sees the whole batch everywhere; the compiled program slices it into microbatches and
feeds each stage the slices it reads. Rank 0 prints one line per step: loss, tokens/s and the bubble each
rank measured, with a progress bar, then a summary table.

`--save DIR` writes the model and AdamW state after the last step (zbcompile.checkpoint: the user's parameter
names, any layout can load it, crash-safe) with the number of steps done, and every K steps with
`--save-every K`; `--resume DIR` loads them before the first step and goes on with the next batch of the data
stream, so a resumed run continues the uninterrupted one exactly, at any pp, schedule or split. `--resume auto`
resumes from the --save directory where a checkpoint is there (else starts afresh), and --steps is then the
job's total: under `torchrun --max-restarts N` a job whose rank died restarts from its newest complete
checkpoint by itself and ends where the uninterrupted job would have (a job restarted after its last save, a
rank having died in the teardown, finds nothing left to train and ends with 0).
A failed step or save (a peer died) leaves the process group unusable: every rank says so and exits with 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

import zbcompile as zb
from zbcompile import checkpoint
from zbcompile.checkpoint_files import target_problem
from zbcompile.distributed import init_from_environment
from zbcompile.errors import CheckpointError, RuntimeFailure
from zbcompile.examples.gpt import GPT, GPTConfig, loss_fn

CORPUS = Path(__file__).with_name("corpus.txt")


def corpus_tokens() -> torch.Tensor:
    """The shipped corpus as byte tokens (vocabulary 256)."""
    return torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)


def batches(tokens: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless (inputs, next-token targets) batches of random windows; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        window = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])  # [B, T+1]
        yield window[:, :-1], window[:, 1:]


def tiny():
    """A small GPT, its loss and one example microbatch: the factory `zbcompile inspect` can load."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=32, d=64, heads=4, layers=4)
    x, y = next(batches(corpus_tokens(), 2, cfg.seq, seed=0))
    return GPT(cfg), loss_fn, (x, y)


def uniform():
    """A GPT of 16 equal blocks (little besides them): the model whose memory plans the README compares across
    schedules (`zbcompile inspect zbcompile.examples.train_gpt:uniform --pp 4 --schedule v-half --memory`)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d=64, heads=4, layers=16)
    x, y = next(batches(corpus_tokens() % cfg.vocab, 2, cfg.seq, seed=0))
    return GPT(cfg), loss_fn, (x, y)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])   # None under python -OO
    p.add_argument("--schedule", default="zb-h1")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunks", type=int, default=None, help="stages per rank for interleaved-1f1b")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-grad", type=float, default=None, metavar="MAX_NORM",
                   help="clip the gradient norm over the whole pipeline to this (steps whose gradients hold an "
                        "inf or NaN are skipped on every rank)")
    p.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="every K steps, the eval-mode loss of the next batch (a forward-only step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, default=None, help="write the last step's timeline as a Chrome trace")
    p.add_argument("--save", type=Path, default=None, help="write a checkpoint into this directory at the end")
    p.add_argument("--save-every", type=int, default=0, metavar="K", help="with --save: also every K steps")
    p.add_argument("--resume", default=None, metavar="DIR|auto",
                   help="start from the checkpoint in DIR and train --steps more; auto: from --save's directory "
                        "where one is there, --steps in all")
    p.add_argument("--metrics", type=Path, default=None, help="rank 0 appends a JSON line per step (step, loss)")
    p.add_argument("--kill-rank-at", type=_kill_at, action="append", default=None, metavar="RANK:STEP[:ATTEMPT]",
                   help="to try restarts: that rank kills itself (SIGKILL) after that step (and its save), in the "
                        "job's attempt ATTEMPT only (torchrun's TORCHELASTIC_RESTART_COUNT; default 0, the first); "
                        "may be repeated")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="shard the embedding and the output layer over every rank (vocabulary parallelism)")
    p.add_argument("--offload", default=None, metavar="BYTES|auto",
                   help="activation offload: a per-rank device-memory budget in bytes, or 'auto'")
    p.add_argument("--memory", action="store_true", help="print every rank's memory plan before training")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give the number of steps to train (at least 1)")
    if (args.resume == "auto" or args.save_every) and args.save is None:
        p.error("--resume auto and --save-every need --save DIR (where the checkpoints go)")
    for flag in ("microbatches", "microbatch_size", "seq", "dim", "heads", "layers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a positive number")
    corpus = len(corpus_tokens())
    if args.seq > corpus - 2:
        p.error(f"--seq {args.seq}: the shipped corpus has {corpus} tokens, so a window (seq + 1 tokens, "
                f"at random starts) is at most {corpus - 2} long")
    if args.clip_grad is not None and not args.clip_grad > 0:   # (a negative norm would flip the gradients)
        p.error(f"--clip-grad {args.clip_grad}: give a positive gradient norm to clip to")
    if args.lr < 0 or args.eval_every < 0 or args.save_every < 0:
        bad = next(f for f in ("lr", "eval_every", "save_every") if getattr(args, f) < 0)
        p.error(f"--{bad.replace('_', '-')} {getattr(args, bad)}: give a value >= 0")
    if args.save is not None and (problem := target_problem(args.save)) is not None:
        p.error(f"--save: {problem}")   # found before training, not at its first save after every step
    world = int(os.environ.get("WORLD_SIZE", 0))
    for rank, step, attempt in args.kill_rank_at or ():
        if world and rank >= world:
            p.error(f"--kill-rank-at {rank}:{step}:{attempt}: the job has ranks 0..{world - 1}")
    for flag in ("metrics", "trace"):   # found before any training, not after it
        path = getattr(args, flag)
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            p.error(f"--{flag} {path}: give a file path in an existing folder "
                    f"({'that is a folder' if path.is_dir() else f'no folder {path.parent}'})")
    return args


def _kill_at(text: str) -> tuple[int, int, int]:
    """--kill-rank-at RANK:STEP[:ATTEMPT] as (rank, step, attempt)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give RANK:STEP or RANK:STEP:ATTEMPT, e.g. 1:3")
    rank, step, attempt = (*map(int, parts), 0)[:3]
    return rank, step, attempt


def _budget(text: str | None):
    if text is None or text == "auto":
        return text
    if not text.replace("_", "").isdigit():
        raise SystemExit(f"--offload {text!r}: give a byte budget (e.g. 4000000) or 'auto'")
    return int(text.replace("_", ""))


def progress(step: int, total: int, width: int = 24) -> str:
    done = round(width * step / total)
    return f"[{'#' * done}{'.' * (width - done)}] {step:>{len(str(total))}}/{total}"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("ZB_THREADS", "1")))
    if "RANK" not in os.environ:
        print("run me under torchrun, e.g. torchrun --nproc-per-node 2 -m zbcompile.examples.train_gpt",
              file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # (set-up gives up after a minute, and torchrun tries again)
    init_from_environment("nccl" if device.type == "cuda" else "gloo", 60.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = GPTConfig(vocab=256, seq=args.seq, d=args.dim, heads=args.heads, layers=args.layers)
    batch = args.microbatches * args.microbatch_size
    data = batches(corpus_tokens(), batch, args.seq, seed=args.seed + 1)
    x, y = next(data)
    mbs = args.microbatch_size
    try:
        model = zb.compile(GPT(cfg).to(device), schedule=args.schedule, microbatches=args.microbatches,
                           loss_fn=loss_fn, example=(x[:mbs].to(device), y[:mbs].to(device)), pp=world,
                           chunks=args.chunks, vocab_parallel=args.vocab_parallel, offload=_budget(args.offload))
    except zb.ZBCompileError as e:   # every rank raises the same; one message, no traceback
        if rank == 0:
            print(f"zbcompile: {e}", file=sys.stderr)
        return 2
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"zbcompile: {args.schedule} on {world} ranks, {args.microbatches} microbatches x {mbs} x {args.seq} "
        f"tokens, GPT d={cfg.d} layers={cfg.layers}" + (", vocabulary parallel" if args.vocab_parallel else ""))
    if args.memory or args.offload:
        say(model.memory_plan().table())
    if model.offload_report:
        say("offload: " + ", ".join(f"rank {r.rank} moves {r.offloaded_bytes / 2**20:.2f} MiB per step, peak "
                                    f"{r.peak_before / 2**20:.2f} -> {r.peak_after / 2**20:.2f} MiB"
                                    for r in model.offload_report))
    where = args.save if args.resume == "auto" else args.resume
    try:
        found = where and (args.resume != "auto" or checkpoint.exists(where))
        done = resume(Path(where), model, opt) if found else 0
    except CheckpointError as e:   # every rank found the same (no checkpoint there, another model, damaged)
        if rank == 0:
            print(f"zbcompile: {e}", file=sys.stderr)
        return 2
    if found:   # a checkpoint the main job did not save (its weights only) records no step: training starts at 1
        say(f"resumed from {where} after step {done}" if done else f"loaded {where}, which records no step: "
            "training starts at step 1")
    total = args.steps if args.resume == "auto" else done + args.steps   # auto: a restart finishes the same job
    if done >= total:   # restarted after the last save (a rank died in the teardown): the job is done
        say(f"nothing left to train: the checkpoint in {where} is after step {done}, and --steps {args.steps} ends "
            f"the job at step {total}")
        _close()
        return 0
    if args.resume and args.metrics and rank == 0:   # a restart retrains the steps after the checkpoint
        args.metrics = _metrics_until(args.metrics, done)
    try:
        _train(args, model, opt, data, x, y, say, rank, world, batch, done, total)
    except (RuntimeFailure, CheckpointError) as e:
        # a peer died or stalled: the process group cannot be used again, so end this process now (a clean
        # teardown would wait on the dead peer); torchrun --max-restarts starts the job again
        said = str(e) if str(e).startswith(f"rank {rank}:") else f"rank {rank}: {e}"
        print(f"{said}\nzbcompile: the process group is unusable after this failure; the job must "
              "restart (torchrun --max-restarts N with --save DIR --resume auto resumes from the newest complete "
              "checkpoint)", file=sys.stderr, flush=True)
        os._exit(1)
    _close()
    return 0


def _close() -> None:
    dist.barrier()  # tear the groups down together: a rank closing its sockets under a busy peer is a race
    dist.destroy_process_group()


def _train(args, model, opt, data, x, y, say, rank: int, world: int, batch: int, done: int, total: int) -> None:
    """Train steps done+1 .. total (at least one; saving as asked), then print the summary."""
    for _ in range(done):   # the batches the saved run trained on; x, y become the next one
        x, y = next(data)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rows = []
    for step in range(done + 1, total + 1):
        start = time.perf_counter()
        loss = model.step(x, y)
        note = _optimizer_step(model, opt, args.clip_grad)
        seconds = time.perf_counter() - start
        bubbles = model.last_step.bubble
        rows.append((loss, batch * args.seq / seconds, bubbles))
        say(f"{progress(step, total)} loss {loss:.4f}  {batch * args.seq / seconds:8.0f} tok/s  bubble "
            + " ".join(f"r{r}={b:.0%}" for r, b in enumerate(bubbles)) + note, flush=True)
        if args.metrics and rank == 0:
            args.metrics = _append_metrics(args.metrics, step, loss)
        x, y = next(data)
        if args.eval_every and step % args.eval_every == 0:
            say(f"{'':>{len(progress(step, total))}} eval loss {model.eval().evaluate(x, y):.4f}", flush=True)
            model.train()
        if args.save and (step == total or (args.save_every and step % args.save_every == 0)):
            checkpoint.save(args.save, model, opt, extra={"step": step})
            say(f"saved the model and optimizer after step {step} to {args.save}", flush=True)
        if (rank, step, attempt) in (args.kill_rank_at or ()):
            os.kill(os.getpid(), signal.SIGKILL)
    if args.trace and rank == 0:   # the timeline holds every rank's actions
        try:
            model.chrome_trace(args.trace)
            say(f"wrote {args.trace} (open it in https://ui.perfetto.dev)")
        except OSError as e:
            print(f"zbcompile: --trace {args.trace}: cannot write it ({e.strerror or e}); training completed",
                  file=sys.stderr)
    _summary(say, rows, world)


def _append_metrics(path: Path, step: int, loss: float) -> Path | None:
    """Append the step's line to --metrics; where that fails (a full disk), say so once and go on without them:
    the other ranks would otherwise wait on this one until their timeout."""
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": step, "loss": loss}) + "\n")
        return path
    except OSError as e:
        print(f"zbcompile: --metrics {path}: cannot write it ({e.strerror or e}); training goes on without "
              "metrics", file=sys.stderr)
        return None


def _metrics_until(path: Path, done: int) -> Path | None:
    """--metrics without the lines of steps after `done` (the step the run resumes after), which the resumed
    run trains and writes again, nor a line a kill cut short; rewritten whole (a new file, then a rename)."""
    if not path.exists():
        return path
    kept = []
    try:
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= done:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        part = path.with_name(path.name + ".part")
        part.write_text("".join(f"{line}\n" for line in kept))
        os.replace(part, path)
        return path
    except OSError as e:
        print(f"zbcompile: --metrics {path}: cannot rewrite it ({e.strerror or e}); training goes on without "
              "metrics", file=sys.stderr)
        return None


def _optimizer_step(model, opt, clip: float | None) -> str:
    """Clip over the whole pipeline (if asked), then step unless some rank's gradients are not finite; the
    gradients are dropped either way. Returns what to add to the step's line."""
    note = ""
    if clip is not None:
        norm = float(model.clip_grad_norm_(clip))
        note = f"  grad norm {norm:.3f}"
        finite = math.isfinite(norm)
    else:
        finite = model.grads_finite()
    if finite:
        opt.step()
    else:
        note += "  (inf/NaN in the gradients: step skipped on every rank)"
    opt.zero_grad(set_to_none=True)
    return note


def resume(path: Path, model, opt) -> int:
    """Load the checkpoint at `path` into `model` and `opt`; returns the steps the saved run had done (saved
    with the checkpoint, committed in the same step)."""
    return int(checkpoint.load(path, model, opt).get("step", 0))


def _summary(say, rows, world: int) -> None:
    steady = rows[len(rows) // 3:] or rows  # the first steps warm up allocators and caches
    table = [["first loss", f"{rows[0][0]:.4f}"], ["last loss", f"{rows[-1][0]:.4f}"],
             ["median tokens/s", f"{statistics.median(r[1] for r in steady):.0f}"]]
    table += [[f"median bubble rank {r}", f"{statistics.median(row[2][r] for row in steady):.1%}"]
              for r in range(world)]
    say(tabulate(table, tablefmt="simple"))


if __name__ == "__main__":
    sys.exit(main())
