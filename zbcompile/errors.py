"""zbcompile's exception types.

Every error we raise on bad input is one of these, and its message says where the problem is, what is
wrong and how to fix it. `ZBCompileError` is the root, so a caller can catch all of ours at once.
"""

__all__ = [
    "ZBCompileError",
    "ScheduleError",
    "SimulationError",
    "TraceError",
    "PartitionError",
    "SplitError",
    "VocabError",
    "LoweringError",
    "OffloadError",
    "UsageError",
    "DisagreementError",
    "RuntimeFailure",
    "CheckpointError",
    "CaptureError",
    "ZBCompileWarning",
]


class ZBCompileError(Exception):
    """Root of every error zbcompile raises on purpose."""


class ScheduleError(ZBCompileError, ValueError):
    """A schedule cannot be built or is malformed (unknown name, too few microbatches, a missing action)."""


class SimulationError(ZBCompileError):
    """A schedule deadlocks or breaks a dependency when simulated; the message shows the rank x step grid."""


class TraceError(ZBCompileError):
    """The model or loss cannot be captured as one graph (data-dependent control flow, non-scalar loss)."""


class PartitionError(ZBCompileError):
    """The model cannot be cut into the requested stages (unknown split point, too few modules)."""


class SplitError(ZBCompileError):
    """A stage cannot be split into F, B and W, or a split pass broke the stage IR's contract (the boundary
    checks between the split passes: a bug of ours, and the message says which pass)."""


class VocabError(SplitError):
    """vocab_parallel=True on a step that is not an embedding lookup ... a linear layer to V logits ->
    cross-entropy, or in a form the vocabulary shards cannot reproduce exactly (label smoothing, class weights)."""


class LoweringError(ZBCompileError):
    """A schedule and the stage graphs cannot be lowered into rank programs."""


class OffloadError(ZBCompileError, ValueError):
    """No choice of offloaded activations fits a device-memory budget, or the budget itself is malformed; the
    message shows each rank's peak with and without offload and the smallest budget that works."""


class UsageError(ZBCompileError, ValueError):
    """A call's arguments do not fit together: pp against the process group, a 2-D mesh, a batch of another
    shape than the compiled one, a meta-device model that nothing can initialize."""


class DisagreementError(UsageError):
    """The ranks of one pipeline compiled different things (model, options, versions) or were handed different
    batches; raised on every rank, naming the first difference and the ranks on each side."""


class RuntimeFailure(ZBCompileError, RuntimeError):
    """A pipeline step failed at run time (a peer died or stalled, a wait timed out)."""


class CheckpointError(ZBCompileError, ValueError, RuntimeError):   # (nn.Module.load_state_dict raises RuntimeError)
    """A checkpoint or state dict does not fit the model it is loaded into (missing or unexpected keys, other
    shapes): refused before any tensor is written."""


class CaptureError(ZBCompileError):
    """A step cannot be captured as one CUDA graph (a receive into a fresh buffer, a timed wait, an `.item()` in a
    stage graph), or CUDA graphs were asked for without a CUDA device; the message lists every problem, each
    with the op or graph node, why, and the fix (zbcompile.passes.analysis.capture)."""


class ZBCompileWarning(UserWarning):
    """The step is right, but something the user may rely on behaves differently from eager training."""
