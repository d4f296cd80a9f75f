"""A rank's rows of the vocabulary parameters (vocabulary parallelism): what zb.compile's ranks and the
loopback test world's ranks both hold before their programs run.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from zbcompile.errors import RuntimeFailure

__all__ = ["shard_vocab_params"]


def shard_vocab_params(model: nn.Module, vocab, rank: int, pg, *, initialized_here: bool,
                       timeout: float) -> dict[str, nn.Parameter]:
    """Replace each vocabulary parameter of `model` (VocabLayers.params) by this rank's rows of it, rows
    [rank * rows, (rank + 1) * rows), zero rows past the vocabulary: a Parameter of its own under every name of
    the original (a tied embedding / head stays one Parameter). A table each rank initialized itself (a model
    built on the meta device) is first made rank 0's everywhere, so the shards are of one table. Returns
    {name: shard}."""
    lo = rank * vocab.rows
    shards: dict[str, nn.Parameter] = {}
    with torch.no_grad():
        for name in vocab.params:
            full = model.get_parameter(name)
            if initialized_here and pg is not None and pg.size() > 1:
                options = dist.BroadcastOptions()
                options.rootRank = 0
                work = pg.broadcast([full.data], options)
                if work.wait(timedelta(seconds=timeout)) is False:
                    raise RuntimeFailure(f"rank {rank}: sharing the initial {name} timed out")
            rows = full[lo:lo + vocab.rows]
            pad = vocab.rows - rows.shape[0]
            if pad:
                rows = torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))])
            shard = nn.Parameter(rows.clone(), requires_grad=full.requires_grad)
            for mod in model.modules():
                for attr, p in list(mod._parameters.items()):
                    if p is full:
                        mod._parameters[attr] = shard
            shards[name] = shard
    return shards
