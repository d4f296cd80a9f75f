"""CompileOptions: every option `zbcompile.compile` takes, declared once, checked and normalised before anything
is traced.

    options = CompileOptions(schedule="zbv", microbatches=8, loss_fn=loss_fn, example=(inputs, targets))
    options = CompileOptions.from_kwargs(**kwargs)    # what zb.compile(model, **kwargs) does

A bad value raises UsageError naming the option and what it accepts, so a typo costs nothing: tracing a model
takes seconds, inductor minutes. After construction every field holds its normal form (`offload` an int, a
tuple of ints or "auto"; `cuda_graphs` False or the number of eager warm-up steps; `split_points` a tuple or a
dict), so nothing downstream re-checks or re-decodes an option.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from zbcompile.errors import UsageError
from zbcompile.ir.costs import Costs
from zbcompile.ir.schedule import Schedule

__all__ = ["CompileOptions", "WARMUP_STEPS"]

# eager steps before a CUDA graph is captured, for cuda_graphs=True: the first connects every P2P edge and
# allocates .grad, the second runs the step as it will be captured
WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """Everything `zbcompile.compile` takes besides the model.

    schedule: a name for `zbcompile.passes.schedules.generate` (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2,
        zb-auto, zbv, v-min, v-half, v-zb, dualpipe, dualpipev) or a ready Schedule. ScheduleError passes
        through (e.g. too few microbatches).
    microbatches: microbatches per step; every batch handed to `step` splits into this many on dim 0.
    loss_fn: `loss_fn(model(*inputs), *targets)` is the traced step's loss (a 0-dim tensor).
    example: `(inputs, targets)` for ONE microbatch, as `zbcompile.split.split_model` takes it. These four are
        required by compile; a model split already (PipelineModule.from_staged) needs neither loss_fn nor example.
    pp: pipeline ranks; defaults to the size of `group` and must equal it.
    chunks: stages per rank for interleaved-1f1b.
    split_points: where to cut (module names to cut before, `after:<module>`, torch's `split_spec` dict of
        SplitPoints, or `pipe_split:<k>`). Default: the model's `pipe_split()` markers if it has any, else cuts
        balanced per rank for the schedule's placement.
    group: a ProcessGroup, a 1-D DeviceMesh (or a named dimension of one, `mesh["pp"]`), or None for the
        default group (initialized from the torchrun environment when needed: gloo on CPU, NCCL on CUDA). A 2-D
        DeviceMesh with dimensions named "dp" and "pp" runs one pipeline per dp replica, each on its share of
        the global batch, gradients averaged over dp (zbcompile/data_parallel.py).
    costs / mem_limit: read by zb-auto (and costs by zbv / v-zb, which polish their order for uneven costs, and
        by vocab_parallel); given to a schedule that reads neither, compile refuses them (UsageError).
    init_fn: for a model built on the meta device. Each rank gives real storage (on its device) only to the
        parameters and buffers its own stages use, then calls `init_fn(module)` on every module that directly
        holds one of them, or, without init_fn, that module's `reset_parameters()`. Copies of one parameter
        on several ranks (tied weights, DualPipe's mirrored stages) are then made equal from the lowest rank.
    timeout: seconds any wait may block before RuntimeFailure. On CPU the runtime also asks glibc to keep freed
        memory for reuse (`runtime.host.retain_freed_cpu_memory`, a process-wide setting).
    vocab_parallel: shard the input embedding and the output layer + cross-entropy over every rank
        (passes/shard_vocab.py): each rank holds rows [r * V/p, (r + 1) * V/p) of each vocabulary parameter and
        runs 1/p of their work in S, T, IF, IB actions the schedule gets (passes/schedules/vocab.py). The step
        must look up token ids in an embedding and end in `cross_entropy(linear(x, W), targets)`; VocabError
        says what was found otherwise.
    offload: activation offload (PipeOffload; passes/analysis/offload_plan.py). A device-memory budget in bytes
        (one for every rank, or one per rank): each rank's planned peak (`memory_plan()`) must fit it, so the
        saved tensors of the longest-lived forwards are copied to a host pool after their F and back before
        their backward, as few as fit; OffloadError says the smallest budget that works. "auto": offload what
        the time model says hides behind compute. None: no offload. `pipe.offload_report` says what was chosen.
    backend: "inductor" compiles every stage graph (F, B, W, BW and the gradient-accumulating variants) with
        torch inductor (C++ on CPU, Triton on CUDA; passes/lower/compiled.py), once per distinct graph, cached
        across runs by inductor's FX graph cache; None runs the aten stage graphs as they are.
    cuda_graphs: run each rank's whole step as one CUDA graph (runtime/graphs.py): True runs 2 eager warm-up
        steps and captures the third, replaying it from then on; an int n >= 1 runs n warm-up steps. The
        program is lowered for capture and checked (passes/analysis/capture.py: CaptureError with the table of
        what blocks it). .grad stays one persistent tensor per parameter, added into like backward() does;
        parameters must be updated in place. Needs a CUDA device: CaptureError otherwise, never a silent eager
        fallback. Normal form: False, or the number of warm-up steps.
    dp_bucket_mb: with a "dp" mesh dimension, at most this many MiB of gradients in one all-reduce over the
        replicas (0: one per gradient). The gradients that become final together (a stage's, after its last W) are
        bucketed, and each bucket's all-reduce is posted right there, overlapping the rest of the step
        (passes/lower/dp_reduce.py).
    dp_overlap: False posts every data-parallel all-reduce at the end of the step instead (no overlap; for
        comparison).
    dp_w_pieces: with dp_overlap, each of a rank's trailing W's (the run of W's that ends its step) is split
        into this many groups of its parameters' gradients, run stage by stage, so that each group's all-reduce
        overlaps the rest of the tail (passes/lower/dp_reduce.py: finish_grads_in_groups); 1 keeps them whole.
    dp_batch: "global" (step / evaluate / forward take the global batch on every rank, each replica using its
        share) or "local" (each replica is handed its own rows, as with DDP; the loss returned is still the global
        mean, and the outputs of forward are the replica's own).
    dp_shard: sharded data parallelism (ZeRO-3 / FSDP2 semantics) instead of replicated (DDP): every parameter
        of a rank is held as a DTensor sharded on dim 0 over the "dp" mesh dimension (a 0-dim one replicated), so
        its gradient and the optimizer's state are sharded too; the step gathers the whole parameters where its
        actions read them and reduce-scatters each gradient where it is final (passes/lower/dp_shard.py). Needs a
        2-D ("dp", "pp") mesh; with one replica there is nothing to shard and the parameters stay whole.
    dp_gather: with dp_shard, "step" gathers a stage's parameters once, before its first action, and drops them
        after its last (FSDP2's reshard_after_forward=False); "microbatch" gathers them before every action that
        reads them and drops them after it (the least memory, one all-gather per action).
    check_batch: whether step() / evaluate() check that every rank was handed the same batch (a checksum per
        argument, all-gathered; DisagreementError on every rank otherwise): True on the first call only, an
        int n on the first and every n-th call, False never. compile always checks that every rank built the
        same thing (zbcompile/agreement.py).
    """

    schedule: str | Schedule
    microbatches: int
    loss_fn: Callable[..., torch.Tensor] | None = None
    example: object = None
    pp: int | None = None
    chunks: int | None = None
    split_points: Sequence[str] | Mapping | None = None
    group: object = None
    costs: Costs | None = None
    mem_limit: float | None = None
    init_fn: Callable[[nn.Module], None] | None = None
    timeout: float = 60.0
    vocab_parallel: bool = False
    offload: int | str | Sequence[int] | None = None
    backend: str | None = None
    cuda_graphs: bool | int = False
    check_batch: bool | int = True
    dp_bucket_mb: float = 25.0   # DDP's default cap: bandwidth-bound all-reduces, still several per stage
    dp_overlap: bool = True
    dp_w_pieces: int = 4
    dp_batch: str = "global"
    dp_shard: bool = False
    dp_gather: str = "step"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check = _CHECKS.get(field.name)
            if check is not None:
                object.__setattr__(self, field.name, check(getattr(self, field.name)))
        if self.dp_gather != "step" and not self.dp_shard:   # else a choice that changes nothing, silently
            raise UsageError(f"dp_gather={self.dp_gather!r} says when sharded parameters are gathered, but dp_shard "
                             "is off (every replica holds them whole): pass dp_shard=True too, or drop dp_gather")

    def check_ranks(self, ranks: int) -> None:
        """UsageError where an option names another number of pipeline ranks than the group has (once the group
        is known, before any tracing)."""
        if self.pp is not None and self.pp != ranks:
            raise UsageError(f"pp={self.pp} but the process group has {ranks} ranks; launch with "
                             f"`torchrun --nproc-per-node {self.pp}` (or pass a group of {self.pp} ranks)")
        if isinstance(self.offload, tuple) and len(self.offload) != ranks:
            raise UsageError(f"offload has {len(self.offload)} budgets but the pipeline has {ranks} ranks: give "
                             "one budget for every rank, or one int for all of them")

    @classmethod
    def from_kwargs(cls, required: Sequence[str] | None = None, **kwargs) -> CompileOptions:
        """CompileOptions from keyword arguments, with our error for a misspelled or missing option.
        required: the options that must be given (default: what compile needs to trace a model)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise UsageError(f"zbcompile.compile got unknown option(s) {', '.join(map(repr, unknown))}; the options "
                             f"are {', '.join(names)} (see zbcompile.options.CompileOptions)")
        missing = [k for k in (_REQUIRED if required is None else required) if k not in kwargs]
        if missing:
            raise UsageError(f"zbcompile.compile needs {', '.join(missing)}: e.g. zb.compile(model, "
                             "schedule=\"1f1b\", microbatches=8, loss_fn=loss_fn, example=(inputs, targets))")
        return cls(**kwargs)

    @property
    def capture(self) -> bool:
        """Whether each rank's step runs as one CUDA graph."""
        return self.cuda_graphs is not False

    def replace(self, **changes) -> CompileOptions:
        return dataclasses.replace(self, **changes)


# ---- one check per option: the value in its normal form, or UsageError ------------------------------------
def _positive_int(name: str, none_ok: bool):
    def check(value):
        if value is None and none_ok:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name}={value!r}: give a positive int{' or None' if none_ok else ''}")
        return value
    return check


def _schedule(value):
    from zbcompile.passes.schedules import SCHEDULES

    if isinstance(value, Schedule) or (isinstance(value, str) and value in SCHEDULES):
        return value
    raise UsageError(f"schedule={value!r} is not a schedule zbcompile knows; give one of {', '.join(SCHEDULES)}, "
                     "or a zbcompile.Schedule")


def _callable(name: str, none_ok: bool):
    def check(value):
        if (value is None and none_ok) or callable(value):
            return value
        raise UsageError(f"{name}={value!r}: give a callable{' or None' if none_ok else ''}")
    return check


def _split_points(value):
    if value is None or isinstance(value, Mapping):
        return value
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"split_points={value!r}: give a list of module names to cut before (e.g. "
                         "['blocks.2']), torch's split_spec dict, or None to cut balanced by cost")
    return tuple(value)


def _costs(value):
    if value is None or isinstance(value, Costs):
        return value
    if isinstance(value, str):
        return Costs.parse(value)
    raise UsageError(f"costs={value!r}: give a zbcompile.Costs, a string like 'F=1,B=1.1,W=0.6,comm=0.05', or None")


def _positive_number(name: str, none_ok: bool):
    def check(value):
        if value is None and none_ok:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{name}={value!r}: give a finite number > 0{' or None' if none_ok else ''}")
        return value
    return check


def _flag(name: str):
    def check(value):
        if not isinstance(value, bool):
            raise UsageError(f"{name}={value!r}: give True or False")
        return value
    return check


def _offload(value):
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if (isinstance(value, Sequence) and not isinstance(value, str) and value
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)):
        return tuple(value)
    raise UsageError(f"offload={value!r}: give None, \"auto\", a device-memory budget in bytes (an int > 0), or "
                     "one budget per rank")


def _backend(value):
    from zbcompile.passes.lower.compiled import check_backend

    return check_backend(value)


def _cuda_graphs(value):
    if value is False or value is True:
        return WARMUP_STEPS if value else False
    if isinstance(value, int) and value >= 1:
        return value
    raise UsageError(f"cuda_graphs={value!r}: give True ({WARMUP_STEPS} eager warm-up steps, then capture), an int "
                     "n >= 1 (n warm-up steps), or False")


def _check_batch(value):
    if isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise UsageError(f"check_batch={value!r}: give True (check the first batch), an int n >= 1 (the first and "
                     "every n-th), or False (never)")


def _bucket_mb(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
        raise UsageError(f"dp_bucket_mb={value!r}: give a number of MiB >= 0 (0: one all-reduce per gradient)")
    return value


def _dp_gather(value):
    if value not in ("step", "microbatch"):
        raise UsageError(f"dp_gather={value!r}: give \"step\" (a stage's parameters gathered once per step) or "
                         "\"microbatch\" (gathered before every action that reads them, dropped after it)")
    return value


def _dp_batch(value):
    if value not in ("global", "local"):
        raise UsageError(f"dp_batch={value!r}: give \"global\" (every rank is handed the global batch) or \"local\" "
                         "(each data-parallel replica is handed its own rows)")
    return value


# what compile needs to trace a model (compile_staged / from_staged take a model already split: neither)
_REQUIRED = ("schedule", "microbatches", "loss_fn", "example")

_CHECKS = {
    "schedule": _schedule,
    "microbatches": _positive_int("microbatches", none_ok=False),
    "loss_fn": _callable("loss_fn", none_ok=True),
    "pp": _positive_int("pp", none_ok=True),
    "chunks": _positive_int("chunks", none_ok=True),
    "split_points": _split_points,
    "costs": _costs,
    "mem_limit": _positive_number("mem_limit", none_ok=True),
    "init_fn": _callable("init_fn", none_ok=True),
    "timeout": _positive_number("timeout", none_ok=False),
    "vocab_parallel": _flag("vocab_parallel"),
    "offload": _offload,
    "backend": _backend,
    "cuda_graphs": _cuda_graphs,
    "check_batch": _check_batch,
    "dp_bucket_mb": _bucket_mb,
    "dp_overlap": _flag("dp_overlap"),
    "dp_w_pieces": _positive_int("dp_w_pieces", none_ok=False),
    "dp_batch": _dp_batch,
    "dp_shard": _flag("dp_shard"),
    "dp_gather": _dp_gather,
}
