"""The runtime: what runs a lowered rank program.

    abi.py       the functions the generated program calls (P2P, frees, gradient hand-off) and its StepContext
    eager.py         RankRuntime: feeds the program, runs it once per step, gathers loss and timings
    graphs.py        CapturedStep: the whole step as one CUDA graph after warm-up (cuda_graphs=True)
    replay_check.py  the replay-identity check: same static memory and messages every step, nothing escapes
    memory.py        measuring a step's memory (the CUDA allocator, or a storage tracker on CPU)
    host.py          process-wide host tuning: glibc's malloc thresholds, gloo's I/O thread scheduling
    loopback.py      an in-process process group: every rank a thread (tests, single-process tools)
"""

from zbcompile.runtime.abi import StepContext
from zbcompile.runtime.eager import RankRuntime, StepTimings, data_specs

__all__ = ["RankRuntime", "StepTimings", "StepContext", "data_specs"]
