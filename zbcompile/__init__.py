"""zbcompile: a pipeline-parallel training compiler for PyTorch."""

from zbcompile.errors import ZBCompileError
from zbcompile.schedule import Action, Kind, Schedule

__all__ = ["Action", "Kind", "Schedule", "ZBCompileError"]
