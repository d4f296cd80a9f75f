"""Ranks that disagree are refused, on every rank, before they exchange a single tensor.

    check_agreement(model, compiled, (pg, rank), ...)   at compile, before the first message between ranks
    check_batch(batch, gather, rank, what)       on step() / evaluate(): the same batch on every rank
    check_step_arguments(rows, rank)             on step(optimizer=...): the same clipping on every rank

Every rank of a pipeline compiles the same model with the same options and runs its own share of the SAME
programs; a rank that built something else (another depth or width, another schedule, other microbatches or cuts,
another torch) would otherwise train a wrong model silently, abort inside gloo, or hang until a timeout naming
tensors instead of the cause. So compile all-gathers a fingerprint of what each rank built, in sections compared
in this order (the first difference is the one named, as the cause the others follow from):

    versions     zbcompile and torch
    options      every option that shapes the programs (schedule, microbatches, chunks, split points, ...)
    parameters   each parameter's name, shape, dtype and whether it is trained; then buffers
    batch        each argument's microbatch shape and dtype, from `example`
    split        the cuts
    stages       a digest of each stage's F, B, W and BW graphs, with the values of their constants
    programs     a digest of every rank's program (which every rank computes for all ranks)

The batch handed to step() must be the whole batch, the same on every rank (each rank reads what its stages
need); a DistributedSampler habit gives each rank other data. A checksum of each argument (its sum and a sum
weighted by fixed pseudo-random numbers, in float64) is all-gathered on the first step, and every
`check_batch` steps if asked.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import math
import pickle
import secrets
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zbcompile.errors import DisagreementError, RuntimeFailure

__all__ = ["fingerprint", "check_agreement", "wait_until_compiled", "first_difference", "batch_checksum",
           "check_batch", "check_same_batch", "version", "step_arguments", "check_step_arguments"]

# the options that shape what a rank builds or the collectives it calls (group, init_fn, loss_fn, example and
# timeout do not, or are checked through what they produce: example through `batch`, loss_fn through `stages`)
_SHAPING = ("schedule", "microbatches", "pp", "chunks", "split_points", "costs", "mem_limit", "vocab_parallel",
            "offload", "backend", "cuda_graphs", "check_batch", "dp_batch", "dp_shard", "dp_gather", "dp_bucket_mb",
            "dp_overlap", "dp_w_pieces")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("zbcompile")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tensor(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def fingerprint(model: nn.Module, compiled) -> dict[str, dict[str, str]]:
    """What this rank built, section by section (see the module docstring); plain strings, so that it pickles
    small and compares exactly."""
    options, staged = compiled.options, compiled.staged
    option = {name: _option(getattr(options, name)) for name in _SHAPING}
    params = {n: _tensor(p) + ("" if p.requires_grad else " frozen") for n, p in model.named_parameters()}
    buffers = {n: _tensor(b) for n, b in model.named_buffers()}
    from zbcompile.runtime.eager import data_specs

    batch = {f"argument {i}": f"{list(shape)} {str(dtype).removeprefix('torch.')}"
             for i, (shape, dtype) in data_specs(compiled.programs).items()}
    cuts = {"split points": repr(tuple(staged.meta.get("cuts", {}).get("points", ())))}
    stages = {f"stage {st.index}": _stage_digest(st) for st in staged.stages}
    programs = {f"rank {p.rank}": _digest(p.to_text()) for p in compiled.programs}
    return {"versions": {"zbcompile": version(), "torch": torch.__version__}, "options": option,
            "parameters": params, "buffers": buffers, "batch": batch, "split": cuts, "stages": stages,
            "programs": programs}


def _stage_digest(stage) -> str:
    """A digest of a stage's F, B, W and BW graphs: their code and the values of the constants they hold (a loss's
    class weights, a mask made outside the model: the same code with other numbers trains another model)."""
    h = hashlib.sha256()
    for g in ("f", "b", "w", "bw"):
        gm = getattr(stage, g).gm
        h.update(gm.code.encode())
        for node in gm.graph.nodes:
            value = _attr(gm, node.target) if node.op == "get_attr" else None
            if isinstance(value, torch.Tensor):
                h.update(_bytes(value))
    return h.hexdigest()[:16]


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's shape, dtype and contents (shape and dtype alone on the meta device: nothing to read)."""
    head = f"{list(t.shape)} {t.dtype}".encode()
    if t.device.type == "meta" or t.is_sparse or t.is_quantized:
        return head
    return head + t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _option(value) -> str:
    name = getattr(value, "name", None)   # a Schedule object: its name and order
    if name is not None and hasattr(value, "ranks"):
        return f"{name} ({_digest(repr(value.ranks))})"
    return repr(value)


def first_difference(prints: Sequence[dict[str, dict[str, str]]], names: Sequence[int] | None = None) -> str | None:
    """The first entry, in section order, on which the ranks' fingerprints differ, as a sentence naming the
    ranks on each side (`names`: each one's number in the job, default its place in `prints`); None where they
    agree."""
    names = list(range(len(prints))) if names is None else list(names)
    for section in prints[0]:
        keys = list(dict.fromkeys(k for p in prints for k in p.get(section, {})))
        for key in keys:
            values = [p.get(section, {}).get(key, "none") for p in prints]
            if len(set(values)) > 1:
                groups: dict[str, list[int]] = {}
                for r, v in enumerate(values):
                    groups.setdefault(v, []).append(names[r])
                sides = "; ".join(f"{_ranks(rs)}: {v}" for v, rs in groups.items())
                return f"{section}, {key}: {sides}"
    return None


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def check_agreement(model: nn.Module, compiled, *groups: tuple[object, int]) -> None:
    """All-gather this rank's fingerprint over each (group, rank in it) of `groups` (the pipeline's, then the
    data-parallel one) and raise DisagreementError on every rank where they differ, naming the ranks by their
    number in the job (under pp x dp a group's own numbers are not). Runs before any other message between the
    ranks, so a mismatch cannot hang or abort anything first. A group that is no torch.distributed ProcessGroup
    (the tests' stand-ins) is not checked."""
    groups = tuple((pg, rank) for pg, rank in groups
                   if pg is not None and pg.size() > 1 and isinstance(pg, dist.ProcessGroup))
    mine = fingerprint(model, compiled) if groups else None   # made once, compared in every group
    for k, (pg, rank) in enumerate(groups):
        prints = _gather_objects(mine, pg, rank, compiled.options.timeout)
        names = job_ranks(pg, len(prints))
        diff = first_difference(prints, names)
        if diff is not None:
            who = "the pipeline's ranks" if k == 0 else "the data-parallel replicas (the same stages)"
            raise DisagreementError(
                f"rank {names[rank]}: {who} compiled different things; the first difference is {diff}. "
                "Every rank must compile the same model with the same options (and the same torch and "
                "zbcompile): check what builds the model on each rank (seeds, config, command-line arguments)")


def _gather_objects(obj, pg, rank: int, timeout: float) -> list:
    """dist.all_gather_object with the pipeline's timeout (torch's waits the group's, 30 minutes by default, for
    a rank that never calls compile): each rank's pickled bytes, their lengths first. RuntimeFailure names the
    wait that ran out."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else "cpu"
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = _gathered(torch.tensor([data.numel()], dtype=torch.int64, device=device), pg, rank, timeout)
    longest = int(torch.cat(sizes).max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    rows = _gathered(padded, pg, rank, timeout)
    return [pickle.loads(row[:int(n.item())].cpu().numpy().tobytes()) for row, n in zip(rows, sizes)]


def _gathered(t: torch.Tensor, pg, rank: int, timeout: float,
              what: str = "comparing what each rank compiled") -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(pg.size())]
    try:
        dist.all_gather(out, t, group=pg, async_op=True).wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RuntimeFailure(f"rank {rank}: {what} (zbcompile.compile on every rank) failed or ran past the "
                             f"timeout of {timeout:g} s: a rank did not call compile, or is slower than that to "
                             f"reach it; {e}") from e
    return out


# how many pipeline numbers wait_until_compiled draws from: a call's number is pipe * 2**32 + count, exact in float64
PIPE_NUMBERS = 1 << 20

# how long the ranks wait for each other at the end of compile: each compiles its own stage graphs (inductor),
# which takes each rank its own time, minutes on a big model; not the step's timeout, which bounds a message
READY_TIMEOUT = 3600.0


def wait_until_compiled(pg, rank: int, timeout: float) -> int:
    """Every rank waits here until every rank has finished compile (one all-gather), so that a rank whose graphs
    took longer to build does not count against the first step's timeout, as a peer that died would. `pg`: a
    group whose own timeout is READY_TIMEOUT (distributed.ready_group), or gloo ends the wait at the group's.
    Returns the pipeline's number, the same on every rank (rank 0's random draw, 1 to 2**20 - 1): the pipes of one
    job share their process groups, and each call's number carries it (PipelineModule._enter), so that one pipe's
    call paired with another's on a peer is found. 0 where there is no peer to pair with another pipe."""
    if pg is None or not isinstance(pg, dist.ProcessGroup) or pg.size() < 2:
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else "cpu"
    mine = float(1 + secrets.randbelow(PIPE_NUMBERS - 1))   # (not the seeded generators: every rank draws alike)
    drawn = _gathered(torch.tensor([mine], dtype=torch.float64, device=device), pg, rank,
                      max(timeout, READY_TIMEOUT), "waiting for every rank to finish compiling its stage graphs")
    return int(drawn[0].item())


def batch_checksum(batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per argument: its sum and a weighted sum, in float64 (of a complex one's real and imaginary parts), the
    weights fixed pseudo-random numbers in [1, 2) (the same on every rank): a batch whose rows are shuffled, or
    whose tokens changed in a pattern a linear weighting cancels (+1, -1, -1, +1 on four neighbours), has another
    weighted sum."""
    sums = []
    for t in batch:
        t = t.detach()
        flat = (torch.view_as_real(t.resolve_conj()) if t.is_complex() else t).reshape(-1).to(torch.float64)
        sums += [flat.sum(), (flat * _weights(flat.numel()).to(flat.device)).sum()]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)


@functools.lru_cache(maxsize=16)
def _weights(n: int) -> torch.Tensor:
    return 1.0 + torch.rand(n, generator=torch.Generator().manual_seed(0x5EED), dtype=torch.float64)


def check_batch(batch: Sequence[torch.Tensor], gather: Callable[[torch.Tensor], torch.Tensor], rank: int,
                what: str, ranks: Sequence[int] | None = None, replicas: bool = False) -> None:
    """Raise DisagreementError on every rank where the ranks were handed different batches (gather: the
    pipeline's all-gather of a float64 vector, RankRuntime.allgather; or with `replicas` the data-parallel
    group's). ranks: the gathered ranks' numbers in the job (default: their places in the group)."""
    rows = gather(batch_checksum(batch)).cpu()
    ranks = list(range(rows.shape[0])) if ranks is None else list(ranks)
    for i in range(len(batch)):
        sums = rows[:, 2 * i:2 * i + 2]
        same = [bool(torch.equal(sums[r], sums[0]) or (sums[r].isnan().any() and sums[0].isnan().any()))
                for r in range(rows.shape[0])]
        if all(same):
            continue
        differ = [ranks[r] for r, s in enumerate(same) if not s]
        said = f"rank {ranks[rank]}: {what}() was handed different batches: argument {i} on rank(s) {differ} " \
               f"differs from rank {ranks[0]}'s"
        if replicas:
            raise DisagreementError(
                f"{said}, a data-parallel replica of it (the same stages). With dp_batch=\"global\" every rank is "
                "handed the same global batch and each replica takes its rows of it: the same seed and data order "
                "everywhere; to hand each replica its own rows (a DistributedSampler over the replicas), compile "
                "with dp_batch=\"local\"")
        raise DisagreementError(
            f"{said}. Hand every rank the whole batch, the same one (each rank reads what its stages need): no "
            "DistributedSampler over the pipeline's ranks, the same seed and data order everywhere")


def job_ranks(pg, size: int) -> list[int]:
    """The job's numbers of a group's ranks (a test's stand-in group: their places in it)."""
    if isinstance(pg, dist.ProcessGroup) and dist.is_initialized():
        return [dist.get_global_rank(pg, r) for r in range(size)]
    return list(range(size))


def check_same_batch(pipe, batch: Sequence[torch.Tensor], what: str) -> None:
    """check_batch for a PipelineModule's call `what` (step, evaluate, forward) when options.check_batch asks: on
    the first call of each kind, and every n-th with an int n; over the pipeline, and with data parallelism
    over the replicas too where each is handed the global batch."""
    every = pipe.compiled.options.check_batch
    calls = pipe._calls.get(what, 0)   # calls whose batch passed (a refused batch leaves the next one checked)
    if every is not False and (calls == 0 or (every is not True and calls % every == 0)):
        with torch.inference_mode(False):
            # named in a timeout: a peer that refused this call (or died) never joins this all-gather
            gather = functools.partial(pipe._gather, what=f"comparing the batch of {what}() on every rank (a peer "
                                                          "that refused this call, or died, never joins)")
            pg = pipe.process_group
            check_batch(batch, gather, pipe.rank, what, None if pg is None else job_ranks(pg, pg.size()))
            dp = pipe._dp
            if dp is not None and not pipe._local_batches:   # the global batch: the same on every replica
                check_batch(batch, dp.allgather, dp.rank, what, job_ranks(dp.group, dp.size), replicas=True)
    pipe._calls[what] = calls + 1


# ---- step()'s optimizer arguments, the same on every rank (zbcompile/post_validation.py) ----------------------
STEP_ARGUMENTS = ("max_norm", "norm_type", "rollback", "scaler")


def step_arguments(max_norm: float | None, norm_type: float, rollback: str = "", scaler=None) -> list[float]:
    """The step's arguments that every rank must share, as floats (None as NaN) for an all-gather."""
    return [math.nan if max_norm is None else float(max_norm), float(norm_type), float(rollback == "inverse"),
            float(scaler is not None)]


def check_step_arguments(rows: list[list[float]], rank: int) -> list[list[float]]:
    """`rows` (every rank's values, ending with `step_arguments`) unchanged, or DisagreementError on every rank
    where the ranks stepped with other arguments: each would clip or skip by its own verdict, a model no single
    setting trains (post-validated: a rollback one rank makes and another does not, then a timeout)."""
    tail = [row[-len(STEP_ARGUMENTS):] for row in rows]
    for k, name in enumerate(STEP_ARGUMENTS):
        values = [row[k] for row in tail]
        if any(v != values[0] and not (math.isnan(v) and math.isnan(values[0])) for v in values):
            shown = "; ".join(f"rank {r}: {_shown(name, v)}" for r, v in enumerate(values))
            raise DisagreementError(f"rank {rank}: step() was called with other arguments on different ranks: "
                                    f"{name}: {shown}. Pass the same optimizer arguments (max_norm, norm_type, "
                                    "post_validate, scaler) on every rank")
    return rows


def _shown(name: str, value: float):
    if name == "max_norm":
        return None if math.isnan(value) else value
    if name in ("rollback", "scaler"):
        return {"rollback": ("snapshot", "inverse"), "scaler": ("none", "a GradScaler")}[name][int(value)]
    return value
