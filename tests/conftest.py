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

    python -m pytest -q                                             everything (CI: .ci/run)
    python -m pytest -q -m "not slow and not dist"                  the edit loop: no multi-process runs, nothing slow
    python -m pytest -q tests/ir tests/split tests/schedule tests/lower   the compiler's layers on a CPU
    python -m pytest -q -m dist                                     the multi-process tests alone

Markers (declared in pyproject.toml, --strict-markers): dist (launches several processes), slow (more than a few
seconds), gpu (needs CUDA). Every test has a timeout (pytest-timeout, 1500 s); every launch kills all its ranks
on a failure or its own timeout (support/launch.py).
"""
