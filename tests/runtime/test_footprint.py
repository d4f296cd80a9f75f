"""StepFootprint (zbcompile/runtime/replay_check.py): what a step allocated and kept is found, even at an address
the step had already used and freed (the allocator hands freed addresses out again)."""

import torch

from zbcompile.runtime import replay_check
from zbcompile.runtime.replay_check import StepFootprint


def test_an_escape_at_a_reused_address_is_found(monkeypatch):
    """The allocator's reuse made certain: every storage of n elements gets the address n."""
    monkeypatch.setattr(replay_check, "_key", lambda t: t.untyped_storage().nbytes())
    with StepFootprint() as fp:
        freed = torch.ones(1000)
        del freed                    # the step frees the memory at "address" 4000 ...
        kept = torch.zeros(1000)     # ... and allocates there again a storage that outlives the step
    assert fp.escaped() == [4000]
    assert fp.escaped(keep=[kept]) == []


def test_what_the_step_frees_does_not_escape():
    with StepFootprint() as fp:
        t = torch.ones(1000) + 1
        del t
    assert fp.escaped() == []


def test_an_escape_is_found_with_real_addresses():
    kept = []
    with StepFootprint() as fp:
        kept.append(torch.ones(1000) * 2)
    assert fp.escaped() == [kept[0].untyped_storage().data_ptr()]
