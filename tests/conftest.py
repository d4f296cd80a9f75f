"""The test suite, one folder per layer of the compiler (run from the repository root):

    tests/ir/           the IRs alone: action kinds, op specs, composite steps, the schedule problem, import layers
    tests/split/        tracing and splitting a model into stage graphs: errors, balance, costs, vocabulary shards
    tests/compiler/     the options (each checked before tracing) and the compiler core against the passes by hand
    tests/schedule/     schedule generators, golden orders, the simulator and zb-auto, `zbcompile plan`
    tests/lower/        lowering to rank programs and its passes (p2p, buffers, streams, offload, memory, capture),
                        golden program text, `zbcompile inspect`; ranks run as threads of one process
    tests/runtime/      the runtimes behind the programs: CUDA graphs (CPU stand-in), the replay footprint, inductor
    tests/e2e/          whole pipelines, threaded: the transformers zoo, with and without vocabulary parallelism
    tests/distributed/  several processes (gloo on 127.0.0.1, all marked dist); workers/ holds their rank scripts
    tests/gpu/          a real CUDA device (marked gpu, skipped without one)
    tests/support/      helpers shared by the tests and the workers (`from support.models import gpt`), no tests
    tests/golden/       pinned schedule orders and program text, read by schedule/ and lower/
    tests/test_readme.py  the README's code blocks, run as written

Tiers:

    python -m pytest -q -n 2                                        everything, on both cores (CI: .ci/run)
    python -m pytest -q -n 2 -m "not slow"                          the edit loop (every dist test is slow too)
    python -m pytest -q tests/ir tests/split tests/schedule tests/lower   the compiler's layers on a CPU
    python -m pytest -q -n 2 -m dist                                the multi-process tests alone

`-n 2` (pytest-xdist) runs two test processes; `--dist loadfile` (in pyproject.toml) keeps each module in one, so
that its launches and caches are made once. Under `-n 2` two launches may run side by side: a launch whose
master port another took in between is run again on a new one (support/launch.py).

Markers (declared in pyproject.toml, --strict-markers): dist (launches several processes), slow (over a second
here: marked by hand, and by the timings in durations.json, see below), gpu (needs CUDA), fresh_split (never
from the split memo). Refresh the timings after adding slow tests: `python -m pytest -q -n 2 --record-durations`
(the whole suite, on this kind of machine; then once more with -m "not slow", which raises the timings of the
tests that are slow only when the fast tier runs alone). Every test has a timeout (pytest-timeout, 1500 s); every
launch kills all its ranks on a failure or its own timeout (support/launch.py).

Tracing and splitting are most of the suite's time, so the session splits each distinct request once
(support/split_memo.py): in each process's memory, and in a directory of the session's own that the test
processes and every launched rank share (the four ranks of a launch make one split, not four). The tests under
tests/split/ always split anew: there the split is what is tested. Launched ranks and the CLI runs of
`zbcompile inspect` are forked from a warm interpreter that imported torch and zbcompile once per test process
(support/forked.py; ZB_TEST_COLD_RANKS=1 starts each cold); the torchrun tests start every rank cold.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

# Measured seconds per test (setup + call + teardown) on the reference machine (2 cores, no GPU), from a full run
# with --record-durations. A test measured over SLOW_SECONDS is marked slow, so that the edit loop
# (`-m "not slow"`) stays within a few minutes without anyone keeping hand-placed marks in step with the
# timings; a test the file does not know yet runs in the edit loop until the next recording.
DURATIONS = Path(__file__).with_name("durations.json")
SLOW_SECONDS = 1.0
SPLIT_TESTS = Path(__file__).with_name("split")


def pytest_configure(config):
    # one trace and split per distinct request in the whole session (support/split_memo.py: in memory, and in a
    # directory of this session's own that the test processes under -n and every launched rank share), installed
    # before any test module imports split_model; every process of the suite runs its torch ops on one thread,
    # as each rank of a launch does (pytest -n runs two test processes on the two cores)
    import torch

    from support import split_memo

    torch.set_num_threads(1)
    if hasattr(config, "workerinput"):   # a test process of pytest -n: the controller's directory
        directory = config.workerinput["zb_split_dir"]
    else:
        directory = config._zb_split_dir = tempfile.mkdtemp(prefix="zbcompile-splits-")
    split_memo.install_shared(directory)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest -n: each test process shares the controller's split directory."""
    node.workerinput["zb_split_dir"] = node.config._zb_split_dir


def pytest_unconfigure(config):
    if getattr(config, "_zb_split_dir", None):
        shutil.rmtree(config._zb_split_dir, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The memo is off while a test under tests/split/ or marked fresh_split sets up (its module's fixtures too,
    which set up with its first test), runs and tears down: there the split is what is tested."""
    from support import split_memo

    fresh = item.get_closest_marker("fresh_split") is not None or SPLIT_TESTS in item.path.parents
    split_memo.enabled(not fresh)


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help=f"write every test's measured seconds into {DURATIONS.name} at the end of the run "
                          "(merged with what it holds: run the whole suite to refresh it)")


def pytest_collection_modifyitems(config, items):
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    for item in items:
        if known.get(item.nodeid, 0.0) > SLOW_SECONDS and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    # the longest modules first (each keeps its own order): under -n 2 --dist loadfile the test processes take
    # modules in this order (--no-loadscope-reorder, pyproject.toml), so the run ends on short ones, not with one
    # process idle while the other works through a two-minute launch
    seconds: dict = {}
    for item in items:
        seconds[item.path] = seconds.get(item.path, 0.0) + known.get(item.nodeid, 0.0)
    first = {path: i for i, path in enumerate(seconds)}
    items.sort(key=lambda item: (-seconds[item.path], first[item.path]))


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    # under pytest -n, the controller hears every worker's reports: only it writes the file
    worker = hasattr(session.config, "workerinput")
    if session.config.getoption("--record-durations") and _measured and not worker:
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        config = session.config
        if config.getoption("markexpr") or config.getoption("keyword"):
            # a tier (-m "not slow") or a selection: the tests not run keep their timings, and a test run keeps
            # the larger of the two. Run alone, the fast tier measures what the full run hides: the first test
            # to ask for a split pays for it (support/split_memo.py), where in the full run a slow test had
            known.update({k: max(round(v, 2), known.get(k, 0.0)) for k, v in _measured.items()})
        else:
            ran = {k.split("::")[0] for k in _measured}   # a module run now: its tests as they are now, no old ids
            known = {k: v for k, v in known.items() if k.split("::")[0] not in ran}
            known.update({k: round(v, 2) for k, v in _measured.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")
