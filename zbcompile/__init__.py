"""zbcompile: a pipeline-parallel training compiler for PyTorch.

    model = zbcompile.compile(model, schedule="zbv", microbatches=8, loss_fn=loss_fn, example=(x_mb, y_mb))
    loss = model.step(x, y)

`compile` traces the training step, splits every stage into F / B / W graphs, lowers the schedule into one
straight-line fx program per rank and runs it; `split_model`, `generate`, `simulate` and the IR types are
the pieces, usable on their own.
"""

from zbcompile.api import PipelineModule, compile
from zbcompile.errors import ZBCompileError
from zbcompile.passes.schedules import generate
from zbcompile.schedule import Action, Kind, Schedule
from zbcompile.simulate import Costs, simulate
from zbcompile.split import split_model

__all__ = ["compile", "PipelineModule", "split_model", "generate", "simulate", "Costs", "Schedule", "Action",
           "Kind", "ZBCompileError"]
