"""Checkpoints that move between pipeline layouts, through torch's own state-dict helpers and its distributed
checkpoint (DCP) format.

    zbcompile.checkpoint.save(path, pipe, opt)      # on every rank: each key written by exactly one rank
    zbcompile.checkpoint.load(path, pipe, opt)      # on every rank of any layout (pp, schedule, split), or
    zbcompile.checkpoint.load(path, model, opt)     # into the plain model, in one process, no process group

which is, for a pipe or the plain model alike,

    opts = StateDictOptions(flatten_optimizer_state_dict=True)               # `OPTIONS` below
    model_sd, optim_sd = get_state_dict(pipe, opt, options=opts)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)     # or dcp.load(...), then
    set_state_dict(pipe, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=opts)

plus, before `load` writes anything, a check of the checkpoint's keys and shapes against the model.

A PipelineModule is an nn.Module holding this rank's share of the user's model under the model's own fully
qualified names (`attach_share`), so torch's helpers need nothing from us: keys are the user's FQNs, the
optimizer's state is keyed by the same names. A tensor several ranks hold (a tied embedding, DualPipe's
mirrored stages) is in the state dict of every holder, because loading must fill every copy; saving writes
each key once, from one rank, as DCP's save planner keeps one writer per key (its `dedup_save_plans`).
With vocabulary parallelism each rank holds rows of the vocabulary tables under their full names: those
entries (and their optimizer state) go to DCP as row-sharded DTensors of the whole tables
(zbcompile/checkpoint_rows.py), so the checkpoint holds whole tables and any layout reads back the rows it holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from zbcompile import checkpoint_files as files
from zbcompile.checkpoint_checks import check_state_dict, check_tensors_only, checkpoint_problems, listing, message
from zbcompile.checkpoint_rows import as_live, row_shards
from zbcompile.errors import CheckpointError
from zbcompile.share import attach_share, share_of

__all__ = ["OPTIONS", "save", "load", "exists", "attach_share", "share_of", "check_state_dict", "as_live"]

# Torch's default optimizer state dict keeps hyperparameters per param-group *position*: every rank writes its
# own group 0 (its own parameter list, lr, betas) under the same keys ("optim.param_groups.0.*"), DCP keeps
# one rank's copy, and a rank whose parameters are not in that list loads a group without lr. Flattened, every
# entry is keyed by its parameter's FQN ("optim.param_groups.<fqn>.lr", "optim.state.<fqn>.exp_avg"), so any
# layout reads exactly its own: torch made this option for pipeline parallelism.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# ---- save / load ------------------------------------------------------------------------------------------
def save(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: Mapping[str, object] | None = None) -> None:
    """Write `module`'s state (a PipelineModule: this rank's share; call on every rank) and `optimizer`'s into
    the directory `path` in DCP's format, keyed by the user's FQNs, with a checksum of every item.

    Crash-safe (zbcompile/checkpoint_files.py): the files go to a staging directory beside `path`, which
    replaces `path` in one commit once every rank has written; a checkpoint already at `path` survives a crash
    at any moment of the save. A failure (a peer killed mid-save, a full disk) raises CheckpointError on the
    ranks that see it (a failure in DCP's writes or in rank 0's preparation: on every rank, every data-parallel
    replica included), saying what is left at `path`: the previous checkpoint, or, once every rank has written,
    one whole checkpoint, this save's or the previous one.
    `extra`: JSON-able values committed with the checkpoint (a training loop's step count, its data position),
    checksummed with it, which `load` returns."""
    _settle(module)
    dp = getattr(module, "_dp", None)
    # with data parallelism every rank of the job takes part, on a group with compile's timeout: sharded replicas
    # each write their rows; replicated ones hold the same state, which DCP's planner writes once (each item on
    # one rank), and all of them learn together whether the save succeeded
    pg = dp.job_group() if dp is not None else getattr(module, "process_group", None)
    rank, ranks = _rank(pg)
    path = Path(path)
    stage = files.staging(path)
    _check_optimizer(module, optimizer, pg, "written")
    _check_extra(extra)
    check_tensors_only(module)
    committing = False   # from here on the checkpoint at `path` may be this save's
    try:
        # nobody writes before the stale staging directory is gone; where rank 0 cannot clear it (a path under a
        # file, no permission) every rank fails with its reason now, none waits for it
        prepared = _prepare(path, stage) if rank == 0 else None
        failed = [why for why in _exchange(pg, prepared) if why]
        if failed:
            raise OSError(failed[0])
        with _single_process_is_meant(), _kept_stateless(module, optimizer) as stateless:
            state, _ = _state_dict(module, optimizer)
            state[files.MARKER[0]] = {files.MARKER[1]: files.FORMAT}
            dcp.save(state, checkpoint_id=stage, process_group=pg, no_dist=not _distributed(pg))
        sums, stateless = _gathered_checksums(pg, stage, rank, ranks, stateless)
        committing = True
        committed = _commit(stage, path, sums, extra, sorted(set().union(*stateless))) if rank == 0 else None
        failed = [why for why in _exchange(pg, committed) if why]   # every rank returns once it is in place
        if failed:
            raise OSError(failed[0])
    except (Exception, CheckpointException) as exc:   # DCP's CheckpointException is a BaseException
        interrupted = _interrupted(exc)
        error = CheckpointError(
            f"rank {rank}: saving the checkpoint {os.fspath(path)!r} failed ({_reason(exc)}). "
            f"{_what_is_left(path, stage, committing)} "
            f"{'' if interrupted else 'Free disk space if it is full; '}after a peer failed the process group is "
            "unusable: restart the job (it resumes from the checkpoint)")
        if rank in interrupted:   # Ctrl-C here, which DCP caught as a write failure: still the user's interrupt
            raise KeyboardInterrupt(str(error)) from exc
        raise error from exc


def _gathered_checksums(pg, stage: Path, rank: int, ranks: int, stateless: list[str]) -> tuple[list, list]:
    """Every rank's checksums of its share of the written items, and its stateless parameters; OSError on every
    rank where one rank could not read its share back (its path resolves elsewhere: a relative path under
    another working directory), instead of that rank alone while the others wait in the exchange."""
    try:
        mine, why = files.item_checksums(stage, rank, ranks), None
    except Exception as e:   # missing files (OSError), or an index that does not unpickle: every rank must hear it
        mine, why = None, f"rank {rank} could not read back what was written at {os.fspath(stage)!r}: {_line(e)}"
    gathered = _exchange(pg, (mine, stateless, why))
    failed = [w for _, _, w in gathered if w]
    if failed:
        raise OSError(f"{failed[0]} (every rank must see the same directory: give an absolute path on a filesystem "
                      "every rank shares)")
    return [g[0] for g in gathered], [g[1] for g in gathered]


def _prepare(path: Path, stage: Path) -> str | None:
    """Rank 0 before a save: a crashed commit at `path` put right, `path` one a commit may replace, the staging
    directory emptied; None, or why not."""
    try:
        files.recover(path)
        problem = files.target_problem(path)
        if problem:
            return f"{problem}; nothing was written"
        files.clear(stage)
    except OSError as e:
        return f"rank 0 could not prepare {os.fspath(stage)!r}: {e}"
    return None


def _commit(stage: Path, path: Path, sums: list[dict], extra, stateless: list[str]) -> str | None:
    """Rank 0 once every rank has written: the manifest, then the commit; None, or why it failed (every rank
    raises it)."""
    try:
        files.write_manifest(stage, {k: v for part in sums for k, v in part.items()}, dict(extra or {}), stateless)
        files.commit(stage, path)
    except OSError as e:
        return f"rank 0 could not commit: {_line(e)}"
    return None


def _recovered(path: Path) -> list[str]:
    """Rank 0 before a load: a crashed commit at `path` put right; [] or why not."""
    try:
        files.recover(path)
    except OSError as e:
        return [f"a crashed save's {files.previous(path).name!r} beside it cannot be put right ({_line(e)}): move "
                "it away if it is not a checkpoint"]
    return []


def _what_is_left(path: Path, stage: Path, committing: bool) -> str:
    """What a failed save leaves at `path`: the checkpoint from before it, unless every rank had written and the
    commit may have run (it replaces the checkpoint in one step, so `path` holds one whole checkpoint either way)."""
    if not committing:
        return (f"The checkpoint that was there before this save, if any, is intact; the partial save is only in "
                f"{os.fspath(stage)!r}, which the next save clears.")
    return (f"Every rank had written, and the commit may have run: {os.fspath(path)!r} holds one whole checkpoint, "
            "this save's or the one before it (load returns the `extra` it was saved with).")


def load(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint `save` wrote (at any pipeline layout, or from the plain model) into `module` (a
    PipelineModule on every rank, or a plain nn.Module in one process) and `optimizer`.

    Nothing changes unless everything checks out, and every rank raises the same CheckpointError otherwise:
    first that there is a checkpoint at `path`, then that its index is whole, then its keys and shapes against
    the model and this rank's optimizer ("another model", naming the first mismatches), then the checksum of
    every item (each rank re-reads a share of the files: "damaged", naming the file and the tensor). The data are
    then read into copies, and only a complete read is handed to the model and the optimizer. Returns the
    `extra` values saved with it ({} for none, or a checkpoint torch's DCP wrote)."""
    _settle(module)
    pg = getattr(module, "process_group", None)
    rank, ranks = _rank(pg)
    path = Path(path)
    _check_optimizer(module, optimizer, pg, "loaded")
    dp = getattr(module, "_dp", None)
    job = dp.job_group() if dp is not None else pg   # every rank waits until one of the job has put it right
    _agree_or_raise(job, _recovered(path) if _rank(job)[0] == 0 else [], path, "blocked")
    _agree_or_raise(pg, [] if files.exists(path) else [f"no checkpoint at {os.fspath(path)!r} (no "
                                                       f"{files.METADATA} there)"], path, "missing")
    _agree_or_raise(pg, files.metadata_problems(path), path, "damaged")
    meta = _check_checkpoint(path, module, optimizer, pg)
    _agree_or_raise(pg, files.data_problems(path, rank, ranks), path, "damaged")
    extra, stateless = files.extra(path), set(files.stateless(path))
    with _emptied_for_load(optimizer):
        state, whole = _state_dict(module, optimizer, copies=True)
        unsaved = _take_state_of(state, stateless)
        _check_optimizer_state(path, meta, state, pg)
        _read(path, state, pg)
        state.get("optim", {}).update(unsaved)   # torch's load wants an entry per parameter; dropped after it
    # row shards were read in place through their views: hand the module its whole tensors back (as this
    # replica's shard of them where the data-parallel replicas shard them)
    state = {part: {k: as_live(whole[part, k]) if (part, k) in whole else v for k, v in entries.items()}
             for part, entries in state.items()}
    if optimizer is None:
        set_model_state_dict(module, state["model"], options=OPTIONS)
    else:
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=OPTIONS)
        _drop_state(module, optimizer, stateless)   # as they were saved: not stepped yet
    return extra


def _read(path: Path, state: dict, pg) -> None:
    """DCP's read of the checkpoint into `state` (copies); a failure is a CheckpointError, with the same reason on
    every rank (DCP gathers every rank's failure before raising). Only a checkpoint without a manifest gets here
    damaged: the checksums found the rest."""
    try:
        with _single_process_is_meant():
            dcp.load(state, checkpoint_id=path, process_group=pg, no_dist=not _distributed(pg))
    except (Exception, CheckpointException) as exc:   # DCP's CheckpointException is a BaseException
        unverified = "" if (path / files.MANIFEST).exists() else f", and without {files.MANIFEST} it was not verified"
        raise CheckpointError(f"checkpoint {os.fspath(path)!r}: damaged, nothing was loaded:\n  reading it failed "
                              f"({_reason(exc)}){unverified}\nload an earlier checkpoint; the model and the "
                              "optimizer were not changed") from exc


@contextlib.contextmanager
def _kept_stateless(module: nn.Module, optimizer):
    """Yield the names of the parameters `optimizer` has no state for yet, and leave them without state after
    the save: torch's get_state_dict makes it by stepping the optimizer once with lr 0 (_init_optim_state), and
    that state is not a fresh one (AdamW's step count 1, SGD's dampened momentum buffer of zeros), so training
    on would differ from training without the save. The manifest lists them, and `load` drops their state
    again (`_drop_state`)."""
    if optimizer is None:
        yield []
        return
    held = {p for g in optimizer.param_groups for p in g["params"]}
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if p in held and p not in optimizer.state]
    try:
        yield names
    finally:
        _drop_state(module, optimizer, names)


def _take_state_of(state: dict, names: set[str]) -> dict:
    """Take the optimizer state entries of the parameters `names` out of `state` (the copies a load reads into)
    and return them: they had no state when the checkpoint was saved (no step yet, or no gradient in any step so
    far: an expert never routed to), so it holds none for them where the optimizer had stepped others (torch
    makes state for every parameter, with a step of lr 0, only where an optimizer has none at all)."""
    optim = state.get("optim") or {}
    taken = {k: v for k, v in optim.items() if k.startswith("state.") and _state_owner(k) in names}
    for k in taken:
        del optim[k]
    return taken


def _state_owner(key: str) -> str:
    """The parameter of a flat optimizer state key, `state.<fqn>.<entry>` (entries have no dots: exp_avg, step)."""
    return key.removeprefix("state.").rpartition(".")[0]


def _drop_state(module: nn.Module, optimizer, names) -> None:
    """`optimizer` without state for the parameters named `names` (as before their first step)."""
    names = set(names)
    for n, p in module.named_parameters(remove_duplicate=False):
        if n in names:
            optimizer.state.pop(p, None)


@contextlib.contextmanager
def _emptied_for_load(optimizer):
    """`optimizer` without state and its parameters without gradients while a load reads into it. torch's
    get_state_dict makes state for every parameter (stepping once with lr 0, its _init_optim_state) only where the
    optimizer has no state at all and no parameter a gradient, and a load reads only the entries that exist: the
    checkpoint's state of a parameter the optimizer had not stepped yet was silently left out. If the load fails
    the state is put back as it was; the gradients are put back in any case (a load does not touch them)."""
    if optimizer is None:
        yield
        return
    state = dict(optimizer.state)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    optimizer.state.clear()
    for p in params:
        p.grad = None
    try:
        yield
    except BaseException:
        optimizer.state.clear()
        optimizer.state.update(state)
        raise
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def _reason(exc: BaseException) -> str:
    """An exception in a line: for DCP's CheckpointException (whose text is every failed rank's traceback), each
    failed rank's exception."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return "; ".join(f"rank {r}: {_line(f[0] if isinstance(f, tuple) else f)}"
                         for r, f in sorted(exc.failures.items()))
    return _line(exc)


def _interrupted(exc: BaseException) -> set[int]:
    """The ranks whose failure in DCP's CheckpointException is a KeyboardInterrupt (Ctrl-C during the write)."""
    failures = exc.failures if isinstance(exc, CheckpointException) else {}
    return {r for r, f in failures.items() if isinstance(f[0] if isinstance(f, tuple) else f, KeyboardInterrupt)}


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _check_extra(extra) -> None:
    """CheckpointError before anything is written where `extra` is not JSON (it goes into the manifest)."""
    try:
        json.dumps(dict(extra or {}))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"save(..., extra=...) takes a dict of JSON values (numbers, strings, lists, dicts), "
                              f"and this one is not ({type(exc).__name__}: {exc}); nothing was written") from None


def _check_optimizer(module: nn.Module, optimizer, pg, done: str) -> None:
    """CheckpointError on every rank, before anything is written or read, where any rank's `optimizer` holds a
    tensor that is not one of its `module`'s parameters (an optimizer of another pipe or model: its state has no
    name in the checkpoint). `done`: what was not done ("written", "loaded")."""
    stray = 0
    if optimizer is not None:
        mine = {id(p) for p in module.parameters()}
        stray = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    found = _everyones(pg, [f"rank {_rank(pg)[0]}: {stray} of them"] if stray else [])
    if found:
        raise CheckpointError(f"the optimizer holds tensors that are not parameters of the module ({', '.join(found)}"
                              "), so their state has no name in the checkpoint; pass the optimizer built on this "
                              f"module's parameters (torch.optim.AdamW(pipe.parameters())); nothing was {done}")


def exists(path: str | os.PathLike) -> bool:
    """Whether a complete checkpoint is at `path` (or one a crash left mid-commit, which load puts back): what
    a training loop asks before resuming from where it saves."""
    path = Path(path)
    return files.exists(path) or files.exists(files.previous(path))


def _rank(pg) -> tuple[int, int]:
    return (pg.rank(), pg.size()) if _distributed(pg) else (0, 1)


def _exchange(pg, value) -> list:
    """Every rank's `value` (an all-gather of picklable objects; also a barrier), [value] in one process."""
    if not _distributed(pg):
        return [value]
    out: list = [None] * pg.size()
    dist.all_gather_object(out, value, group=pg)
    return out


def _everyones(pg, problems: list[str]) -> list[str]:
    """Every rank's problems, combined in rank order: each rank then raises the same error, or none does (no
    rank is left waiting on one that raised)."""
    return list(dict.fromkeys(p for part in _exchange(pg, problems) for p in part))


def _agree_or_raise(pg, problems: list[str], path: Path, kind: str) -> None:
    """CheckpointError on every rank where any rank found a problem."""
    found = _everyones(pg, problems)
    if found:
        fix = {"missing": "check the path (and that the save finished)",
               "damaged": "load an earlier checkpoint; the model and the optimizer were not changed",
               "blocked": "move what is in the way, then load again"}[kind]
        raise CheckpointError(f"checkpoint {os.fspath(path)!r}: {kind}, nothing was loaded:\n  {listing(found)}\n"
                              f"{fix}")


def _distributed(pg) -> bool:
    return pg is not None and dist.is_initialized()


@contextlib.contextmanager
def _single_process_is_meant():
    """DCP warns that it "assumes" one process whenever it runs without a process group, even when asked to
    with no_dist=True; here that is the plain model's case, chosen on purpose, so the warning says nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _settle(module: nn.Module) -> None:
    """A post-validated step still pending is validated first, on every rank (every replica included): the
    parameters and the optimizer state are then final (zbcompile/post_validation.py)."""
    settle = getattr(module, "settle", None)
    if callable(settle):
        settle()


def _state_dict(module: nn.Module, optimizer, copies: bool = False):
    """What DCP reads and writes, and for each row-sharded entry (vocabulary parallelism) the tensor it views;
    with `copies`, of copies of every tensor (a load reads into them, leaving the live state alone)."""
    if optimizer is None:
        state = {"model": get_model_state_dict(module, options=OPTIONS)}
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer, options=OPTIONS)
        state = {"model": model_sd, "optim": optim_sd}
    if copies:
        state = {part: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
                 for part, entries in state.items()}
    return row_shards(state, module)


def _check_checkpoint(path, module: nn.Module, optimizer, pg) -> Mapping[str, object]:
    """CheckpointError on every rank where the checkpoint's index does not fit `module` / `optimizer`;
    otherwise the index (DCP's state_dict_metadata), read once for the checks after this one."""
    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:   # OSError, or whatever unpickling a damaged index raises
        meta, problems = None, [f"no checkpoint readable at {os.fspath(path)!r} ({type(exc).__name__}: {exc})"]
    else:
        problems = checkpoint_problems(meta, module, optimizer)
    problems = _everyones(pg, problems)
    if problems:
        raise CheckpointError(message(f"checkpoint {os.fspath(path)!r}", problems,
                                       "load it into the model (and optimizer) it was saved from"))
    return meta


def _check_optimizer_state(path: Path, meta: Mapping[str, object], state: dict, pg) -> None:
    """CheckpointError on every rank where this rank's optimizer has state entries the checkpoint's index `meta`
    lacks (torch made them by a step with lr 0, as the load reads into them): it was saved with another
    optimizer, or other settings of it (SGD's momentum_buffer where AdamW's exp_avg was saved)."""
    mine = [k for k in state.get("optim", {}) if k.startswith("state.") and f"optim.{k}" not in meta]
    problems = []
    for key in mine:
        fqn = _state_owner(key)
        held = sorted(k.rpartition(".")[2] for k in meta if k.startswith(f"optim.state.{fqn}."))
        problems.append(f"missing: optim.{key} (the checkpoint holds {', '.join(held) or 'no state'} for {fqn})")
    problems = _everyones(pg, problems)
    if problems:
        raise CheckpointError(f"checkpoint {os.fspath(path)!r} was saved with another optimizer or other settings "
                              f"of it, nothing was loaded; {len(problems)} entr(ies) missing:\n  "
                              f"{listing(problems)}\nLoad it with the optimizer it was saved with, or the model "
                              "alone (load(path, pipe)) and a fresh optimizer.")
