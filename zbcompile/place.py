"""`place`: a compile's result put on this rank of a process group, as a PipelineModule.

    pipe = place(model, compiled, (group, rank, world), dp)

`zbcompile.api.compile_with` calls it after the compiler core (zbcompile/compiler.py) has built every rank's
program; the tests' threaded worlds call it once per rank thread. Before the first message every rank compares
its fingerprint with its peers' (zbcompile/agreement.py), so ranks that built different things refuse together.
"""

from __future__ import annotations

import torch
from torch import nn

from zbcompile.agreement import READY_TIMEOUT, check_agreement, wait_until_compiled
from zbcompile.compiler import Compiled, building
from zbcompile.data_parallel import Replicas
from zbcompile.distributed import (collective_group, device_for, is_meta, keep_only, p2p_channels, ready_group,
                                   shard_vocab_params, sync_copies)
from zbcompile.errors import UsageError
from zbcompile.ir.program.values import VOCAB_OFFSET
from zbcompile.options import WARMUP_STEPS
from zbcompile.passes.lower import emit_fx
from zbcompile.pipeline_module import PipelineModule
from zbcompile.runtime import RankRuntime, abi, graphs

__all__ = ["place"]


@building
def place(model: nn.Module, compiled: Compiled, resolved, dp: Replicas | None = None) -> PipelineModule:
    """This rank's PipelineModule: the parameters and buffers its stages use kept (and initialized where the
    model is on the meta device), copies on several ranks made equal, vocabulary rows cut, the runtime built;
    first of all, every rank's fingerprint of what it built compared (zbcompile/agreement.py)."""
    pg, rank, world = resolved
    schedule, staged, options = compiled.schedule, compiled.staged, compiled.options
    if schedule.num_ranks != world:
        raise UsageError(f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group "
                         f"has {world}")
    replicas = dp.size if dp is not None else 1
    if compiled.replicas != replicas:   # else the gradients would go unaveraged, or be divided wrongly
        raise UsageError(f"the programs were compiled for {compiled.replicas} data-parallel replica(s) but the mesh "
                         f"has {replicas}; compile with the mesh you place on (compile_programs(..., replicas=))")
    # before the first message: ranks (and replicas) that built other things refuse
    check_agreement(model, compiled, (pg, rank), *([(dp.group, dp.rank)] if dp is not None else []))
    device = device_for(model, pg)
    mine = compiled.stages_of(rank)
    vocab = staged.vocab.params if staged.vocab is not None else ()
    owned_params = tuple(dict.fromkeys([p for st in mine for p in st.params] + list(vocab)))
    owned_buffers = tuple(dict.fromkeys(b for st in mine for b in st.buffers))
    was_meta = is_meta(model)
    keep_only(model, owned_params, owned_buffers, device, options.init_fn, ranks=world)
    sync_copies(model, staged, schedule, rank, pg, options.timeout)
    constants = {}
    if staged.vocab is not None:
        shard_vocab_params(model, staged.vocab, rank, pg, initialized_here=was_meta, timeout=options.timeout)
        constants[VOCAB_OFFSET] = torch.tensor(rank * staged.vocab.rows, device=device)
    params = {n: model.get_parameter(n) for n in owned_params}
    buffers = {n: model.get_buffer(n) for n in owned_buffers}
    if dp is not None:   # replicas start from replica 0's values, as DDP does (sharded: each keeps its rows)
        params = dp.start(model, params, buffers, device)
    channels = p2p_channels(pg, options.timeout)
    ready = ready_group(pg, max(options.timeout, READY_TIMEOUT))   # made now, while the ranks are together
    collectives = collective_group(pg, options.timeout) if staged.vocab is not None else None

    def runtime_for(programs, **graphs) -> RankRuntime:
        """A runtime of this rank's program of `programs` (the training step, or an evaluation step built later)
        over this rank's parameters, buffers and groups."""
        return RankRuntime(programs[rank], emit_fx(programs[rank], abi), pg=pg, device=device, params=params,
                           buffers=buffers, timeout=options.timeout, channels=channels, peers=programs,
                           constants=constants, collectives=collectives,
                           replicas=dp.group if dp is not None else None,
                           profiled=lambda: emit_fx(programs[rank], abi, profile=True), **graphs)

    runtime = runtime_for(compiled.programs, cuda_graphs=options.capture,
                          warmup=options.cuda_graphs or WARMUP_STEPS,
                          graph_api=graphs.capture_api(device) if options.capture else None)
    pipe = PipelineModule(model, compiled, runtime, rank, owned_params, owned_buffers, pg, runtime_for=runtime_for,
                          dp=dp)
    pipe._pipe_number = wait_until_compiled(ready, rank, options.timeout)
    return pipe
