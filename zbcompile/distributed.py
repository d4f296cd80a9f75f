"""Process groups and parameters across the pipeline's ranks: everything `compile` needs from torch.distributed.

    split_mesh         a 2-D ("dp", "pp") DeviceMesh as its pipeline dimension and its data-parallel group
    resolve_group      the pipeline's ProcessGroup (a group, a 1-D DeviceMesh, or torchrun's environment)
    p2p_channels       one extra group per P2P direction (NCCL streams; gloo's I/O threads tuned on creation)
    holders            per parameter / buffer, the ranks whose stages use it ("which ranks hold X", once)
    keep_only          a rank keeps real storage only for what its stages use (meta-device models initialized)
    sync_copies        copies of one parameter / buffer on several ranks made equal from the lowest rank
    collective_group   one more group over the pipeline's ranks for the vocabulary layers' collectives
    shard_vocab_params each rank keeps its rows of the vocabulary parameters, as Parameters of their own
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from zbcompile._torch_private import default_group, live_process_groups, process_group_name
from zbcompile.errors import RuntimeFailure, UsageError
from zbcompile.ir.names import Role, key_of, role_of
from zbcompile.ir.schedule import Schedule
from zbcompile.ir.stages import StagedModel
from zbcompile.runtime.host import process_threads, tune_io_threads
from zbcompile.runtime.vocab_rows import shard_vocab_params

__all__ = ["split_mesh", "resolve_group", "p2p_channels", "collective_group", "holders", "device_for", "keep_only",
           "sync_copies", "shard_vocab_params", "is_meta", "to_device"]


def holders(sched: Schedule, staged: StagedModel) -> dict[str, tuple[int, ...]]:
    """Parameter fqn / `buffer:fqn` -> the sorted ranks whose stages use it."""
    found: dict[str, set[int]] = {}
    for k, ranks in enumerate(sched.stage_ranks()):
        stage = staged.stages[k]
        for n in stage.params + tuple(f"buffer:{b}" for b in stage.buffers):
            found.setdefault(n, set()).update(ranks)
    return {n: tuple(sorted(r)) for n, r in sorted(found.items())}


def split_mesh(group):
    """(the pipeline's group as resolve_group takes it, the data-parallel ProcessGroup or None) of compile's
    `group`: a 2-D DeviceMesh whose dimensions are named "dp" and "pp" (in either order) gives its "pp" dimension
    and the group of its "dp" dimension; anything else is the pipeline's group alone."""
    if not _is_mesh(group):
        return group, None
    names = tuple(group.mesh_dim_names or ())
    if group.get_coordinate() is None:
        raise UsageError(f"this process is not in the DeviceMesh given as group "
                         f"{names or ''} ({group.mesh.tolist()}): call zbcompile.compile on the mesh's ranks only, "
                         "or give a mesh over every rank")
    if group.ndim == 1:
        if names == ("dp",):
            raise UsageError("a 1-D DeviceMesh named 'dp' was given: that is a data-parallel dimension, and it "
                             "would run as one pipeline over its ranks; give the pipeline dimension (mesh['pp']) "
                             "or the 2-D mesh with dimensions named 'dp' and 'pp'")
        return group, None
    if group.ndim > 2:
        raise UsageError(f"a {group.ndim}-D DeviceMesh {names or ''} was given; zbcompile takes a 2-D mesh whose "
                         "dimensions are named 'dp' and 'pp' (data x pipeline parallel), or its pipeline "
                         "dimension alone, mesh['pp']")
    if sorted(names) != ["dp", "pp"]:
        raise UsageError(f"a 2-D DeviceMesh needs dimensions named 'dp' and 'pp', got {names or 'no names'}: "
                         "init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp'))")
    return group["pp"], group.get_group("dp")


def _is_mesh(group) -> bool:
    return group is not None and hasattr(group, "get_group") and hasattr(group, "mesh")


def resolve_group(group, timeout: float):
    """(ProcessGroup or None, pipeline rank, pipeline size)."""
    if _is_mesh(group):
        if group.ndim != 1:
            raise UsageError(f"a {group.ndim}-D DeviceMesh was given; pass its pipeline dimension, mesh['pp'], or a "
                             "2-D mesh whose dimensions are named 'dp' and 'pp'")
        group = group.get_group()
    if group is None:
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                return None, 0, 1
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            init_from_environment(backend, max(timeout, 1.0))
        group = dist.group.WORLD
    if group is dist.group.WORLD:
        group = default_group()
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:   # new_group's value outside `ranks`
        rank = dist.get_rank() if dist.is_initialized() else "this"
        raise UsageError(f"rank {rank} is not a member of the group given to compile (dist.new_group "
                         "returns a placeholder on the ranks outside it): compile on the group's ranks only, or "
                         "make a group of every rank that runs the pipeline")
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise _not_a_group(group)
    return group, group.rank(), group.size()


def init_from_environment(backend: str, timeout: float) -> None:
    """torchrun's process group, in a store namespace of this attempt's own. A restarted attempt
    (`torchrun --max-restarts`) would otherwise read the addresses the killed attempt's ranks published under
    the same keys (torchrun's agent keeps its store), and gloo would wait on a dead address. Outside torchrun's
    variables, dist.init_process_group's own environment start (and its own error)."""
    env = os.environ
    wait = timedelta(seconds=timeout)
    if not all(k in env for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
        dist.init_process_group(backend, timeout=wait)
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # torchrun's agent hosts the store
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=not agent and rank == 0,
                          timeout=wait, multi_tenant=not agent)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"zbcompile/attempt{attempt}", store), rank=rank,
                            world_size=world, timeout=wait)


def _not_a_group(group) -> UsageError:
    backend = (" A backend name is not a group: call dist.init_process_group(backend) and leave group out, or "
               "pass dist.new_group(ranks, backend=...)." if isinstance(group, str) else "")
    return UsageError(f"group={group!r} ({type(group).__name__}) is not a process group: compile's group takes a "
                      "ProcessGroup (e.g. dist.new_group(ranks)), a 1-D DeviceMesh (or mesh['pp'] of a larger one), "
                      "a 2-D DeviceMesh whose dimensions are named ('dp', 'pp'), or None (the default group of "
                      f"torchrun's environment).{backend}")


# (purpose, the pipeline group's (id, name), ranks) -> the side groups made for it, and whether they span the
# whole world (made with c10d's global synchronization, so destroyed once their pipeline group is)
_SIDE_GROUPS: dict[tuple, tuple[tuple, bool]] = {}


def _side_groups(pg, timeout: float, purpose: str, count: int, *, tune_gloo_threads: bool) -> tuple | None:
    """`count` more groups over the pipeline group's ranks for `purpose`, made once per pipeline group and reused
    by every compile on it; None for a one-rank pipeline or a group that is not a torch.distributed ProcessGroup
    (tests' stand-ins). `tune_gloo_threads`: run the new groups' gloo I/O threads low (runtime/host.py)."""
    if pg is None or pg.size() < 2 or not isinstance(pg, dist.ProcessGroup) or not dist.is_initialized():
        return None
    ranks = dist.get_process_group_ranks(pg)
    live = live_process_groups()
    _retire_orphans(live)
    key = (purpose, (id(pg), process_group_name(pg)), tuple(ranks))
    if key in _SIDE_GROUPS and all(g in live for g in _SIDE_GROUPS[key][0]):
        return _SIDE_GROUPS[key][0]
    backend = dist.get_backend(pg)
    tune = tune_gloo_threads and backend == "gloo"
    before = process_threads() if tune else set()
    # over the whole world every rank makes them, in the same order: c10d's global synchronization names them by
    # its counter, which no later group takes again, so they can be destroyed with their pipeline group. Over
    # part of it (pp x dp) only the pipeline's ranks do: a group named by its ranks, whose name a group made
    # after a destroy would take, finding the destroyed one's stale addresses in the store, so those are kept
    whole = len(ranks) == dist.get_world_size()
    groups = tuple(dist.new_group(ranks, timeout=timedelta(seconds=max(timeout, 1.0)), backend=backend,
                                  use_local_synchronization=not whole) for _ in range(count))
    if tune:   # only the threads these groups started
        tune_io_threads(process_threads() - before)
    for g in groups:
        if g.rank() != pg.rank():  # new_group numbers ranks in sorted order; programs use pg's numbering
            raise UsageError(f"the pipeline group's ranks {ranks} are not in ascending order, so {purpose} groups "
                             f"over them would number the ranks differently; pass a group with sorted ranks")
    _SIDE_GROUPS[key] = groups, whole
    return groups


def _retire_orphans(live) -> None:
    """Forget the side groups of pipeline groups destroyed since (dist.destroy_process_group: a job that makes a
    group per trial), destroying those that span the world: each holds sockets and gloo threads, and a job that
    kept every trial's would run out of files."""
    owners = {(id(g), process_group_name(g)) for g in live}
    for key in [k for k in _SIDE_GROUPS if k[1] not in owners]:
        groups, whole = _SIDE_GROUPS.pop(key)
        for g in groups if whole else ():
            if g in live:
                dist.destroy_process_group(g)


def p2p_channels(pg, timeout: float) -> tuple | None:
    """Two groups over the pipeline group's ranks, one per P2P direction (StepContext explains why), made
    once per pipeline group and reused by every compile on it. None for a one-rank pipeline or a group that
    is not a torch.distributed ProcessGroup (tests' stand-ins), which then carries both directions."""
    return _side_groups(pg, timeout, "P2P", 2, tune_gloo_threads=True)


def collective_group(pg, timeout: float):
    """A group over the pipeline group's ranks for the vocabulary layers' collectives: on a device each group has
    its own stream, so the collectives never queue behind P2P (made once per pipeline group). The pipeline
    group itself for a one-rank pipeline or a stand-in group."""
    own = getattr(pg, "collective_group", None)   # a stand-in group (runtime.loopback) brings its own
    if own is not None:
        return own()
    found = _side_groups(pg, timeout, "collective", 1, tune_gloo_threads=False)
    return pg if found is None else found[0]


def ready_group(pg, timeout: float):
    """A group over the pipeline group's ranks whose own timeout is `timeout`, for the wait at the end of compile
    (agreement.wait_until_compiled): on gloo a group's timeout ends any wait on it, and a group compile made has
    the step's timeout. Made before the stage graphs are built, while the ranks are together, once per pipeline
    group; the pipeline group itself for a one-rank pipeline or a stand-in group."""
    found = _side_groups(pg, timeout, "ready", 1, tune_gloo_threads=False)
    return pg if found is None else found[0]


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def to_device(example, device: torch.device):
    """`example` with every tensor on `device`."""
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, example)


def device_for(model: nn.Module, pg) -> torch.device:
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    if pg is not None and dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# set by keep_only on a model and each of its modules: the number of ranks whose pipeline placed it (from 2 on,
# each rank dropped the others' state to meta: the module is no whole module any more on every rank)
PLACED = "_zbcompile_placed"


def keep_only(model: nn.Module, params: Sequence[str], buffers: Sequence[str], device: torch.device,
               init_fn, ranks: int = 2) -> None:
    """Drop (to meta) what this rank does not use; give real storage to owned meta tensors and initialize them.
    The model and each of its modules are marked placed by a pipeline of `ranks` ranks (PLACED)."""
    keep = {id(model.get_parameter(n)) for n in params}
    keep_buf = {id(model.get_buffer(n)) for n in buffers}
    swapped: dict[int, torch.Tensor] = {}
    to_init: dict[int, nn.Module] = {}
    with torch.no_grad():
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in swapped:
                    if id(p) in keep:
                        swapped[id(p)] = p if not p.is_meta else nn.Parameter(
                            torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                    else:
                        swapped[id(p)] = p if p.is_meta else nn.Parameter(
                            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                new = swapped[id(p)]
                if new is not p:
                    mod._parameters[name] = new
                    if not new.is_meta:
                        to_init[id(mod)] = mod
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) in keep_buf and b.is_meta:
                    mod._buffers[name] = torch.zeros_like(b, device=device)
                    to_init[id(mod)] = mod
                elif id(b) not in keep_buf and not b.is_meta:
                    mod._buffers[name] = torch.empty_like(b, device="meta")
        # (compile_with refuses the model from now on: the other ranks' state is gone from it)
        for mod in model.modules():   # (a module shared with another model is refused there too: check_hooks)
            object.__setattr__(mod, PLACED, ranks)
        # each rank initializes only its share, drawing from the global generators as much as that share needs:
        # they are put back after, so that they stay the same on every rank (a DataLoader shuffled after compile
        # hands every rank the same batches, as a model built whole would)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for mod in to_init.values():
                if init_fn is not None:
                    init_fn(mod)
                elif hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
                else:
                    raise UsageError(f"cannot initialize {type(mod).__name__} built on the meta device: it has no "
                                     f"reset_parameters(); pass init_fn=... to zbcompile.compile")


def sync_copies(model: nn.Module, staged: StagedModel, schedule: Schedule, rank: int, pg, timeout: float) -> None:
    """Make every copy of a parameter / buffer held by several ranks equal to the lowest rank's copy."""
    if pg is None:
        return
    works = []
    for tag, (name, ranks) in enumerate(holders(schedule, staged).items()):
        if len(ranks) < 2 or rank not in ranks:
            continue
        t = model.get_buffer(key_of(name)) if role_of(name) is Role.BUFFER else model.get_parameter(name)
        first = ranks[0]
        if rank == first:
            works += [pg.send([t.detach()], q, tag) for q in ranks if q != rank]
        else:
            works.append(pg.recv([t.detach()], first, tag))
    for w in works:
        if w.wait(timedelta(seconds=timeout)) is False:
            raise RuntimeFailure(f"rank {rank}: making shared parameter copies equal timed out")
