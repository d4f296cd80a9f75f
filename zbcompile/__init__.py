"""zbcompile: a pipeline-parallel training compiler for PyTorch.

    model = zbcompile.compile(model, schedule="zbv", microbatches=8, loss_fn=loss_fn, example=(x_mb, y_mb))
    loss = model.step(x, y)

`compile` traces the training step, splits every stage into F / B / W graphs, lowers the schedule into one
straight-line fx program per rank and runs it; `split_model`, `generate`, `simulate` and the IR types are
the pieces, usable on their own.
"""

import importlib

from zbcompile.errors import ZBCompileError, ZBCompileWarning
from zbcompile.passes.schedules import generate
from zbcompile.ir.schedule import Action, Kind, Schedule
from zbcompile.simulate import Costs, simulate

__all__ = ["compile", "PipelineModule", "split_model", "generate", "simulate", "Costs", "Schedule", "Action",
           "Kind", "ZBCompileError", "ZBCompileWarning"]

# The tracing and runtime half pulls in torch.export and functorch (seconds); planning schedules needs
# neither, so those names load on first use and `zbcompile plan` starts fast.
_LAZY = {"compile": "zbcompile.api", "PipelineModule": "zbcompile.pipeline_module", "split_model": "zbcompile.split"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zbcompile' has no attribute {name!r}")
