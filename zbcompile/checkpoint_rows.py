"""Vocabulary parallelism in checkpoints: each rank holds rows of the vocabulary tables under their full names,
and DCP sees those entries (with their optimizer state) as row-sharded DTensors of the whole tables, so a
checkpoint holds whole tables and any layout reads back the rows it holds (zbcompile/checkpoint.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["vocab_rows", "row_shards", "as_live", "vocab_names", "rows_of_whole_tables"]


def vocab_rows(module: nn.Module):
    """(VocabLayers, process group, this rank's first row) of a vocabulary-parallel pipe; None otherwise."""
    vocab = getattr(getattr(module, "staged", None), "vocab", None)
    pg = getattr(module, "process_group", None)
    if vocab is None or not (pg is not None and dist.is_initialized()):
        return None   # one rank holds the whole tables
    return vocab, pg, pg.rank() * vocab.rows


def row_shards(state: dict[str, dict], module: nn.Module):
    """`state` with every entry of a vocabulary parameter (under each of its names, and its optimizer state)
    as a row-sharded DTensor of the whole table, so that DCP writes one table assembled from every rank's rows
    and reads back the rows of any layout (vocabulary-parallel at another pp, or not); and, per such entry,
    the rank's whole tensor the DTensor views (its padding rows are no part of the table)."""
    found = vocab_rows(module)
    whole: dict[tuple[str, str], torch.Tensor] = {}
    if found is None:
        return state, whole
    vocab, pg, lo = found
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    names = vocab_names(module, vocab)
    mesh = None
    for part, entries in state.items():
        for key, value in list(entries.items()):
            fqn = key if part == "model" else key.removeprefix("state.").rpartition(".")[0]
            if fqn not in names or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            live = value
            if isinstance(value, DTensor):   # sharded over the data-parallel replicas too: this rank's rows whole
                value = value.full_tensor()
            mesh = mesh or DeviceMesh.from_group(pg, value.device.type)
            rows = max(0, min(vocab.rows, vocab.size - lo))
            shape = torch.Size((vocab.size, *value.shape[1:]))
            entries[key] = DTensor.from_local(value[:rows], mesh, [Shard(0)], run_check=False, shape=shape,
                                              stride=torch.empty(shape, device="meta").stride())
            whole[part, key] = (value, live)
    return state, whole


def as_live(read: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(a tensor read whole, the live entry it is for) -> the tensor in the live entry's form: itself, or where
    the data-parallel replicas shard the entry (a DTensor), this replica's rows of it as a DTensor like the live
    one (a vocabulary row shard read back, a whole tensor handed to PipelineModule.load_state_dict)."""
    value, live = read
    if value is live or not hasattr(live, "device_mesh"):
        return value
    from torch.distributed.tensor import DTensor, Shard

    if live.placements[0] != Shard(0):   # replicated: the whole tensor on every replica
        return DTensor.from_local(value, live.device_mesh, live.placements, run_check=False)
    n, d = live.device_mesh.size(), live.device_mesh.get_local_rank()
    c = -(-value.shape[0] // n)
    return DTensor.from_local(value[d * c:(d + 1) * c].clone(), live.device_mesh, live.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def vocab_names(module: nn.Module, vocab) -> set[str]:
    """Every name of the vocabulary parameters in the module's state dict (a tied one has two)."""
    sharded = {id(module.model.get_parameter(n)) for n in vocab.params}
    return {name for name, t in module.state_dict(keep_vars=True).items() if id(t) in sharded}


def rows_of_whole_tables(pipe: nn.Module, state_dict, live):
    """`state_dict` for a PipelineModule's load_state_dict, with each whole table of a vocabulary parameter ([V,
    ...] where this rank holds [rows, ...]) cut to this rank's rows, zero rows past the vocabulary, as the split
    sharded it (the plain model's state dict loads as it is). `live`: the pipe's own state dict (keep_vars)."""
    vocab = pipe.staged.vocab
    if vocab is None:
        return state_dict
    sharded = {id(pipe.get_parameter(n)) for n in vocab.params}
    lo = pipe.rank * vocab.rows
    changed = {}
    for key, value in state_dict.items():
        mine = live.get(key)
        if (id(mine) not in sharded or not isinstance(value, torch.Tensor) or value.dim() == 0
                or value.shape[0] != vocab.size or tuple(value.shape[1:]) != tuple(mine.shape[1:])
                or vocab.size == vocab.rows):
            continue
        rows = value[lo:lo + vocab.rows]
        changed[key] = torch.cat([rows, rows.new_zeros((vocab.rows - rows.shape[0], *rows.shape[1:]))])
    if not changed:
        return state_dict
    out = copy.copy(state_dict)   # (an OrderedDict's copy keeps its _metadata: the modules' versions)
    out.update(changed)
    return out
