"""What a failed call leaves behind: a PipelineModule whose process groups are unusable refuses every later call.

A RuntimeFailure (a dead or stalled peer) or any error raised while a program ran stops a step with messages
posted that no later step matches; `unusable_after_a_failure` wraps the PipelineModule methods that run programs
so that the next call says so at once instead of waiting on the peers for the timeout.
"""

from __future__ import annotations

import functools

from zbcompile.errors import RuntimeFailure

__all__ = ["unusable_after_a_failure", "RESTART"]

RESTART = ("The pipeline's process groups cannot be used after this (a peer is dead or stalled, messages may be "
            "half-delivered): end this process on every rank and restart the job (torchrun --max-restarts N), "
            "resuming from the last checkpoint (zbcompile.checkpoint.load)")


def unusable_after_a_failure(method):
    """A RuntimeFailure leaves the pipeline's process groups unusable: say so, and refuse every later call at
    once instead of waiting on a dead peer again. So does any error raised while a program ran (an IndexError
    from an embedding, a KeyboardInterrupt): it is raised as it is, but its step stopped with messages posted
    that no later step matches, so the next call must not wait on the peers for the timeout."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._failure is not None:
            raise RuntimeFailure(f"rank {self.rank}: this pipeline failed earlier ({self._failure}). {RESTART}")
        try:
            return method(self, *args, **kwargs)
        except RuntimeFailure as e:
            self._failure = str(e).splitlines()[0][:300]
            raise RuntimeFailure(f"{e}\n{RESTART}") from e
        except BaseException:
            failed = next((r.failed for r in self._runtimes if r.failed is not None), None)
            if failed is not None:
                self._failure = f"an earlier call failed on this rank while its program ran: {failed}"
            raise
    return call
