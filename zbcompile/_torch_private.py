"""Every private PyTorch API zbcompile uses, in one flat list of named re-exports and thin functions.

We run on torch 2.11 to 2.13. Each entry says what it is and on which versions we rely on it; when torch moves
or changes one of them, this file is the only place to edit, and a failed import here names the API that went.
Keep it flat: one name per private API, no logic beyond what hides the private access.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

# aot_export_joint_simple(fn, args, trace_joint=True): forward + backward of a functional fx graph as one joint
# graph (split_fbw); same signature on 2.11-2.13; rejects outputs that alias inputs.
from torch._functorch.aot_autograd import aot_export_joint_simple

# min_cut_rematerialization_partition(joint, args, num_fwd_outputs=k) -> (fw, bw): what the forward saves and
# what the backward recomputes (split_fbw); same signature on 2.11-2.13.
from torch._functorch.partitioners import min_cut_rematerialization_partition

# FakeTensorMode(allow_non_fake_inputs=True): shape-only tensors to trace a stage's joint with (split_fbw);
# unchanged on 2.11-2.13.
from torch._subclasses.fake_tensor import FakeTensorMode

# is_fake(t): whether t is a fake tensor or wraps one (a FunctionalTensor of export's trace); what tells a tensor
# hook registered while the step is traced from one registered on real tensors (passes/functions.py);
# torch._subclasses.fake_tensor, unchanged on 2.11-2.13.
from torch._subclasses.fake_tensor import is_fake

# StorageWeakRef(storage): a hashable key for a (fake) tensor's storage, equal for every view of it, by the
# storage's C++ identity (FakeTensor storages have no data_ptr); what functionalization and the partitioners use,
# in torch.multiprocessing.reductions without a public twin on 2.11-2.13 (passes/lower/offload.py).
from torch.multiprocessing.reductions import StorageWeakRef

# tree_map / tree_leaves: map over / flatten nested fx args and meta["val"] tuples (trace, cost); the module is
# private and has no public twin on 2.11-2.13, its functions are stable there.
from torch.utils._pytree import tree_leaves, tree_map

# TorchDispatchMode: the base class of a mode that sees every aten op run under it (passes/functions.py notes a
# custom Function's random ops with one); torch.utils._python_dispatch, unchanged on 2.11-2.13.
from torch.utils._python_dispatch import TorchDispatchMode

# The generator `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` runs around its block (the saved-
# tensor hooks of the recompute), looked up in its module at every call: the module and the global's name
# (passes/functions.py swaps it while a step is traced); torch.utils.checkpoint, unchanged on 2.11-2.13.
import torch.utils.checkpoint as checkpoint_module  # noqa: E402
NON_REENTRANT_CHECKPOINT = "_checkpoint_without_reentrant_generator"

# The dicts of an nn.Module's state-dict hooks, which Module.state_dict / load_state_dict /
# _load_from_state_dict read (register_state_dict_pre_hook / _post_hook, register_load_state_dict_pre_hook /
# _post_hook fill them); the same attribute names on 2.11-2.13 (zbcompile/share.py).
STATE_DICT_HOOKS = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                    "_load_state_dict_post_hooks")

__all__ = [
    "aot_export_joint_simple",
    "min_cut_rematerialization_partition",
    "FakeTensorMode",
    "is_fake",
    "StorageWeakRef",
    "tree_leaves",
    "tree_map",
    "TorchDispatchMode",
    "checkpoint_module",
    "NON_REENTRANT_CHECKPOINT",
    "STATE_DICT_HOOKS",
    "OpOverload",
    "op_schema",
    "BoxedCodeGen",
    "op_entry_point",
    "live_process_groups",
    "process_group_name",
    "default_group",
    "inductor_decompositions",
    "inductor_lowers",
    "inductor_eager_random",
    "decompositions",
    "inductor_compile",
    "static_fake_mode",
    "tracing_context",
    "make_fx",
    "global_module_hooks",
]

# The class of `torch.ops.aten.<op>.<overload>`, to test "an aten op with a schema" (partition, cost, the alias
# analysis); torch gives it no public name; torch._ops.OpOverload on 2.11-2.13.
OpOverload = torch._ops.OpOverload


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The op's FunctionSchema (arguments, returns and their alias annotations): `OpOverload._schema`, with
    the fields we read (`arguments`, `returns`, `alias_info`, `type`) unchanged on 2.11-2.13."""
    return op._schema

# ---- the lowering and the runtime -------------------------------------------------------------------------
# fx's code generator for the boxed calling convention (inputs in one list the graph clears), which AOTAutograd
# uses for compiled backwards (passes/lower/variants.py); fx.graph._BoxedCodeGen on 2.11-2.13.
BoxedCodeGen = fx.graph._BoxedCodeGen


def op_entry_point(target):
    """The C++ callable behind an aten OpOverload (`OpOverload._op`, 2.11-2.13), or None for anything else:
    calling it skips OpOverload.__call__'s Python frame (passes/lower/variants.py)."""
    return target._op if isinstance(target, OpOverload) else None


def live_process_groups():
    """The process groups torch.distributed still holds: c10d's `_world.pg_map` (2.11-2.13; distributed.py)."""
    return dist.distributed_c10d._world.pg_map


def process_group_name(pg) -> str:
    """c10d's `_get_process_group_name` (2.11-2.13; distributed.py keys its P2P channels by it)."""
    return dist.distributed_c10d._get_process_group_name(pg)


def default_group():
    """c10d's `_get_default_group` (2.11-2.13): the WORLD group as a ProcessGroup object."""
    return dist.distributed_c10d._get_default_group()


# ---- compiled stage graphs (passes/lower/compiled.py) ------------------------------------------------------
# Imported when first called: importing torch._inductor costs about a second, and most programs never use it.

def inductor_decompositions() -> dict:
    """The aten -> simpler-aten decompositions inductor expects its input graph to have had applied (AOTAutograd
    applies them in torch.compile): `torch._inductor.decomposition.select_decomp_table()`, 2.11-2.13."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_eager_random():
    """`torch._inductor.config.patch(fallback_random=True)` (2.11-2.13): inductor runs random ops (dropout,
    rand) as the aten ops themselves, on torch's generator, instead of asserting that its own random-number
    pass (replace_random, which only torch.compile's full path runs) rewrote them; the decomposition table it
    selects then keeps them too. Dropout masks come out as eager's and the plain backend's."""
    import torch._inductor.config as config

    return config.patch(fallback_random=True)


def inductor_lowers(op) -> bool:
    """Whether inductor has a lowering of its own for `op` (`op in torch._inductor.lowering.lowerings`, or its
    packet in `FALLBACK_ALLOW_LIST`, which it falls back on without complaint; 2.11-2.13). For any other op
    with a decomposition in torch._decomp, inductor's graph lowering asserts "a decomposition exists, we should
    switch to it" when the environment variable CI is set (torch._inductor.lowering.make_fallback)."""
    from torch._inductor.lowering import FALLBACK_ALLOW_LIST, lowerings

    return op in lowerings or op.name().split(".")[0] in FALLBACK_ALLOW_LIST


def decompositions(ops) -> dict:
    """torch's own decompositions of `ops` (`torch._decomp.get_decompositions`, 2.11-2.13): an in-place op
    becomes its out-of-place twin followed by `copy_` into the mutated input (`addmm_` -> `addmm`, `copy_`)."""
    from torch._decomp import get_decompositions

    return get_decompositions(list(ops))


def inductor_compile(gm: fx.GraphModule, example_inputs: list):
    """Inductor's compiler for one post-autograd aten graph, without AOTAutograd in front:
    `torch._inductor.compile_fx.compile_fx_inner(gm, example_inputs)` (2.11-2.13), which returns a callable in
    the boxed convention (`fn(list_of_inputs)`, the list emptied on entry) and looks up / fills inductor's own
    FX graph cache when a TracingContext with a ShapeEnv is active.

    Every output keeps its traced strides: each one is another graph's input, compiled for those strides (a
    saved activation, a gradient sent to the previous stage). torch.compile's outer `compile_fx` marks only the
    user's outputs so; unmarked ones inductor may lay out as it likes (a convolution's saved input and weight
    channels-last on CPU, padded strides on CUDA). The mark is the output node's meta
    `user_visible_output_idxs` + `original_output_strides`, which GraphLowering reads (2.11-2.13). The FX
    graph cache's key does not read node meta but does read the GraphModule's own `meta` (its `__reduce__`
    state): a note there keeps entries compiled without the mark from being served."""
    from torch._inductor.compile_fx import compile_fx_inner

    gm.meta["zbcompile_outputs"] = "traced strides"

    out = gm.graph.find_nodes(op="output")[0]
    results = out.args[0] if isinstance(out.args[0], (tuple, list)) else out.args
    vals = [r.meta.get("val") if isinstance(r, fx.Node) else None for r in results]
    out.meta["original_output_strides"] = [v.stride() if isinstance(v, torch.Tensor) else None for v in vals]
    out.meta["user_visible_output_idxs"] = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
    return compile_fx_inner(gm, example_inputs)


def static_fake_mode():
    """A FakeTensorMode with a ShapeEnv (all shapes static): inductor's FX graph cache bypasses graphs compiled
    without one ("No shape env"); `torch.fx.experimental.symbolic_shapes.ShapeEnv`, 2.11-2.13."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def tracing_context(fake_mode):
    """`torch._guards.tracing(TracingContext(fake_mode))` (2.11-2.13): where inductor finds the fake mode and its
    ShapeEnv, as under torch.compile."""
    from torch._guards import TracingContext, tracing

    return tracing(TracingContext(fake_mode))


def make_fx(fn, decomposition_table: dict):
    """`torch.fx.experimental.proxy_tensor.make_fx(fn, decomposition_table, tracing_mode="fake")` (experimental
    module, 2.11-2.13): re-traces an aten graph with decompositions, keeping its in-place ops (no
    functionalization)."""
    from torch.fx.experimental.proxy_tensor import make_fx as trace

    return trace(fn, decomposition_table=decomposition_table, tracing_mode="fake")


def mark_optimizer_stepped(optimizer) -> None:
    """`optimizer._opt_called = True` (2.11-2.13): what torch's wrapped `optimizer.step()` sets and
    `LRScheduler.step()` reads on its first call, to warn that the schedule's first value was skipped. A
    post-validated step that defers a rank's update to its verdict has an update pending, not skipped."""
    optimizer._opt_called = True


def global_module_hooks() -> tuple[dict, dict, dict, dict]:
    """The hooks every module runs (`torch.nn.modules.register_module_forward_hook` and its kin): the dicts
    torch.nn.modules.module keeps them in, `_global_forward_hooks`, `_global_forward_pre_hooks`,
    `_global_backward_hooks`, `_global_backward_pre_hooks` (2.11-2.13), keyed by handle id."""
    from torch.nn.modules import module

    return (module._global_forward_hooks, module._global_forward_pre_hooks, module._global_backward_hooks,
            module._global_backward_pre_hooks)


def fx_sources_made() -> int:
    """How many sources fx's global cache of recompiled code has been given in this process: the N of its next
    `<eval_with_key>.N` (`torch.fx.graph_module._loader.next_id`, 2.11-2.13)."""
    from torch.fx.graph_module import _loader

    return _loader.next_id


def forget_fx_sources(made: range, kept=()) -> None:
    """Drop the sources numbered `made` (fx_sources_made() before and after some work) from fx's global cache,
    with their lazy `linecache` entries, except those of GraphModules under `kept`, which still run (the others
    only lose the source lines of their tracebacks). fx never drops an entry: a process that makes and drops
    programs (a pipe evaluating at many batch sizes) grows by the source of every GraphModule it made."""
    import linecache

    from torch.fx.graph_module import _loader

    live = {type(m).forward.__code__.co_filename for root in kept for m in root.modules()
            if isinstance(m, fx.GraphModule) and hasattr(type(m).forward, "__code__")}
    for name in {f"<eval_with_key>.{i}" for i in made} - live:
        _loader.eval_cache.pop(name, None)
        linecache.cache.pop(name, None)
