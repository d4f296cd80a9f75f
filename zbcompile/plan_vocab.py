"""`zbcompile plan --vocab-parallel`: what vocabulary parallelism buys a schedule, by simulation.

    schedule, costs, VocabModel  ->  compare_vocab  ->  rows: (output layer on the last stage, vocabulary parallel)

The output layer (LM head + cross-entropy) costs `ratio` transformer blocks' F + B + W (V / (12h + 2s) for a
dense model: about 4.6 for Gemma-2-9B); the input embedding is a gather, cheap in time. A 1F1B stage, the
unit of `Costs` and of memory, holds `layers_per_stage` blocks. Two models of the same schedule:

    baseline  the output layer runs on the last stage: its F, B, W times are added to that stage's
              (`Costs.per_stage`) and its activations to what that stage's F holds (`MemoryModel.per_stage`)
    vocab     every rank runs 1/p of it on its shard (`insert_vocab`: S, T, IF, IB with `vocab_costs`'s times),
              and holds, from each S until its T, its share of the output layer's activations plus the
              broadcast last-stage output (`MemoryModel.vocab`)

Vocabulary parallelism balances the compute (the bubble and the makespan fall) for a constant activation
overhead per rank: the S -> T units, plus a microbatch of transformer activations per extra warm-up forward
when `insert_vocab` finds that one pays (1F1B: p + 1 on the first rank, as in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tabulate import tabulate

from zbcompile.errors import ScheduleError, ZBCompileError
from zbcompile.passes.schedules.vocab import insert_vocab, vocab_costs
from zbcompile.ir.schedule import Schedule
from zbcompile.simulate import Costs, MemoryModel, SimResult, simulate

__all__ = ["VocabModel", "VocabRow", "baseline_model", "vocab_model", "compare_vocab", "vocab_table"]

# The last stage's output, broadcast to every rank for its S and kept until its T: s*b*h values against a
# block's ~34*s*b*h bytes of activations (Korthikanti et al.), so about 1/17 of a block's.
BROADCAST_BLOCKS = 2 / 34


@dataclass(frozen=True)
class VocabModel:
    """The output layer against one transformer block, and the blocks a 1F1B stage holds.

    ratio             the output layer's F + B + W time in blocks' F + B + W (split as F, B, W are)
    layers_per_stage  transformer blocks per 1F1B stage (the model's blocks / pp)
    memory_ratio      the output layer's activations per microbatch in blocks'; None: the same as `ratio`
                      (both grow with V / h)
    """

    ratio: float = 4.6
    layers_per_stage: float = 8.0
    memory_ratio: float | None = None

    def __post_init__(self) -> None:
        if not (self.ratio >= 0 and self.layers_per_stage > 0 and (self.memory_ratio or 0) >= 0):
            raise ScheduleError(f"vocabulary model: ratio {self.ratio}, memory ratio {self.memory_ratio} must be "
                                f"non-negative and layers per stage {self.layers_per_stage} positive")

    @property
    def stages(self) -> float:
        """The output layer's time in 1F1B stages."""
        return self.ratio / self.layers_per_stage

    @property
    def memory_stages(self) -> float:
        """The output layer's activations in 1F1B-stage units."""
        return (self.ratio if self.memory_ratio is None else self.memory_ratio) / self.layers_per_stage


def baseline_model(schedule: Schedule, costs: Costs, memory: MemoryModel,
                   model: VocabModel) -> tuple[Costs, MemoryModel]:
    """Costs and memory of `schedule` with the whole output layer on its last model stage."""
    if costs.per_stage is not None or memory.per_stage is not None:
        raise ScheduleError("--vocab-parallel builds its own per-stage costs and memory; give uniform costs")
    n, p = schedule.num_model_stages, schedule.num_ranks
    scale, last = p / n, n - 1
    times = tuple((costs.f * scale + (s == last) * costs.f * model.stages,
                   costs.b * scale + (s == last) * costs.b * model.stages,
                   costs.w * scale + (s == last) * costs.w * model.stages) for s in range(n))
    units = tuple(scale + (s == last) * model.memory_stages for s in range(n))
    return replace(costs, per_stage=times), replace(memory, per_stage=units)


def vocab_model(pp: int, costs: Costs, memory: MemoryModel, model: VocabModel) -> tuple[Costs, MemoryModel]:
    """Costs and memory with the output layer spread over `pp` vocabulary shards."""
    layer = (costs.f + costs.b + costs.w) * model.stages
    held = model.memory_stages / pp + BROADCAST_BLOCKS / model.layers_per_stage
    return vocab_costs(pp, layer, costs), replace(memory, vocab=held)


@dataclass(frozen=True)
class VocabRow:
    """One schedule simulated both ways, or the reason it could not be."""

    name: str
    baseline: SimResult | None
    vocab: SimResult | None
    reason: str | None = None


def compare_vocab(schedules: list[tuple[str, Schedule | str]], costs: Costs, memory: MemoryModel,
                  model: VocabModel) -> list[VocabRow]:
    """Each (name, schedule) simulated with the output layer on its last stage and vocabulary parallel; a
    schedule given as a string is the reason it could not be built."""
    rows = []
    for name, schedule in schedules:
        if isinstance(schedule, str):
            rows.append(VocabRow(name, None, None, schedule))
            continue
        try:
            base_costs, base_memory = baseline_model(schedule, costs, memory, model)
            baseline = simulate(schedule, base_costs, base_memory)
            vp_costs, vp_memory = vocab_model(schedule.num_ranks, costs, memory, model)
            vocab = simulate(insert_vocab(schedule, vp_costs, vp_memory), vp_costs, vp_memory)
        except ZBCompileError as exc:
            rows.append(VocabRow(name, None, None, str(exc).splitlines()[0]))
            continue
        rows.append(VocabRow(name, baseline, vocab))
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _change(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.1f}%" if old else "-"


def _per_rank(values: tuple[float, ...]) -> str:
    shown = [f"{x:.3g}" for x in values]
    return " ".join(shown if len(shown) <= 8 else shown[:4] + ["..."] + shown[-2:])


def vocab_table(rows: list[VocabRow], tablefmt: str = "simple") -> str:
    """Two lines per schedule (output layer on the last stage, vocabulary parallel) and the change."""
    head = ["schedule", "output layer", "makespan", "bubble rate", "peak mem (max)", "peak mem per rank"]
    body = []
    for row in rows:
        if row.baseline is None or row.vocab is None:
            body.append([row.name, "-", "-", "-", "-", row.reason])
            continue
        for label, res in (("last stage", row.baseline), ("vocab parallel", row.vocab)):
            body.append([row.name if label == "last stage" else "", label, f"{res.makespan:.4g}",
                         _pct(res.bubble_rate), f"{max(res.peak_memory):.4g}",
                         _per_rank(res.peak_memory)])
        base, vocab = row.baseline, row.vocab
        body.append(["", "change", _change(vocab.makespan, base.makespan),
                     f"{100 * (vocab.bubble_rate - base.bubble_rate):+.2f} pts",
                     f"{max(vocab.peak_memory) - max(base.peak_memory):+.3g}", ""])
    return tabulate(body, headers=head, tablefmt=tablefmt, disable_numparse=True)
