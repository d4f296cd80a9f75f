"""Helpers shared by the tests and their worker processes, imported as `from support.models import gpt`.

`tests/` is on the import path: `pythonpath = ["tests"]` in pyproject.toml's [tool.pytest.ini_options] for the
test process (under `pytest` and `python -m pytest` alike), and PYTHONPATH for the processes `support.launch`
starts. Nothing here is a test.

    models.py        small models: factories returning a Case (model, loss_fn, example, max_stages)
    zoo.py           transformers architectures from tiny random configs (no downloads)
    reference.py     the smallest pipeline runtime (stage graphs run in order) against eager autograd
    schedules.py     hand-built schedules whose timings can be worked out by hand
    threaded.py      every rank's program as a thread of this process (the loopback world)
    graph_standin.py a CPU stand-in for the CUDA graph API
    launch.py        multi-process launches (gloo on 127.0.0.1): ranks, timeouts, killing
    forked.py        the warm interpreter launched ranks and CLI runs are forked from (no imports per rank)
    ckpt.py          the models, batches and eager reference of the checkpoint tests and their workers
    dist_cases.py    what a multi-process test module parametrizes over and its worker runs
"""

import os as _os
import sys as _sys

if _os.environ.get("ZB_TEST_SPLIT_DIR") and "pytest" not in _sys.modules:
    # a rank launched by support/launch.py: share the test session's splits (split_memo.py), before the worker
    # imports split_model
    from support import split_memo as _split_memo

    _split_memo.install_from_environment()
