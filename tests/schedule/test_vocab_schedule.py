"""Vocabulary parallelism in the schedule IR: insert_vocab on every generator, the validate errors for sharded
actions, the simulator's costs and memory for them, and that it beats the output layer on the last stage."""

from __future__ import annotations

import pytest

from support.schedules import acts
from zbcompile.errors import ScheduleError
from zbcompile.passes.schedules import SCHEDULES, generate
from zbcompile.passes.schedules.vocab import insert_vocab, vocab_costs, with_extra_warmup
from zbcompile.plan_vocab import VocabModel, baseline_model, vocab_model
from zbcompile.ir.schedule import KIND_SPECS, SHARDED_KINDS, Action, Kind, Schedule
from zbcompile.simulate import Costs, MemoryModel, simulate

GEMMA = VocabModel(ratio=4.6, layers_per_stage=8)  # the output layer is 4.6 blocks' work


def _minimum(name: str, p: int) -> int:
    return {"interleaved-1f1b": p, "dualpipe": 2}.get(name, 1)


def _cases() -> list[tuple[str, int, int]]:
    out = []
    for name in SCHEDULES:
        for p in (2, 3, 4):
            if name == "dualpipe" and p % 2:
                continue
            out += [(name, p, m) for m in sorted({1, p, 2 * p + 1}) if m >= _minimum(name, p)]
    return out


def _sharded(row) -> list[tuple[Kind, int]]:
    return [(a.kind, a.microbatch) for a in row if KIND_SPECS[a.kind].sharded]


def _base_part(row) -> list[Action]:
    return [a for a in row if not KIND_SPECS[a.kind].sharded]


@pytest.mark.parametrize(("name", "p", "m"), _cases(), ids=lambda x: str(x))
def test_insert_vocab_on_every_generator(name: str, p: int, m: int) -> None:
    base = generate(name, p, m)
    costs = vocab_costs(p, 3 * GEMMA.stages, Costs(comm=0.05))
    vocab = insert_vocab(base, costs).validate().check_order()
    assert vocab.name == f"{name}+vocab" and vocab.vocab_shards == p
    assert vocab.placement == base.placement and vocab.pipelines == base.pipelines
    sequences = [_sharded(row) for row in vocab.ranks]
    assert all(seq == sequences[0] for seq in sequences), "every rank joins the collectives in one order"
    assert sorted(sequences[0]) == sorted((kind, mb) for kind in SHARDED_KINDS for mb in range(m))
    for r, row in enumerate(vocab.ranks):
        assert all(a.stage == r for a in row if KIND_SPECS[a.kind].sharded)
        # the base order, after at most two extra warm-up forwards (insert_vocab picks by simulation)
        assert _base_part(row) in [list(with_extra_warmup(base, n).ranks[r]) for n in range(3)]
    result = simulate(vocab, costs)
    assert result.makespan > simulate(base, costs).makespan  # the vocabulary passes take time
    assert sum(result.busy) == pytest.approx(sum(simulate(base, costs).busy) + p * m * (costs.s + costs.t + 2 * costs.i))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "dualpipev"])
def test_no_extra_warmup_keeps_the_base_order(name: str) -> None:
    base = generate(name, 4, 8)
    vocab = insert_vocab(base, vocab_costs(4, 3 * GEMMA.stages), extra_warmup=0)
    assert [_base_part(row) for row in vocab.ranks] == [list(row) for row in base.ranks]


def test_extra_warmup_is_the_papers_1f1b() -> None:
    """1F1B runs p - r - 1 warm-up forwards and a steady-state F before rank r's first backward; with one extra
    warm-up, p - r warm-up forwards (the paper's Algorithm 2), then the steady one-forward-one-backward."""
    p, m = 4, 8
    base = generate("1f1b", p, m)
    shifted = with_extra_warmup(base).validate().check_order()
    for r, (old, new) in enumerate(zip(base.ranks, shifted.ranks)):
        kinds = [a.kind for a in new]
        assert kinds.index(Kind.BW) == kinds.index(Kind.BW, 0) == [a.kind for a in old].index(Kind.BW) + 1 == p - r + 1
        assert kinds[p - r + 1:p - r + 1 + 2 * (m - p + r - 1)] == [Kind.BW, Kind.F] * (m - p + r - 1)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_vocab_parallel_beats_the_output_layer_on_the_last_stage(name: str) -> None:
    base = generate(name, 4, 16)
    base_costs, base_memory = baseline_model(base, Costs(), MemoryModel(), GEMMA)
    last_stage = simulate(base, base_costs, base_memory)
    costs, memory = vocab_model(4, Costs(), MemoryModel(), GEMMA)
    parallel = simulate(insert_vocab(base, costs, memory), costs, memory)
    assert parallel.makespan < 0.85 * last_stage.makespan
    assert parallel.bubble_rate < last_stage.bubble_rate - 0.2
    # a constant activation overhead: at most one microbatch of the first stage plus the S -> T units
    assert max(parallel.peak_memory) <= max(last_stage.peak_memory) + 1 + memory.vocab + 1e-9


def test_vocab_memory_overhead_does_not_grow_with_microbatches() -> None:
    costs, memory = vocab_model(4, Costs(), MemoryModel(), GEMMA)
    peaks = {max(simulate(insert_vocab(generate("1f1b", 4, m), costs, memory), costs, memory).peak_memory)
             for m in (8, 16, 32)}
    assert len(peaks) == 1


def test_generate_vocab_flag() -> None:
    plain = generate("zb-h1", 3, 6)
    vocab = generate("zb-h1", 3, 6, vocab=True)
    assert plain.vocab_shards == 0 and vocab.vocab_shards == 3 and vocab.name == "zb-h1+vocab"
    assert generate("zb-h1", 3, 6) == plain  # the base schedule is untouched


def test_insert_vocab_refuses_a_vocab_schedule() -> None:
    with pytest.raises(ScheduleError, match="already holds vocabulary-parallel actions"):
        insert_vocab(generate("1f1b", 2, 2, vocab=True))


def test_text_round_trip() -> None:
    vocab = generate("zbv", 3, 5, vocab=True)
    again = Schedule.from_text(vocab.to_text())
    assert again == vocab
    again.validate().check_order()
    assert "0IF0" in vocab.to_text() and "2IB4" in vocab.to_text()


def test_torch_csv_refuses_vocab_actions() -> None:
    with pytest.raises(ScheduleError, match="no code for IF actions"):
        generate("1f1b", 2, 2, vocab=True).to_torch_csv()


# ---- validate: sharded actions ------------------------------------------------------------------------------
GOOD = ("0IF0 0F0 0S0 0T0 0BW0 0IB0", "1IF0 1F0 1S0 1T0 1BW0 1IB0")


def _two_ranks(*rows: str) -> Schedule:
    return Schedule("v", 1, (0, 1), tuple(acts(r) for r in rows))


def test_a_hand_written_vocab_schedule_validates() -> None:
    _two_ranks(*GOOD).validate().check_order()


def test_sharded_action_on_the_wrong_rank() -> None:
    with pytest.raises(ScheduleError) as err:
        _two_ranks("0IF0 0F0 1S0 0T0 0BW0 0IB0", GOOD[1]).validate()
    text = str(err.value)
    assert "rank 0, step 2: 1S0 is vocabulary shard 1's S, but rank 0 holds shard 0" in text
    assert "[1S0]" in text and "fix: write 0S0 here" in text


def test_missing_sharded_action_is_named() -> None:
    with pytest.raises(ScheduleError) as err:
        _two_ranks("0IF0 0F0 0S0 0BW0 0IB0", GOOD[1]).validate()
    text = str(err.value)
    assert "missing: 0T0" in text and "rank  0" in text and "insert_vocab" in text


def test_sharded_order_differs_between_ranks() -> None:
    with pytest.raises(ScheduleError) as err:
        _two_ranks("0F0 0IF0 0S0 0IB0 0T0 0BW0", GOOD[1]).validate()
    text = str(err.value)
    assert "ranks 0 and 1 run their sharded actions in different orders" in text
    assert "the 3rd is 0IB0 on rank 0 but 1T0 on rank 1" in text
    assert "rank 0 sharded steps: 0IF0 0S0 [0IB0] 0T0" in text and "[1T0]" in text
    assert "same order" in text


def test_placement_checks_skip_sharded_actions() -> None:
    """DualPipe's stage 1 is on rank 1 and microbatch 1 never visits it, but shard 1's S of microbatch 1
    runs on rank 1: the stage checks do not apply to a shard index."""
    generate("dualpipe", 2, 2, vocab=True).validate()


def test_deadlocked_vocab_order_shows_what_waits() -> None:
    with pytest.raises(ScheduleError) as err:
        _two_ranks("0IF0 0F0 0T0 0S0 0BW0 0IB0", "1IF0 1F0 1T0 1S0 1BW0 1IB0").validate().check_order()
    assert "rank 0 waits at 0T0 for 0S0, 1S0" in str(err.value) and "[0T0]" in str(err.value)


# ---- the simulator ------------------------------------------------------------------------------------------
def test_sharded_actions_are_costed_and_cross_rank_deps_pay_comm() -> None:
    result = simulate(_two_ranks(*GOOD), Costs(s=0.5, t=1.0, i=0.1, comm=0.1))
    at = {str(a): t for a, t in result.start.items()}
    assert result.end[Action(Kind.S, 0, 0)] - at["0S0"] == 0.5
    assert result.end[Action(Kind.IB, 1, 0)] - at["1IB0"] == pytest.approx(0.1)
    # 0F0 needs both IFs (1IF0 across ranks: +comm); 1F0 needs 0F0 (+comm); 0S0 needs 1F0, on rank 1
    assert at["0F0"] == pytest.approx(0.2)
    assert at["1F0"] == pytest.approx(1.3)
    assert at["0S0"] == pytest.approx(2.4) and at["1S0"] == pytest.approx(2.3)
    assert at["1T0"] == pytest.approx(3.0)  # after 0S0 ends (2.9) + comm


def test_memory_counts_vocab_units_from_s_to_t() -> None:
    schedule = _two_ranks(*GOOD)
    assert simulate(schedule, memory=MemoryModel(vocab=0.25)).peak_memory == (1.25, 1.25)
    assert simulate(schedule).peak_memory == (1.0, 1.0)
    # S holds, T frees; IF and IB hold nothing
    model = MemoryModel(vocab=0.25)
    assert model.delta(Kind.S, 1.0) == 0.25 and model.delta(Kind.T, 1.0) == -0.25
    assert model.delta(Kind.IF, 1.0) == model.delta(Kind.IB, 1.0) == 0.0


def test_memory_per_stage_sizes() -> None:
    schedule = _two_ranks(*GOOD)
    assert simulate(schedule, memory=MemoryModel(per_stage=(1.0, 2.5))).peak_memory == (1.0, 2.5)
    with pytest.raises(ScheduleError, match="2 model stages"):
        simulate(schedule, memory=MemoryModel(per_stage=(1.0,)))


def test_costs_parse_vocab_keys() -> None:
    costs = Costs.parse("F=1,S=0.2,T=0.4,I=0.01")
    assert (costs.s, costs.t, costs.i) == (0.2, 0.4, 0.01)
    assert str(costs) == "F=1,B=1,W=1,comm=0,S=0.2,T=0.4,I=0.01"
    assert str(Costs()) == "F=1,B=1,W=1,comm=0"


@pytest.mark.parametrize("pp,layer", [(2, 3.0), (4, 6.0), (8, 2.4)])
def test_vocab_costs_split_the_output_layer_into_a_forward_third_and_the_rest(pp, layer):
    """An output layer taking L whole (its F + B + W) is split over pp shards of L/pp each: S the forward third,
    T the rest (s = L/(3pp), t = 2L/(3pp)); a T placed as cheaper than it is misplaces the vocabulary actions."""
    costs = vocab_costs(pp, layer, Costs())
    assert costs.s == pytest.approx(layer / (3 * pp), rel=1e-12)
    assert costs.t == pytest.approx(2 * layer / (3 * pp), rel=1e-12)
