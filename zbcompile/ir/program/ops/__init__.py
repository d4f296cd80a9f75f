"""Op kinds of the rank-program IR, each defined once: one `OpSpec` per kind holds everything a pass, a
check, the emitter or the runtime needs to know about it.

    spec part   what it says                                         who reads it
    meaning     one line                                             printing, docs
    args        the record of the kind's static arguments (typed)    passes, emitter
    text        the call's name in the printed program; format /     RankProgram.to_text / from_text
                parse of the arguments between its parentheses
    aliases     which outputs may share memory with which inputs     buffers.py (static receive buffers)
    keeps       whether the op may hold an input beyond the step     buffers.py
    fresh       per output, the bytes of fresh memory it allocates   passes/analysis/memory (memory plan)
    posts       the messages a posting op puts on the wire           validate.py, order_p2p.py, streams.py
    sync        none / posts P2P / waits on P2P / collective          validate.py (deadlock), streams.py
    stream      compute / comm / copy / host                         streams.py (device-stream deadlock),
                                                                     passes/analysis/offload_plan.py (time)
    copy_bytes  the bytes a copy-stream op copies (None: it waits)   passes/analysis/offload_plan.py (time)
    emit        the emitter's method for it                          passes/lower/emit.py
    runtime     the runtime ABI functions its code calls             zbcompile/runtime/abi.py
    capture     "safe" for CUDA-graph capture of the whole step, or  passes/analysis/capture.py
                why not (a string, or a function of the op and its
                program where the answer depends on them)
    fix         how to make it safe where `capture` can say no       passes/analysis/capture.py

A row names what its kind decides; the rest has the default of a kind that reads its inputs and does nothing
else the checks see (OpSpec). The package is laid out by family, each kind's args record, text form, rules and
row together in one module:

    _spec.py         the machinery: OpKind, Op, OpSpec and its defaults, TensorType, Sync, Stream, SPECS
    compute.py       RUN, FREE, ACCUM, SUM, SET_GRAD, ADD_LOSS, COPY_BUFFER, STAMP
    p2p.py           RECV, WAIT_RECV, SEND, WAIT_SEND
    collectives.py   COLLECTIVE, WAIT_COLL
    data_parallel.py DP_REDUCE, WAIT_DP, DP_GATHER, WAIT_GATHER
    host_copies.py   OFFLOAD, WAIT_OFFLOAD, RELOAD, WAIT_RELOAD
    step_boundary.py PREFIX, TOTALS, VALIDATE (post-validation)

A new kind (a collective, an overlapped F&B run) is one OpKind member and, in one family module, its args
record and OpSpec row; tests/ir/test_op_specs.py fails while any part is missing, and the checks refuse a kind
whose synchronisation they do not model instead of guessing. docs/design.md walks through adding one.
"""

from __future__ import annotations

from zbcompile.ir.program.ops import collectives, compute, data_parallel, host_copies, p2p, step_boundary
from zbcompile.ir.program.ops._spec import (CUDA_BLOCK, SAFE, SPECS, Op, OpKind, OpSpec, Stream, Sync, TensorType,
                                            allocated_bytes, install, spec, spec_by_text)
from zbcompile.ir.program.ops.collectives import Coll, CollArgs
from zbcompile.ir.program.ops.data_parallel import DPArgs, GatherArgs, padded_shard_bytes, shard_rows
from zbcompile.ir.program.ops.compute import AccumArgs, AccumMode, RunArgs, SetGradArgs, StampArgs
from zbcompile.ir.program.ops.host_copies import HostArgs, View, ViewArgs
from zbcompile.ir.program.ops.p2p import Message, RecvArgs, SendArgs
from zbcompile.ir.program.ops.step_boundary import ValidateArgs

__all__ = ["OpKind", "Sync", "Stream", "TensorType", "CUDA_BLOCK", "allocated_bytes", "Message", "RunArgs",
           "RecvArgs", "SendArgs", "Coll", "CollArgs", "DPArgs", "GatherArgs", "shard_rows", "padded_shard_bytes",
           "HostArgs", "View", "ViewArgs", "AccumArgs", "AccumMode", "SetGradArgs", "StampArgs", "ValidateArgs", "Op",
           "OpSpec", "SAFE", "SPECS", "FAMILIES", "spec", "spec_by_text"]

# the family modules, each declaring its kinds' rows (ROWS); SPECS holds them in OpKind order
FAMILIES = (compute, p2p, collectives, data_parallel, host_copies, step_boundary)
install(row for family in FAMILIES for row in family.ROWS)
