"""Run one rank's program for one training step under torch.distributed, and time it.

`RankRuntime` feeds the emitted program (an fx GraphModule) its inputs, runs it, gathers the loss and
per-action times from every rank and exports them as a Chrome trace. Host overhead per action is kept to a
few Python calls: the program is generated code (no interpreter, no per-action dispatch tables), and a
timing stamp is one `perf_counter()` stored into a preallocated array.
"""

from __future__ import annotations

import array
import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import fx

from zbcompile.errors import CaptureError, DisagreementError, RuntimeFailure, UsageError
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.values import Role, key_of, parse
from zbcompile.runtime import labelled
from zbcompile.runtime.abi import Redo, StepContext, wait
from zbcompile.runtime.host import retain_freed_cpu_memory

__all__ = ["RankRuntime", "StepTimings", "data_specs", "said_call", "CALL_BITS"]

# a call's number (RankRuntime.call) is pipe * 2**CALL_BITS + the call's count: see said_call
CALL_BITS = 32


@dataclass(frozen=True)
class StepTimings:
    """Per-action start / end (seconds from the step's first start, on a clock shared by the host's ranks)
    for every rank, and the measured bubble per rank: 1 - busy / span, span = the whole step."""

    actions: tuple[tuple[tuple[str, float, float], ...], ...]
    span: float

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(e - s for _, s, e in row) for row in self.actions)

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(1.0 - b / self.span if self.span > 0 else 0.0 for b in self.busy)

    def chrome_trace(self) -> dict:
        events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "zbcompile step"}}]
        for r, row in enumerate(self.actions):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
            for name, s, e in row:
                kind = name.lstrip("0123456789").rstrip("0123456789")
                events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": r,
                               "ts": s * 1e6, "dur": (e - s) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str) -> str:
        with open(path, "w") as fh:
            json.dump(self.chrome_trace(), fh)
        return path


# ---- the runner -----------------------------------------------------------------------------------
_AUTOCAST_DEVICES = ("cpu", "cuda")


class RankRuntime:
    """Runs `program` (the emitted GraphModule of `ir`) once per step.

    params / buffers: canonical fqn -> live tensor for every param:/buffer: the program reads.
    pg: the pipeline's ProcessGroup (pipeline rank = its group rank); None runs a one-rank pipeline.
    channels: (up, down) groups over the same ranks for P2P, one per direction (see abi.StepContext).
    constants: fixed program inputs besides params and buffers (vocab:offset); collectives: the group the
    vocabulary layers' collectives run on (default: pg); replicas: the data-parallel group the program's gradient
    buckets are averaged over (None: one replica).
    cuda_graphs: run the step as one captured CUDA graph after `warmup` eager steps (runtime/graphs.py); the
    program must be lowered for capture (passes.lower.CAPTURE_FINISHING). graph_api: the capture API (default:
    graphs.capture_api(device), torch.cuda's; tests pass a stand-in).
    peers: every rank's RankProgram (ir among them): the timings name every rank's actions, every rank's
    gathered row has room for the busiest rank's, and the batch check knows every argument's shape.
    """

    def __init__(self, ir: RankProgram, program: fx.GraphModule, *, pg, device: torch.device,
                 params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                 peers: Sequence[RankProgram], timeout: float = 60.0, channels: tuple | None = None,
                 constants: Mapping[str, torch.Tensor] | None = None, collectives=None,
                 cuda_graphs: bool = False, graph_api=None, warmup: int = 2, profiled=None, replicas=None):
        self.ir = ir
        self.program = program
        # profiled() -> the program with a torch.profiler range per action (emit_fx's profile), made on the first
        # step a profiler records
        self._profiled, self._profiled_program = profiled, None
        if device.type == "cpu":
            retain_freed_cpu_memory()
        peers = tuple(peers)
        size = 1 if pg is None else pg.size()
        if len(peers) != size or peers[ir.rank] is not ir and peers[ir.rank] != ir:
            raise UsageError(f"RankRuntime of rank {ir.rank}: peers must be every rank's RankProgram in rank order "
                             f"({size} for this process group), this rank's among them; got {len(peers)}")
        self.pg = pg
        self.device = device
        self.timeout = timeout
        self.num_ranks = len(peers)
        m = ir.microbatches
        # every rank's action names, for the timings record; built once, not per step
        self._names = tuple(tuple(str(op.action) for op in p.run_ops()) for p in peers)
        self.names = self._names[ir.rank]
        self._stamps = 2 * len(self.names)   # this rank's timing slots: a start and an end per action
        self.max_actions = max(len(n) for n in self._names)
        # as many slots as the busiest rank has: every rank's gathered row has the same length
        # the gathered row: [loss sum, start / end of every action, whether this rank trains a parameter
        # (self.trains), the caller's call number (self.call)]
        self.ctx = StepContext(pg, ir.rank, device, timeout, 2 * self.max_actions + 2, ranks=self.num_ranks,
                               channels=channels, buffers=ir.buffers, collectives=collectives,
                               host_buffers=ir.host_buffers, event_timing=ir.event_timing, replicas=replicas)
        # the seed gradient 1 / m, in the loss's dtype (a float64 or bfloat16 model's backward takes no float32 seed)
        self.grad_loss = torch.full((), 1.0 / m, dtype=seed_dtype(ir), device=device)
        self._fixed = {}
        for n in ir.inputs:
            value = parse(n)
            if value.role is Role.PARAM:   # zero.param: the Parameter (a DTensor shard); param: its tensor
                p = params[value.key]
                self._fixed[n] = p if value.scope == "zero" else getattr(p, "_local_tensor", p)
            elif value.role is Role.BUFFER:
                self._fixed[n] = buffers[value.key]
        self._fixed["grad_loss"] = self.grad_loss
        self._fixed.update(constants or {})   # vocab:offset: the first row of this rank's vocabulary shard
        self._data = [(parse(n).microbatch, parse(n).index) if parse(n).scope == "data" else None
                      for n in ir.inputs]
        # which flat user arguments (model inputs, then targets) this rank's program reads
        self.data_args = tuple(sorted({d[1] for d in self._data if d is not None}))
        # per flat argument the traced microbatch's (shape, dtype), and the whole batch's (m microbatches)
        self.data_specs = data_specs(peers)
        self.batch_specs = {i: (torch.Size((m * shape[0], *shape[1:])), dtype)
                            for i, (shape, dtype) in self.data_specs.items()}
        self._staged = self._stage_inputs(ir, device)
        # the gather's buffers, made once; this rank's row is ctx.row: [loss sum, start / end of every action]
        self._row = torch.frombuffer(self.ctx.row, dtype=torch.float64)
        self._send_row = self._row if device.type == "cpu" else torch.zeros_like(self._row, device=device)
        # on CPU the gathered rows are tensors over Python arrays too: the step reads every rank's loss as a
        # float from its array, where indexing and converting a tensor per rank took ~30 us per step with the
        # caches cold after the gather's wait (2-3% of the runtime's own host time per step, null model)
        self._row_arrays = None
        if device.type == "cpu":
            self._row_arrays = [array.array("d", bytes(len(self.ctx.row) * 8)) for _ in range(self.num_ranks)]
            self._rows = [torch.frombuffer(a, dtype=torch.float64) for a in self._row_arrays]
        else:
            self._rows = [torch.zeros_like(self._send_row) for _ in range(self.num_ranks)]
        self._stepped = False
        # the caller's count of its calls of this kind, refused ones included (PipelineModule sets it): every
        # rank's must be the same, else a call refused on some ranks only paired different batches
        self.call = 0
        # whether a parameter this rank holds requires grad now (PipelineModule sets it), and after a step's
        # gather whether one did on some rank: a model frozen on every rank through pipe.parameters() trains
        # nothing, which no rank sees alone (each sees the others' parameters, on meta, as compiled)
        self.trains, self.some_rank_trains = True, True
        # why a program run stopped half-way (its messages posted, the peers' not matched), or None: the process
        # groups are then in an unknown state (PipelineModule refuses every later call at once)
        self.failed: str | None = None
        self.captured = self._captured_step(graph_api, warmup) if cuda_graphs else None

    def graph_modules(self) -> tuple[fx.GraphModule, ...]:
        """The GraphModules this runtime runs: its program, and the profiled one once a profiler asked for it."""
        return (self.program,) + ((self._profiled_program,) if self._profiled_program is not None else ())

    def _captured_step(self, api, warmup: int):
        from zbcompile.runtime import graphs

        ir = self.ir
        if ir.wait_timeout or not ir.event_timing or self._staged is None:
            raise CaptureError(f"rank {ir.rank}: cuda_graphs needs the program lowered for capture (lower_all's "
                               "finishing=CAPTURE_FINISHING: untimed waits, event timing) with its batch staged in "
                               "static input buffers; `zbcompile inspect ... --capture-check` shows what blocks it")
        api = api if api is not None else graphs.capture_api(self.device)
        static = [(n, t) for n, t in self._fixed.items() if isinstance(t, torch.Tensor)]
        return graphs.CapturedStep(program=self.program, ctx=self.ctx, args=self._staged[1],
                                   grads=graphs.accumulated_params(ir, self._fixed), static=static,
                                   agree=self.agree, api=api, warmup=warmup, timeout=self.timeout, rank=ir.rank)

    def agree(self, value: float, what: str) -> None:
        """Every rank reaches this point with the same `value` (one all-gather on the pipeline's group, which is
        also a barrier); CaptureError names the ranks' values where they differ."""
        if self.pg is None:
            return
        values = self.allgather(torch.tensor([value], dtype=torch.float64), f"agreeing to {what}")[:, 0].tolist()
        if len(set(values)) > 1:
            raise CaptureError(f"rank {self.ir.rank}: the ranks disagree when to {what} (per rank: {values}); every "
                               "rank must capture the same step: compile every rank with the same cuda_graphs "
                               "options")

    def allgather(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `values` (a small 1-d tensor, the same length on every rank) stacked in rank order, through
        the pipeline's group, on this rank's device: the same bits on every rank. RuntimeFailure names `what`
        where a peer is gone or the wait runs past the timeout."""
        mine = values.to(self.device)
        if self.pg is None:
            return mine[None]
        # a header of fixed size first (runtime/labelled.py): ranks in different calls get DisagreementError,
        # not gloo's uncatchable abort on a size mismatch; a small payload rides in it
        heads = self._gather_rows(labelled.header(mine.reshape(-1), what).to(self.device), what)
        labelled.check_headers(heads, self.ir.rank)
        if mine.numel() <= labelled.INLINE:
            rows = labelled.inline_values(heads, mine.numel()).to(mine.dtype)
            return rows.reshape(self.num_ranks, *mine.shape).contiguous()
        return self._gather_rows(mine, what)

    def _gather_rows(self, mine: torch.Tensor, what: str) -> torch.Tensor:
        got = torch.empty((self.num_ranks, *mine.shape), dtype=mine.dtype, device=self.device)
        try:
            work = self.pg.allgather([list(got.unbind(0))], [mine])
        except Exception as e:
            raise RuntimeFailure(f"rank {self.ir.rank}: {what} failed: {e}") from e
        wait(self.ctx, work, what, "(an all-gather on the pipeline's group)", None)
        return got

    def forget_last_step(self) -> None:
        """last_step None until the next step gathers timings (a step ran that gathered none)."""
        self._stepped = False

    @property
    def last_step(self) -> StepTimings | None:
        """The last step's per-action times on every rank; assembled when asked for, not on every step."""
        if not self._stepped:
            return None
        rows = self._row_arrays if self._row_arrays is not None else [r.cpu().tolist() for r in self._rows]
        t0 = min(float(r[1]) for r, names in zip(rows, self._names) if names)
        actions = tuple(
            tuple((name, float(r[1 + 2 * j]) - t0, float(r[2 + 2 * j]) - t0) for j, name in enumerate(names))
            for r, names in zip(rows, self._names))
        span = max((row[-1][2] for row in actions if row), default=0.0)
        return StepTimings(actions, span)

    def _stage_inputs(self, ir: RankProgram, device: torch.device):
        """With ir.staged_inputs: ((argument index, input buffer) pairs, the program's arguments with fixed
        microbatch views of the buffers); None runs on fresh slices of each batch."""
        if not ir.staged_inputs or any(i not in self.batch_specs for i in self.data_args):
            return None
        bufs = {i: torch.empty(self.batch_specs[i][0], dtype=self.batch_specs[i][1], device=device)
                for i in self.data_args}
        views = {i: b.chunk(ir.microbatches) for i, b in bufs.items()}
        args = [self._fixed[n] if d is None else views[d[1]][d[0]] for n, d in zip(ir.inputs, self._data)]
        return tuple(bufs.items()), args

    def step_batch(self, batch: Sequence[torch.Tensor]) -> float:
        """Run this rank's program on the whole batch (flat user arguments, already checked against the traced
        microbatch shapes, split on dim 0 into num_microbatches); returns the batch's mean loss."""
        if self._staged is None:
            return self.step(self._microbatches(batch))
        return self._run(self._staged_arguments(batch))

    def run_step(self, batch: Sequence[torch.Tensor]):
        """step_batch without the loss's all-gather: what the program returns (this rank's loss sum or None). A
        post-validated step (zbcompile/post_validation.py) carries the loss along its prefix chain instead."""
        if self._staged is None:
            return self._execute(self._arguments(self._microbatches(batch)))
        return self._execute(self._staged_arguments(batch))

    def _staged_arguments(self, batch: Sequence[torch.Tensor]) -> list:
        bufs, args = self._staged
        for i, buf in bufs:   # one copy per argument; the microbatch views were cut when the buffers were made
            buf.copy_(batch[i])
        return args

    def measure_step(self, batch: Sequence[torch.Tensor], method: str = "auto"):
        """step_batch(batch), measuring the memory the step allocates (runtime/memory.py: the CUDA allocator's
        peak, or a storage tracker on CPU or with method="tracker"); returns (loss, MemoryMeasurement)."""
        from zbcompile.runtime.memory import measure

        return measure(lambda: self.step_batch(batch), self.device, method)

    def step(self, data: Sequence[Sequence[torch.Tensor] | None]) -> float:
        """Run this rank's program on `data[i][mb]`, microbatch mb of flat user argument i (None for an argument
        this rank does not read, see data_args); returns the batch's mean loss, the same on all ranks."""
        if self.captured is not None:
            raise CaptureError("a captured step reads the batch from its static input buffers: call step_batch "
                               "(PipelineModule.step), which copies the batch into them")
        return self._run(self._arguments(data))

    def run_batch(self, batch: Sequence[torch.Tensor]):
        """Run this rank's program on the whole batch and return what the program returns, without the loss's
        all-gather: a forward returning the model's outputs (`outputs`: every microbatch's out:<k>) or None."""
        return self._execute(self._arguments(self._microbatches(batch)))

    def _microbatches(self, batch: Sequence[torch.Tensor]) -> list:
        """Per flat argument this rank reads, its microbatches on this rank's device (None for the others: a last
        stage needs no inputs)."""
        m = self.ir.microbatches
        data: list = [None] * len(batch)
        for i in self.data_args:
            # contiguous, as the trace made the example (passes/trace.py `_distinct`: a view or an as_strided in
            # a graph reads the strides it was traced with): a batch sliced out of a larger tensor is not
            data[i] = batch[i].to(self.device, non_blocking=True).contiguous().chunk(m)   # m views in one C++ call
        return data

    def _arguments(self, data) -> list:
        """The program's arguments: the fixed inputs, and microbatch mb of argument i where it reads data."""
        return [self._fixed[n] if d is None else data[d[1]][d[0]] for n, d in zip(self.ir.inputs, self._data)]

    def _run(self, args: list) -> float:
        return self._gather(self._execute(args))

    def _execute(self, args: list):
        # grad mode off by the C switch and the generated forward called directly: the no_grad object and
        # nn.Module.__call__ cost tens of microseconds per step when the caches are cold after a barrier
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        # autocast off too: the graphs hold the casts the trace made under the step's region, and the region
        # applied again would cast again, wrongly where the model turned it off for a part (a float32 head)
        autocast = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
        for d in autocast:
            torch.set_autocast_enabled(d, False)
        ctx = self.ctx
        ctx.begin_events()
        try:
            if self.captured is not None:
                loss = self.captured.run(args)
            elif self._profiled is not None and torch.autograd._profiler_enabled():
                if self._profiled_program is None:
                    self._profiled_program = self._profiled()
                loss = self._profiled_program.forward(ctx, *args)
            else:
                loss = self.program.forward(ctx, *args)  # the emitted program has no hooks to run
        except BaseException as e:
            # receives of the failed step may still land in the old buffers; a captured graph, though, holds
            # their addresses, and replacing them would free memory it writes into
            if self.captured is None or not self.captured.captured:
                ctx.renew_buffers()
            # Redo: post-validation runs the step again; CaptureError: refused before any device work
            if not isinstance(e, (Redo, CaptureError)):
                self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            raise
        finally:
            torch._C._set_grad_enabled(grad_was)
            for d in autocast:
                torch.set_autocast_enabled(d, True)
        ctx.read_events(self._stamps)
        return loss

    def _gather(self, loss) -> float:
        """One all-gather per step carries every rank's loss sum, action times, whether it trains a parameter and
        its call number."""
        self._stepped = False  # the rows are rewritten in place: a failed gather leaves no stale "last step"
        self.ctx.row[0] = float(loss) if loss is not None else 0.0
        self.ctx.row[-2] = float(self.trains)
        self.ctx.row[-1] = float(self.call)
        send = self._send_row
        if send is not self._row:
            send.copy_(self._row)
        if self.pg is None:
            self._rows[0].copy_(send)
        else:
            try:
                work = self.pg.allgather([self._rows], [send])
            except Exception as e:
                raise RuntimeFailure(f"rank {self.ir.rank}: gathering the step's loss failed: {e}") from e
            wait(self.ctx, work, "gathering", "the step's loss and timings", None)
        self._stepped = True
        if self._row_arrays is not None:
            read = [(a[0], a[-2], a[-1]) for a in self._row_arrays]
        else:
            read = torch.stack(self._rows)[:, [0, -2, -1]].tolist()   # one copy to the host
        self._check_calls([int(call) for *_, call in read])
        self.some_rank_trains = any(trains for _, trains, _ in read)
        return sum(loss for loss, *_ in read) / self.ir.microbatches

    def _check_calls(self, calls: list[int]) -> None:
        """DisagreementError on every rank where the ranks' call numbers differ (the step has run: its messages
        all matched, but between different calls, so its loss and gradients mix two batches, or two pipelines'
        steps: pipes of one job share the P2P groups, and a call's number carries its pipe's, see said_call)."""
        if len(set(calls)) > 1:
            seen = "; ".join(f"rank {r}: {said_call(c)}" for r, c in enumerate(calls))
            raise DisagreementError(
                f"rank {self.ir.rank}: the ranks are out of step ({seen}): a call refused on some ranks only (a "
                "batch refused on one rank, an exception caught on one) left them pairing different calls, of one "
                "pipeline or of two, so this step mixed different batches or models and its loss and gradients "
                "are wrong. Refuse or skip a batch on every rank alike (hand every rank the same batch); zero the "
                "gradients and restart the job")


def said_call(value: int) -> str:
    """A call's number as a message says it: `call n`, or `pipe k call n` for a pipeline numbered k at compile
    (the number is k * 2**CALL_BITS + n: PipelineModule._enter)."""
    pipe, call = divmod(int(value), 1 << CALL_BITS)
    return f"pipe {pipe} call {call}" if pipe else f"call {call}"


def seed_dtype(program: RankProgram) -> torch.dtype:
    """The dtype of the loss gradient the program's graphs take (grad:loss placeholders); the default dtype where
    no graph reads it."""
    for g in program.graphs.values():
        if g.gm is None:
            continue
        for name, node in zip(g.inputs, g.gm.graph.find_nodes(op="placeholder")):
            val = node.meta.get("val")
            if parse(name).role is Role.GRAD_LOSS and val is not None:
                return val.dtype
    return torch.get_default_dtype()


def data_specs(programs: Sequence[RankProgram]) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """Microbatch shape and dtype of each flat user argument, read off the data:<i> placeholders of the graphs
    the programs run (every argument some rank reads)."""
    specs = {}
    for p in programs:
        for g in p.graphs.values():
            if g.gm is None:
                continue
            for name, node in zip(g.inputs, g.gm.graph.find_nodes(op="placeholder")):
                val = node.meta.get("val")
                if parse(name).role is Role.DATA and val is not None:
                    specs[int(key_of(name))] = (tuple(val.shape), val.dtype)
    return dict(sorted(specs.items()))
