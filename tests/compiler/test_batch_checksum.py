"""The batch agreement's checksum (zbcompile/agreement.py: one all-gather of it on the first step) tells apart
batches that differ anywhere a rank could be handed another batch."""

from __future__ import annotations

import torch

from zbcompile.agreement import batch_checksum


def test_batches_differing_only_in_the_imaginary_part_have_different_checksums():
    """The cast to float64 dropped the imaginary part (with torch's warning on every check): ranks handed
    batches that differed only there were not told."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.complex128)
    other = torch.complex(x.real, x.imag + 1.0)
    assert not torch.equal(batch_checksum([x]), batch_checksum([other]))
    assert torch.equal(batch_checksum([x]), batch_checksum([x.clone()]))


def test_shuffled_rows_and_cancelling_edits_have_different_checksums():
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    edited = x.clone()
    edited[0, :4] += torch.tensor([1.0, -1.0, -1.0, 1.0])   # the plain sum cannot see it
    for other in (x.flip(0), edited):
        assert not torch.equal(batch_checksum([x]), batch_checksum([other]))
    ids = torch.randint(0, 100, (4, 8))
    assert not torch.equal(batch_checksum([ids]), batch_checksum([ids.flip(1)]))
