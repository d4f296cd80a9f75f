"""torch.distributed.pipelining's own schedules load through its compute-only CSV, validate, simulate, and
round-trip: our CSV of them is what torch's `_dump_csv` wrote, and torch's `_load_csv` reads ours back."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.distributed.pipelining import schedules as ts

from zbcompile.ir.schedule import Kind, Schedule
from zbcompile.simulate import simulate

# torch class name -> (stages per rank, placement style)
MULTI = {
    "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleLoopedBFS": (2, "loop"),
    "ScheduleInterleavedZeroBubble": (2, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"),
    "ScheduleDualPipeV": (2, "v"),
}


class _StageStub:
    """What torch's schedule constructors read off a PipelineStage to build `pipeline_order` (no process
    group, no model run)."""

    def __init__(self, index: int, num_stages: int, rank: int, world: int):
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, num_stages, rank, world
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.has_backward = True
        self.stage_index_to_group_rank = {}


def _torch_schedule(name: str, world: int, microbatches: int):
    per_rank, style = MULTI[name]
    n = world * per_rank
    mine = [0, 2 * world - 1] if style == "v" else [k * world for k in range(per_rank)]
    stages = [_StageStub(i, n, 0, world) for i in mine]
    return getattr(ts, name)(stages, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())


@pytest.mark.parametrize("name", sorted(MULTI))
@pytest.mark.parametrize("world,microbatches", [(2, 8), (4, 8)])
def test_torch_schedule_loads_validates_simulates_and_round_trips(name, world, microbatches, tmp_path):
    torch_sched = _torch_schedule(name, world, microbatches)
    path = tmp_path / "torch.csv"
    takes_format = "format" in inspect.signature(torch_sched._dump_csv).parameters
    torch_sched._dump_csv(str(path), **({"format": "compute_only"} if takes_format else {}))
    ours = Schedule.from_torch_csv(path.read_text(), name=name, num_microbatches=microbatches)
    ours.validate().check_order()
    assert ours.num_ranks == world and ours.num_stages == 2 * world
    if "ZeroBubble" in name or "DualPipe" in name:
        assert any(a.kind is Kind.W for row in ours.ranks for a in row)
    result = simulate(ours)
    assert 0.0 <= result.bubble_rate < 1.0 and result.makespan > 0
    # ours -> torch: torch's loader reads our CSV into the same compute actions it generated
    back = tmp_path / "ours.csv"
    back.write_text(ours.to_torch_csv())
    assert Schedule.from_torch_csv(back.read_text(), name=name).ranks == ours.ranks
    if name != "ScheduleDualPipeV":  # our CSV splits its overlapped pairs into their two actions
        reread = _torch_schedule(name, world, microbatches)
        reread._load_csv(str(back), format="compute_only")
        for rank in range(world):
            want = [str(a) for a in torch_sched.pipeline_order[rank] if a is not None]
            assert [str(a) for a in reread.pipeline_order[rank] if a is not None] == want


def test_unknown_torch_cell_says_what_is_supported():
    from zbcompile.errors import ScheduleError

    with pytest.raises(ScheduleError, match="compute-only format"):
        Schedule.from_torch_csv("0F0,0SEND_F0\n")


@pytest.mark.parametrize("world,microbatches", [(2, 8), (4, 8)])
def test_dualpipev_keeps_its_overlapped_pairs_when_asked(world, microbatches, tmp_path):
    """keep_overlap=True reads `(A;B)OVERLAP_F_B` as an Overlap: our CSV is then torch's, step for step, and
    the flat form is what the default reading gives."""
    torch_sched = _torch_schedule("ScheduleDualPipeV", world, microbatches)
    path = tmp_path / "torch.csv"
    takes_format = "format" in inspect.signature(torch_sched._dump_csv).parameters
    torch_sched._dump_csv(str(path), **({"format": "compute_only"} if takes_format else {}))
    text = path.read_text()
    kept = Schedule.from_torch_csv(text, name="dpv", num_microbatches=microbatches, keep_overlap=True)
    flat = Schedule.from_torch_csv(text, name="dpv", num_microbatches=microbatches)
    assert kept.has_overlaps and not flat.has_overlaps
    assert kept.flatten() == flat
    kept.validate().check_order()
    assert simulate(kept).makespan == simulate(flat).makespan
    assert Schedule.from_text(kept.to_text()) == kept
    back = tmp_path / "ours.csv"
    back.write_text(kept.to_torch_csv())
    reread = _torch_schedule("ScheduleDualPipeV", world, microbatches)
    reread._load_csv(str(back), format="compute_only")
    for rank in range(world):
        want = [str(a) for a in torch_sched.pipeline_order[rank] if a is not None]
        assert [str(a) for a in reread.pipeline_order[rank] if a is not None] == want
