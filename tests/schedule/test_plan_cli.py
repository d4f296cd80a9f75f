"""`zbcompile plan`: output, files it writes, and how it fails on bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from support.schedules import acts, one_f_one_b
from zbcompile.__main__ import main
from zbcompile.ir.schedule import Schedule

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def cli(*args: str) -> subprocess.CompletedProcess:
    """The real command, in a fresh interpreter (exit status and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "zbcompile", *args], capture_output=True, text=True, timeout=60)


def assert_usage_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zbcompile: error:"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    for word in words:
        assert word in lines[0]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "s.csv"
    path.write_text(one_f_one_b(4, 6).to_torch_csv())
    return path


# ---- bad input, through a real subprocess ------------------------------------------------------------
def test_malformed_costs_is_one_line_exit_2(saved: Path) -> None:
    assert_usage_error(cli("plan", "--load", str(saved), "--costs", "F=1,B=oops"), "--costs", "expected")


def test_bad_numbers_and_unknown_schedule_are_one_line_exit_2() -> None:
    assert_usage_error(cli("plan", "--schedule", "1f1b", "--pp", "0", "--microbatches", "4"), "--pp")
    assert_usage_error(cli("plan", "--schedule", "no-such-thing", "--pp", "4", "--microbatches", "8"),
                       "no-such-thing")


def test_a_loaded_file_is_not_silently_reshaped_by_the_sizing_flags(saved: Path, tmp_path: Path, capsys) -> None:
    """--load reads ranks, stages and microbatches from the file: a --chunks or an -m that disagrees with it is
    refused (it was ignored, or made a confusing "never visits" error), a matching -m is fine; a blank line inside
    a CSV names the line (it was an empty rank: "placement must use every rank"); a compare where no schedule can
    be built at all, and an infinite --mem-limit, are usage errors."""
    for flags, words in ((["--chunks", "4"], ("drop --chunks",)), (["-m", "3"], ("holds 6 microbatch", "drop")),
                         (["-m", "1"], ("holds 6 microbatch",))):
        assert main(["plan", "--load", str(saved), *flags]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), (flags, err)
    assert main(["plan", "--load", str(saved), "-m", "6"]) == 0
    capsys.readouterr()
    rows = saved.read_text().splitlines()
    blank = tmp_path / "blank.csv"
    blank.write_text("\n".join([rows[0], "", *rows[1:]]) + "\n\n")
    assert main(["plan", "--load", str(blank)]) == 2
    assert "line 2 is empty" in capsys.readouterr().err
    trailing = tmp_path / "trailing.csv"
    trailing.write_text("\n".join(rows) + "\n\n\n")
    assert main(["plan", "--load", str(trailing)]) == 0
    capsys.readouterr()
    assert main(["plan", "--compare", "--pp", "1", "-m", "8"]) == 2
    assert "no schedule can be built at p=1" in capsys.readouterr().err
    assert main(["plan", "--schedule", "zb-auto", "--pp", "4", "-m", "8", "--mem-limit", "inf"]) == 2
    assert "finite non-negative number" in capsys.readouterr().err


def test_deadlocked_file_shows_the_grid_without_traceback(tmp_path: Path) -> None:
    crossed = Schedule("crossed", 2, (0, 1), (acts("0F0 0BW0 0F1 0BW1"), acts("1F1 1BW1 1F0 1BW0")))
    path = tmp_path / "crossed.txt"
    path.write_text(crossed.to_text())
    proc = cli("plan", "--load", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("zbcompile: error: schedule 'crossed' deadlocks")
    assert "[0BW0]" in proc.stderr


# ---- in-process runs of main() -------------------------------------------------------------------------
def test_plan_load_prints_table_and_timeline(saved: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--load", str(saved), "--act-bytes", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "bubble rate" in out and "33.33%" in out  # (p-1)/(m+p-1) = 3/9
    assert "4.00 GiB" in out
    assert "rank  3 |" in out


def test_csv_round_trips(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out.csv"
    assert main(["plan", "--load", str(saved), "--csv", str(out)]) == 0
    again = Schedule.from_torch_csv(out.read_text())
    assert again.ranks == Schedule.from_torch_csv(saved.read_text()).ranks == one_f_one_b(4, 6).ranks


def test_svg_is_well_formed(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out.svg"
    assert main(["plan", "--load", str(saved), "--svg", str(out)]) == 0
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg") and len(list(root.iter("{http://www.w3.org/2000/svg}rect"))) > 4 * 12


def test_json_output(saved: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--load", str(saved), "--json", "--costs", "comm=0.1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pp"] == 4 and data["microbatches"] == 6 and data["costs"]["comm"] == 0.1
    assert data["peak_memory"] == 4 and len(data["ranks"]) == 4


def test_mem_limit_below_need_is_an_error(saved: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--load", str(saved), "--mem-limit", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zbcompile: error:") and "needs 4 units on rank 0" in err


def test_load_text_form_and_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "s.txt"
    path.write_text(one_f_one_b(2, 3, split=True).to_text())
    assert main(["plan", "--load", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "1f1b"
    assert main(["plan", "--load", str(tmp_path / "nope.csv")]) == 2
    assert "cannot read schedule file" in capsys.readouterr().err
    # a binary file and a placement with an empty item raised UnicodeDecodeError / ValueError tracebacks
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00")
    assert main(["plan", "--load", str(tmp_path / "bin.csv")]) == 2
    assert "is not text (not UTF-8)" in capsys.readouterr().err
    path.write_text(path.read_text().replace("placement=0,1", "placement=0,,1", 1))
    assert main(["plan", "--load", str(path)]) == 2
    assert "not a zbcompile schedule: the first line must read" in capsys.readouterr().err


def test_missing_sizes_and_compare_with_files(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--schedule", "1f1b"]) == 2
    assert "needs --pp and --microbatches" in capsys.readouterr().err
    assert main(["plan", "--compare", "--pp", "4", "--microbatches", "8", "--svg", "x.svg"]) == 2
    assert "--schedule NAME" in capsys.readouterr().err


# ---- with the generators -----------------------------------------------------------------------------
def test_plan_generated_schedule(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    csv_path = tmp_path / "zbh1.csv"
    assert main(["plan", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--csv", str(csv_path)]) == 0
    assert "27.27%" in capsys.readouterr().out  # 3/11
    assert Schedule.from_torch_csv(csv_path.read_text()).num_ranks == 4


def test_compare_lists_every_schedule_and_explains_failures(capsys: pytest.CaptureFixture) -> None:
    from zbcompile.passes.schedules import list_schedules

    assert main(["plan", "--compare", "--pp", "4", "--microbatches", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["schedules"]
    assert [r["schedule"] for r in rows] == list(list_schedules())
    assert any(r["note"] and "makespan" not in r for r in rows)  # something cannot run at m=2
    assert any("makespan" in r for r in rows)


def test_compare_mem_limit_below_everything_is_an_error() -> None:
    assert_usage_error(cli("plan", "--compare", "--pp", "4", "--microbatches", "8", "--mem-limit", "0.1"),
                       "--mem-limit")


# ---- comparison logic with stand-in generators (independent of the real ones) ------------------------
@pytest.fixture
def fake_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    from zbcompile import plan
    from zbcompile.errors import ScheduleError

    def generate(name, pp, microbatches, *, chunks=None, costs=None, mem_limit=None):
        if name == "picky":
            raise ScheduleError(f"picky needs microbatches >= 99 for pp={pp}; got {microbatches}")
        if name == "two":  # a stand-in that needs less memory: always two ranks
            return one_f_one_b(2, microbatches, split=True)
        return one_f_one_b(pp, microbatches)

    monkeypatch.setattr(plan, "generate", generate)
    monkeypatch.setattr(plan, "list_schedules", lambda: {"1f1b": "", "two": "", "picky": ""})


def test_compare_rows_and_reasons(fake_generators: None) -> None:
    from zbcompile.plan import compare, compare_table

    rows = compare(4, 8, mem_limit=3.5)
    assert [r.name for r in rows] == ["1f1b", "two", "picky"]
    assert rows[2].result is None and "needs microbatches >= 99" in rows[2].reason
    assert rows[0].reason == "needs 4 units on rank 0, above --mem-limit 3.5"
    assert rows[1].reason is None and rows[1].result.peak_memory == (2, 1)
    table = compare_table(compare(4, 8))
    assert "27.27%" in table and "picky needs" in table


def test_compare_cli_and_limits(fake_generators: None, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--compare", "--pp", "4", "--microbatches", "8", "--act-bytes", "2MiB"]) == 0
    out = capsys.readouterr().out
    assert "8.00 MiB" in out and "picky" in out
    assert main(["plan", "--compare", "--pp", "4", "--microbatches", "8", "--mem-limit", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zbcompile: error: --mem-limit 1.5 is below what any schedule needs")
    assert "the least a schedule here needs is 2" in err
    assert main(["plan", "--schedule", "nope", "--pp", "4", "--microbatches", "8"]) == 2
    assert "unknown schedule 'nope'; choose one of: 1f1b, two, picky" in capsys.readouterr().err


def test_benchmark_table_reuses_compare(fake_generators: None, capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(BENCHMARKS)   # the benchmark scripts import their siblings (_harness)
    from schedule_table import main as bench_main
    assert bench_main(["--pp", "4", "--microbatches", "8", "12", "--costs", "W=0.5"]) == 0
    out = capsys.readouterr().out
    assert "p=4, m=8" in out and "p=4, m=12" in out and "picky" in out


def test_usage_errors_return_2_in_process(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--pp", "4"]) == 2
    assert capsys.readouterr().err.startswith("zbcompile: error: one of the arguments")
    assert main(["--help"]) == 0


@pytest.mark.parametrize("pp,m", [(4, 7), (4, 8), (8, 15), (8, 24), (4, 1), (4, 2), (4, 3), (4, 5), (8, 3), (8, 7),
                                  (3, 2)])
def test_compare_agrees_with_the_papers_closed_forms(pp, m):
    """Every stated closed form is met exactly: the bubble rate, and the peak (ZB-H2's is (2p-1), reached from
    m = 2p-1 on, where its bubble is already zero). With fewer microbatches than a schedule's steady state holds,
    the peak is m and ZB-H1's bubble has no closed form (its (p-1)/(3m+p-1) needs m >= p)."""
    from zbcompile.plan import closed_form, compare

    for row in compare(pp, m):
        if row.result is None:   # a schedule that refuses so few microbatches (interleaved: m >= p), saying so
            assert m < pp and row.reason, row.name
            continue
        bubble, memory = closed_form(row.name, pp, m)
        if bubble is not None:
            assert row.result.bubble_rate == pytest.approx(bubble, abs=1e-12), row.name
        if memory is not None:
            assert max(row.result.peak_memory) == pytest.approx(memory), row.name


# ---- --vocab-parallel ---------------------------------------------------------------------------------------
def test_vocab_parallel_balances_compute_for_a_constant_memory_overhead(capsys: pytest.CaptureFixture) -> None:
    """The paper's direction at ratio 4.6: makespan and bubble fall; 1F1B's peak rises by about one microbatch
    (one extra warm-up forward plus the S -> T units), the same at m = 8 and m = 16."""
    overhead = []
    for m in ("8", "16"):
        assert main(["plan", "--schedule", "1f1b", "--pp", "4", "-m", m, "--vocab-parallel", "--vocab-ratio",
                     "4.6", "--layers", "32", "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["schedules"][0]
        last, vocab = row["last_stage"], row["vocab_parallel"]
        assert vocab["schedule"] == "1f1b+vocab" and last["schedule"] == "1f1b"
        assert vocab["makespan"] < 0.85 * last["makespan"] and vocab["bubble_rate"] < last["bubble_rate"]
        overhead.append(vocab["peak_memory"] - last["peak_memory"])
    assert overhead[0] == pytest.approx(overhead[1]) and 1.0 < overhead[0] < 1.5


def test_vocab_parallel_table_and_timeline(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    svg = tmp_path / "v.svg"
    assert main(["plan", "--schedule", "zbv", "--pp", "4", "-m", "8", "--vocab-parallel", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "last stage" in out and "vocab parallel" in out and "change" in out
    assert "S/T vocab output shard" in out  # the timeline's legend
    assert "vocab output (S)" in svg.read_text()


def test_vocab_parallel_compare_and_bad_combinations(capsys: pytest.CaptureFixture, saved: Path) -> None:
    assert main(["plan", "--compare", "--pp", "3", "-m", "6", "--vocab-parallel"]) == 0
    out = capsys.readouterr().out
    assert "zb-h1" in out and "dualpipe" in out and "even pp" in out  # a row that cannot run says why
    assert main(["plan", "--load", str(saved), "--vocab-parallel"]) == 2
    assert "--vocab-parallel generates the schedules" in capsys.readouterr().err
    assert main(["plan", "--schedule", "1f1b", "--pp", "2", "-m", "2", "--vocab-parallel", "--csv", "x.csv"]) == 2
    assert "torch's CSV has no vocabulary passes" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (("--dp-pieces", "2"), "--dp-pieces applies only with --dp-comm"),
    (("--boundary-latency", "1"), "--boundary-latency applies only with --step-boundary"),
    (("--vocab-ratio", "0"), "--vocab-ratio applies only with --vocab-parallel"),
    (("--layers", "8"), "--layers applies only with --vocab-parallel"),
], ids=["dp-pieces", "boundary-latency", "vocab-ratio", "layers"])
def test_a_flag_without_the_one_it_applies_with_is_refused(capsys, flags, named):
    """It would change nothing (the table it tunes is not printed): status 2 and one line, not a plain table."""
    assert main(["plan", "--compare", "--pp", "4", "-m", "8", *flags]) == 2
    assert f"zbcompile: error: {named}" in capsys.readouterr().err
    assert main(["plan", "--compare", "--pp", "4", "-m", "8", "--step-boundary", "1", "--boundary-latency", "1"]) == 0


@pytest.mark.parametrize("mode", [["--step-boundary", "1"], ["--dp-comm", "1"], ["--vocab-parallel"]])
def test_mem_limit_shapes_zb_auto_in_every_report(mode, capsys) -> None:
    """--mem-limit was dropped by --step-boundary, --dp-comm and --vocab-parallel: their reports timed the
    unlimited zb-auto (makespan 27 at p=4, m=8) while the plain report timed the limited one (72, peak 1)."""
    args = ["plan", "--schedule", "zb-auto", "--pp", "4", "-m", "8", "--json"]
    assert main([*args, "--mem-limit", "1"]) == 0
    limited = json.loads(capsys.readouterr().out)
    assert limited["makespan"] == 72 and limited["peak_memory"] == 1
    assert main([*args, "--mem-limit", "1", *mode]) == 0
    report = json.loads(capsys.readouterr().out)["schedules"][0]
    assert main([*args, *mode]) == 0
    unlimited = json.loads(capsys.readouterr().out)["schedules"][0]
    assert report != unlimited, report
    if "makespan" in report:
        assert report["makespan"] == 72 and unlimited["makespan"] < 72


def test_flags_a_report_would_drop_are_refused(tmp_path: Path, capsys) -> None:
    """Exit 0 with a flag dropped: --svg / --csv under --dp-comm or --step-boundary (no file written), two of
    the reports at once (one table printed), a schedule over --mem-limit under --dp-comm; and --vocab-parallel
    --json --svg wrote no SVG. Each report is now one per run, and the SVG is written."""
    base = ["plan", "--schedule", "zb-h1", "--pp", "4", "-m", "8"]
    cases = [(["--dp-comm", "1", "--svg", str(tmp_path / "a.svg")], "--dp-comm prints a table"),
             (["--step-boundary", "1", "--csv", str(tmp_path / "a.csv")], "--step-boundary prints a table"),
             (["--step-boundary", "1", "--dp-comm", "2"], "--dp-comm and --step-boundary are reports of their own"),
             (["--vocab-parallel", "--dp-comm", "2"], "--vocab-parallel and --dp-comm are reports of their own"),
             (["--dp-comm", "1", "--mem-limit", "2"], "needs 4 units on rank 0, above --mem-limit 2")]
    for more, says in cases:
        assert main([*base, *more]) == 2, more
        assert says in capsys.readouterr().err, more
    assert not list(tmp_path.iterdir())
    svg = tmp_path / "v.svg"
    assert main([*base, "--vocab-parallel", "--json", "--svg", str(svg)]) == 0
    json.loads(capsys.readouterr().out)
    ET.parse(svg)


@pytest.mark.slow   # a fresh machine first compiles torch's -OO bytecode (about 10 s)
@pytest.mark.parametrize("module", ["zbcompile", "zbcompile.examples.train_gpt"])
def test_the_commands_run_under_python_OO(module):
    """python -OO strips docstrings: the CLI and the main job built their --help description from one and
    crashed (AttributeError on None) before doing anything."""
    proc = subprocess.run([sys.executable, "-OO", "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage:" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
