"""The pipeline's host-side all-gathers (RankRuntime.allgather), labelled with the call that made them.

Every rank must make the same gathers in the same order. Where two ranks call different methods together
(`clip_grad_norm_` on one, `grads_finite` on another; `evaluate` and `pipe(x)`), their values differ in
length, and gloo aborts the process from its I/O thread ("Received data size doesn't match expected size"),
where nothing can catch it, while the peer reads garbage. So each gather first exchanges a header of fixed size:
the payload's length, a checksum of the label and the label's first characters, and a small payload rides in it.
Ranks whose headers differ raise DisagreementError together, naming each rank's call, before any gather of
another size.

    [numel, crc32(label), LABEL_CHARS character codes, up to INLINE values]      float64, HEADER wide
"""

from __future__ import annotations

import zlib

import torch

from zbcompile.errors import DisagreementError

__all__ = ["HEADER", "INLINE", "header", "check_headers", "inline_values"]

LABEL_CHARS = 54
INLINE = 8
HEADER = 2 + LABEL_CHARS + INLINE


def header(values: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's header for gathering `values` (1-d, float64) under the label `what`."""
    row = torch.zeros(HEADER, dtype=torch.float64)
    row[0], row[1] = values.numel(), zlib.crc32(what.encode())
    codes = [ord(c) for c in what[:LABEL_CHARS]]
    row[2:2 + len(codes)] = torch.tensor(codes, dtype=torch.float64)
    if values.numel() <= INLINE:
        row[2 + LABEL_CHARS:2 + LABEL_CHARS + values.numel()] = values.detach().to("cpu", torch.float64)
    return row


def check_headers(rows: torch.Tensor, rank: int) -> None:
    """DisagreementError (on every rank: each sees every header) where the ranks' labels or lengths differ."""
    kinds = [(int(r[0]), int(r[1])) for r in rows.tolist()]
    if len(set(kinds)) == 1:
        return
    calls = "; ".join(f"rank {k}: {_label(row)!r} ({n} values)" for k, (row, (n, _)) in enumerate(zip(rows, kinds)))
    raise DisagreementError(
        f"rank {rank}: the ranks made different calls of the pipeline together ({calls}). Every rank calls the "
        "same methods in the same order (step, evaluate, pipe(x), get_total_norm / clip_grad_norm_, grads_finite, "
        "with the same arguments); a call refused or skipped on one rank only (an exception caught there) puts "
        "them out of step: restart the job")


def inline_values(rows: torch.Tensor, numel: int) -> torch.Tensor:
    """The payloads that rode in the headers: [ranks, numel]."""
    return rows[:, 2 + LABEL_CHARS:2 + LABEL_CHARS + numel]


def _label(row: torch.Tensor) -> str:
    codes = [int(c) for c in row[2:2 + LABEL_CHARS].tolist()]
    return "".join(chr(c) for c in codes if c)
