"""Data parallel in one process, without a process group: compile's `group` as a DeviceMesh (split_mesh) and the
sharded gradient reduction's packing (runtime.abi._reduce_scatter). The launches are in
tests/distributed/test_data_parallel.py."""

from __future__ import annotations

import types

import pytest
import torch

from zbcompile.distributed import split_mesh
from zbcompile.errors import UsageError
from zbcompile.runtime.abi import _reduce_scatter


class _Mesh:
    """What split_mesh reads of a torch DeviceMesh."""

    def __init__(self, shape, names, here=True):
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        self.ndim, self.mesh_dim_names, self.here = len(shape), names, here

    def get_group(self, dim=None):
        return f"group {dim}"

    def get_coordinate(self):
        return [0] * self.ndim if self.here else None


def test_a_mesh_that_would_run_otherwise_than_it_says_is_refused():
    """A 1-D mesh named 'dp' ran as one pipeline over its ranks, without a word; a mesh without this process
    raised torch's RuntimeError from mesh['pp'] on the ranks outside it."""
    with pytest.raises(UsageError, match="1-D DeviceMesh named 'dp'"):
        split_mesh(_Mesh((4,), ("dp",)))
    with pytest.raises(UsageError, match="this process is not in the DeviceMesh"):
        split_mesh(_Mesh((2, 1), ("dp", "pp"), here=False))
    mesh = _Mesh((4,), ("pp",))
    assert split_mesh(mesh) == (mesh, None)


def test_a_gradient_laid_out_transposed_packs_its_rows():
    """dp_shard with a parameter stored transposed (nn.Parameter(w.t())): its gradient has the parameter's
    strides, and packing it into the reduce-scatter's rows raised torch's 'view size is not compatible'."""
    grad = torch.arange(30.0).reshape(5, 6).t()   # [6, 5], not contiguous
    ctx = types.SimpleNamespace(dp_size=2, dp_rank=1, dp_pg=None)
    flat, _, views, _, _ = _reduce_scatter(ctx, "w", [grad])
    assert torch.equal(flat.view(2, -1), grad.reshape(2, 15))   # replica r's 3 rows in row r
    assert views == ((0, 15, (3, 5)),)
