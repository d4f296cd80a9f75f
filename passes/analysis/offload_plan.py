"""plan_offload: what each rank offloads to fit a device-memory budget, and what the copies are expected to cost.

The memory plan (memory.py) says what a rank needs; insert_offload (passes/lower/offload.py) moves a chosen
F's saved tensors to host memory and back. The planner chooses, per rank and independently (offload is
local to a rank), PipeOffload's selective strategy: the F actions whose saved tensors live longest go first,
because removing them removes their whole share of the peak. It takes the shortest such prefix whose planned
device peak fits the budget, trying the placements with the most overlap first: the offload waited one action
after F and the reload issued one action before its reader (both copies can hide behind compute); then the
offload waited before the next action; then the reload right before its reader (prefetch 0: it cannot
overlap compute then, but it no longer overlaps the previous action's activations either). When even every
candidate offloaded just in time does not fit, OffloadError gives the smallest budget that works, per rank.

Time: a per-rank model of the program on a device (`Device`): a RUN op takes its graph's roofline time
(FLOPs / throughput, or bytes / memory bandwidth, whichever is longer; passes/cost.py counts both), copies
queue on one copy stream at `copy_bandwidth` and a wait stalls compute until its copy is done (which ops are
copies and waits, and how many bytes a copy moves, is read off their OpSpec: stream, copy_bytes). It gives
the offload ratio k = (time to copy a unit's tensors out and back) / (its F + B + W time), the paper's
criterion (k <= 1: the copies can hide behind compute), and the expected slowdown of each rank's own
compute timeline. P2P waits are not modelled here: a stalled rank also delays its peers.

    "auto": offload the longest-lived units as long as the modelled slowdown stays within 1% (what is free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from zbcompile.errors import OffloadError, ZBCompileError
from zbcompile.passes.analysis.memory import rank_memory, tensor_bytes
from zbcompile.passes.cost import node_cost
from zbcompile.passes.lower.offload import OffloadChoice, insert_offload, offload_candidates
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import OpKind, Stream

__all__ = ["Device", "DEVICES", "OffloadError", "RankOffload", "plan_offload", "least_peaks", "compute_time",
           "offload_ratio"]

# slowdown "auto" accepts as free (the model's rounding, not a measured cost)
_FREE = 1.01
# (prefetch, wait_after), most overlap first: the device->host copy overlaps the next action and the reload
# the action before its reader; then the copy waited before the next action; then the reload just in time
_SETTINGS = ((1, 1), (1, 0), (0, 0))


@dataclass(frozen=True)
class Device:
    """What the time model needs of a device: sustained FLOP/s, memory bandwidth and host-copy bandwidth
    (bytes/s, each direction; one copy stream)."""

    name: str
    flops: float
    memory_bandwidth: float
    copy_bandwidth: float


# Sustained figures, not peaks: ~40% of an H100 SXM's dense bf16 989 TFLOP/s, ~75% of its 3.35 TB/s HBM, and
# pinned PCIe Gen5 x16 transfers (~50 GB/s of 64); the A100 row is the PipeOffload paper's own assumption
# (220 TFLOP/s, 15 GB/s per GPU when two share a PCIe switch). The CPU row is this project's 2-core machine
# (1 thread per rank: ~30 GFLOP/s, ~8 GB/s memcpy), where a "copy" is a memcpy on the compute thread.
DEVICES = {
    "h100": Device("h100", 400e12, 2.5e12, 50e9),
    "a100": Device("a100", 220e12, 1.5e12, 15e9),
    "cpu": Device("cpu", 30e9, 8e9, 8e9),
}


class RankOffload(NamedTuple):
    """One rank's offload: the choice, bytes offloaded per step, the planned device peak (total bytes) before
    and after, the offload ratio k and the modelled slowdown of the rank's compute timeline."""

    rank: int
    choice: OffloadChoice
    offloaded_bytes: int
    peak_before: int
    peak_after: int
    k: float
    slowdown: float


def plan_offload(programs: Sequence[RankProgram], budget: int | str | Sequence[int], *,
                 device: Device = DEVICES["h100"], min_bytes: int | None = None) -> tuple[RankOffload, ...]:
    """Per rank, the offload that makes its planned device peak (resident + step) fit `budget` (bytes, one for
    every rank or one per rank), or with "auto" what the time model says is free. Raises OffloadError, with
    the smallest budget that works on each rank, when no choice fits."""
    budgets = _budgets(budget, len(programs))
    reports = [_plan_rank(p, b, device, min_bytes) for p, b in zip(programs, budgets)]
    if any(r is None for r in reports):
        raise OffloadError(_too_small(programs, budgets, device, min_bytes))
    return tuple(reports)


def _budgets(budget, n: int) -> list[int | None]:
    if budget == "auto":
        return [None] * n
    if isinstance(budget, bool) or not isinstance(budget, (int, Sequence)) or isinstance(budget, str):
        raise OffloadError(f"offload={budget!r}: give None, \"auto\" or a device-memory budget in bytes "
                           "(an int, or one per rank)")
    out = [int(budget)] * n if isinstance(budget, int) else [int(b) for b in budget]
    if len(out) != n or any(b <= 0 for b in out):
        raise OffloadError(f"offload={budget!r}: one positive byte budget, or {n} of them (one per rank)")
    return out


def _plan_rank(program: RankProgram, budget: int | None, device: Device, min_bytes: int | None):
    kw = {} if min_bytes is None else {"min_bytes": min_bytes}
    found = offload_candidates(program, **kw)   # once: every choice tried below offloads some of them
    units = _by_lifespan(program, device, found)
    base = rank_memory(program).peak_total_bytes
    base_time = compute_time(program, device)
    none = OffloadChoice(units=frozenset(), **kw)
    if budget is not None and base <= budget:
        return RankOffload(program.rank, none, 0, base, base, 0.0, 1.0)
    if budget is None:
        return _free_prefix(program, found, units, device, base, base_time, kw)
    for prefetch, wait_after in _SETTINGS:
        def choice(k: int) -> OffloadChoice:
            return OffloadChoice(frozenset(units[:k]), prefetch, wait_after=wait_after, **kw)

        def fits(k: int) -> bool:
            return _peak(program, choice(k), found) <= budget
        if fits(len(units)):
            return _report(program, found, choice(_first_true(fits, len(units))), device, base, base_time)
    return None


def _free_prefix(program, found, units, device, base, base_time, kw) -> RankOffload:
    """"auto": the longest prefix of units (longest-lived first) whose modelled slowdown is within 1%."""
    def choice(k: int) -> OffloadChoice:
        return OffloadChoice(frozenset(units[:k]), 1, wait_after=1, **kw)

    def slow(k: int) -> bool:
        return compute_time(insert_offload(program, choice(k), found), device) > _FREE * base_time
    k = _first_true(slow, len(units)) - 1 if slow(len(units)) else len(units)
    return _report(program, found, choice(max(k, 0)), device, base, base_time)


def _first_true(pred, n: int) -> int:
    """The least k in 0..n with pred(k), pred monotone and pred(n) true (binary search: a memory plan per probe)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _peak(program: RankProgram, choice: OffloadChoice, found=None) -> int:
    return rank_memory(insert_offload(program, choice, found)).peak_total_bytes


def _report(program, found, choice, device, base, base_time) -> RankOffload:
    after = insert_offload(program, choice, found)
    moved = sum(op.args.type.nbytes for op in after.ops if op.kind is OpKind.OFFLOAD)
    return RankOffload(program.rank, choice, moved, base, rank_memory(after).peak_total_bytes,
                       offload_ratio(program, choice, device, found),
                       compute_time(after, device) / (base_time or 1.0))


def _by_lifespan(program: RankProgram, device: Device, found=None) -> list[tuple[int, int]]:
    """This rank's F units with something to offload (`found`: its offload_candidates, where known),
    longest-lived first (modelled time from F's end to the first reader's start; ties by stage, microbatch)."""
    times = _op_times(program, device)
    units = []
    for unit, cands in (offload_candidates(program) if found is None else found).items():
        if cands:
            life = max(times[c.reader_index][0] - times[c.f_index][1] for c in cands)
            units.append((-life, unit))
    return [u for _, u in sorted(units)]


# ---- the time model -------------------------------------------------------------------------------------
def _run_seconds(program: RankProgram, device: Device) -> dict[str, float]:
    out = {}
    for key, g in program.graphs.items():
        if g.gm is None:
            out[key] = 0.0
            continue
        flops, moved = _cost(g.gm)
        out[key] = max(flops / device.flops, moved / device.memory_bandwidth)
    return out


def _cost(gm) -> tuple[float, float]:
    """FLOPs and bytes of a graph; nodes without a FakeTensor (the in-place sums of the accumulating variants,
    added after tracing) count by their inputs' sizes, read and written once."""
    flops = moved = 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        try:
            c = node_cost(node)
            flops, moved = flops + float(c.flops), moved + float(c.bytes_read + c.bytes_written)
        except ZBCompileError:
            size = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
            flops, moved = flops + size / 4, moved + 2 * size
    return flops, moved


def _op_times(program: RankProgram, device: Device) -> list[tuple[float, float]]:
    """(start, end) of every op on the rank's compute timeline; copies run on one copy stream beside it. Read
    off each op's spec: a compute op that runs an action takes its graph's time; a copy-stream op with
    `copy_bytes` queues that many bytes behind the compute so far and the previous copy, and one without
    (a wait) stalls compute until the copies whose handles it reads are done. Everything else takes no time."""
    seconds = _run_seconds(program, device)
    now, copy_free = 0.0, 0.0
    done: dict[str, float] = {}   # a copy's handle -> when the copy is done
    out = []
    for op in program.ops:
        start, s = now, op.spec
        if s.stream is Stream.COMPUTE and op.action is not None:
            now += seconds[op.args.graph]
        elif s.stream is Stream.COPY and s.copy_bytes is not None:
            copy_free = max(now, copy_free) + s.copy_bytes(op) / device.copy_bandwidth
            done.update((h, copy_free) for h in op.outs)
        elif s.stream is Stream.COPY:
            now = max([now, *(done.get(v, now) for v in op.ins)])
        out.append((start, now))
    return out


def compute_time(program: RankProgram, device: Device) -> float:
    """Modelled seconds of the rank's compute timeline (its stage graphs, stalled by waits on copies)."""
    times = _op_times(program, device)
    return times[-1][1] if times else 0.0


def offload_ratio(program: RankProgram, choice: OffloadChoice, device: Device, candidates=None) -> float:
    """k = T_o / T_c over the chosen units (the largest): the time to copy a unit's offloaded tensors out and
    back over its F + B + W compute time (PipeOffload's criterion: k <= 1 hides the copies). `candidates`:
    offload_candidates(program, choice.min_bytes), where the caller holds them already."""
    seconds = _run_seconds(program, device)
    by_unit: dict[tuple[int, int], float] = {}
    for op in program.ops:
        a = op.action
        if a is not None:
            by_unit[(a.stage, a.microbatch)] = by_unit.get((a.stage, a.microbatch), 0.0) + seconds[op.args.graph]
    if candidates is None:
        candidates = offload_candidates(program, min_bytes=choice.min_bytes)
    k = 0.0
    for unit, cands in candidates.items():
        if choice.units is not None and unit not in choice.units or not cands:
            continue
        t_o = 2 * sum(c.nbytes for c in cands) / device.copy_bandwidth
        k = max(k, t_o / (by_unit.get(unit) or 1e-12))
    return k


def least_peaks(programs: Sequence[RankProgram], min_bytes: int | None = None) -> list[int]:
    """Per rank, the planned device peak with every candidate of every F offloaded and reloaded just in time:
    the smallest budget offload can meet."""
    kw = {} if min_bytes is None else {"min_bytes": min_bytes}
    return [_peak(p, OffloadChoice(None, 0, **kw)) for p in programs]


def _too_small(programs, budgets, device, min_bytes) -> str:
    from tabulate import tabulate

    kw = {} if min_bytes is None else {"min_bytes": min_bytes}
    rows, need = [], 0
    for p, b in zip(programs, budgets):
        base = rank_memory(p).peak_total_bytes
        least = _peak(p, OffloadChoice(None, 0, **kw))
        need = max(need, least)
        rows.append((p.rank, b, base, least, "fits" if b is None or least <= b else "too small"))
    table = tabulate(rows, headers=("rank", "budget", "peak without offload", "peak offloading everything",
                                    ""))
    return (f"no choice of offloaded activations fits the device-memory budget on every rank; offloading every "
            f"saved tensor of every F (reloaded just before its reader) still needs:\n{table}\n"
            f"fix: a budget of at least {need} bytes ({need / 2**20:.2f} MiB), or fewer microbatches in flight "
            "(another schedule: v-half, v-min), or smaller microbatches")
