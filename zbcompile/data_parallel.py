"""Replicated data parallelism across pipelines: `zb.compile(..., group=mesh)` with a 2-D DeviceMesh whose
dimensions are named "dp" and "pp".

    mesh = init_device_mesh("cuda", (dp, pp), mesh_dim_names=("dp", "pp"))
    pipe = zb.compile(model, schedule="zbv", microbatches=8, loss_fn=loss_fn, example=(x_mb, y_mb), group=mesh)
    loss = pipe.step(x, y)        # the global batch, on every rank; the global mean loss

Every dp replica is one pipeline running the same programs (compiled once per rank, as without dp) on its share
of the global batch: rows [d * B/dp, (d + 1) * B/dp) for replica d, in `microbatches` microbatches. The ranks that
hold the same pipeline rank in every replica form a "dp" group; through it

- at `place`: the replicas' fingerprints are compared (zbcompile/agreement.py) and every parameter and buffer is
  broadcast from replica 0 (DDP's start), so replicas that initialized differently start equal;
- in each step: the program itself averages every gradient over the replicas (DDP semantics: what a step adds
  to `.grad` is averaged). The lowering (passes/lower/dp_reduce.py) buckets the gradients that become final
  together and posts each bucket's all-reduce right after the op that finishes them, so it overlaps the rest of
  the step's B and W work; the waits come at the end, where the optimizer needs the gradients. The loss
  returned is the global mean;
- `evaluate` averages the loss and `pipe(x)` gathers the replicas' outputs in batch order.

With dp_batch="local" each replica is handed its own rows instead (the batch check then compares only the
ranks of one pipeline). Buffers (BatchNorm's running statistics) are updated per replica from its own share, as
DDP with broadcast_buffers=False.

With dp_shard=True (ZeRO-3 / FSDP2 semantics) each replica keeps only its rows of every parameter: the
parameters are DTensors sharded on dim 0 over the "dp" group (`shard_params`), so `.grad` and the optimizer's
state are sharded too and torch.distributed.checkpoint saves them as it saves FSDP2's. The program gathers the
whole parameters where its actions read them and reduce-scatters each gradient where it is final
(passes/lower/dp_shard.py); norms and inf checks add the replicas' shards (`reduce`).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from zbcompile.errors import RuntimeFailure, UsageError

__all__ = ["Replicas"]

# the data-parallel options: one set to other than its default without a "dp" mesh dimension is refused
_DP_OPTIONS = ("dp_shard", "dp_batch", "dp_bucket_mb", "dp_overlap", "dp_w_pieces")


class Replicas:
    """This rank's data-parallel group: the same pipeline rank in every replica."""

    def __init__(self, group, timeout: float, sharded: bool = False, job_ranks: Sequence[int] = ()) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.timeout = timedelta(seconds=timeout)
        self.sharded = sharded
        self.mesh = None   # the DeviceMesh of `group` the sharded parameters are DTensors over (shard_params)
        self.job_ranks = tuple(sorted(job_ranks))   # every rank of the (dp, pp) mesh
        self._job = None

    def job_group(self):
        """A group of every rank of the (dp, pp) mesh (made when first asked for, on every rank of it: a sharded
        checkpoint is written by all of them together)."""
        if self._job is None:
            self._job = dist.new_group(list(self.job_ranks), timeout=self.timeout, use_local_synchronization=True)
        return self._job

    @classmethod
    def of(cls, options, group) -> Replicas | None:
        """The Replicas of compile's options and the mesh's "dp" group (split_mesh's), or None for one replica;
        UsageError for a data-parallel option set without a 2-D mesh (a "dp" dimension of size 1: allowed)."""
        given = [f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options)
                 if f.name in _DP_OPTIONS and getattr(options, f.name) != f.default]
        if given and group is None:   # else a choice that changes nothing, silently (as dp_gather's, options.py)
            raise UsageError(f"{', '.join(given)}: data-parallel option(s), but no 2-D (\"dp\", \"pp\") mesh was "
                             "given: pass group=init_device_mesh(device, (dp, pp), mesh_dim_names=(\"dp\", \"pp\")), "
                             "or drop them")
        if group is None or group.size() < 2:
            return None
        return cls(group, options.timeout, sharded=options.dp_shard,
                   job_ranks=options.group.mesh.flatten().tolist())

    def start(self, model: nn.Module, params: dict, buffers: dict, device: torch.device) -> dict:
        """Replica 0's parameters and buffers on every replica (DDP's start); sharded, each replica then keeps
        its rows (shard_params). Returns the parameters by name, as the program reads them."""
        self.broadcast_state([*params.values(), *buffers.values()])
        if not self.sharded:
            return params
        self.shard_params(model, list(params), device)
        return {n: model.get_parameter(n) for n in params}

    def shard_params(self, model: nn.Module, names: Sequence[str], device: torch.device) -> None:
        """Replace each parameter `names` names in `model` (under every name it has: a tied one is one
        Parameter) by a DTensor Parameter over the data-parallel group holding this replica's rows: dim 0 cut as
        torch.chunk cuts it (FSDP2's and Shard(0)'s layout; a replica past the last chunk holds 0 rows), a 0-dim
        or empty parameter replicated whole. The values are the replica's own (broadcast from replica 0 first)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.mesh = self.mesh or DeviceMesh.from_group(self.group, device.type)
        new: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for n in names:
                p = model.get_parameter(n)
                if id(p) in new or isinstance(p, DTensor):
                    continue
                if p.dim() and p.shape[0]:
                    c = -(-p.shape[0] // self.size)
                    local, placement = p.detach()[self.rank * c:(self.rank + 1) * c].clone(), Shard(0)
                else:
                    local, placement = p.detach().clone(), Replicate()
                whole = DTensor.from_local(local, self.mesh, [placement], run_check=False, shape=p.shape,
                                           stride=p.stride())
                new[id(p)] = nn.Parameter(whole, requires_grad=p.requires_grad)
            for mod in model.modules():
                for k, p in list(mod._parameters.items()):
                    if p is not None and id(p) in new:
                        mod._parameters[k] = new[id(p)]

    def reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
        """`values` (a small tensor) summed ("sum") or maxed ("max") over the replicas: a sharded gradient's
        partial norms."""
        out = values.to(self._device(values.device)).clone()
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        self._wait(dist.all_reduce(out, op=reduce_op, group=self.group, async_op=True), "reducing gradient norms")
        return out.to(values.device)

    def share(self, batch: Sequence[torch.Tensor], microbatches: int, what: str) -> tuple[torch.Tensor, ...]:
        """This replica's rows of the global batch; UsageError where a batch does not split into dp x m."""
        n = self.size * microbatches
        for i, t in enumerate(batch):
            rows = t.shape[0] if t.dim() else 0
            if rows % n or not rows:
                raise UsageError(f"{what}(): batch argument {i} has {rows} rows, which do not split into "
                                 f"dp={self.size} replicas x {microbatches} microbatches; hand every rank the global "
                                 f"batch, a multiple of {n} rows")
        return tuple(t.chunk(self.size)[self.rank] for t in batch)

    def _wait(self, work, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as e:
            raise RuntimeFailure(f"dp rank {self.rank}: {what} over the data-parallel group failed: {e}") from e
        if ok is False:
            raise RuntimeFailure(f"dp rank {self.rank}: {what} over the data-parallel group did not finish within "
                                 f"{self.timeout.total_seconds()} s")

    def broadcast_state(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replica 0's values of `tensors` (this rank's parameters and buffers) on every replica."""
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            works = [dist.broadcast(t.detach(), src, group=self.group, async_op=True) for t in tensors]
        for w in works:
            self._wait(w, "broadcasting replica 0's parameters")

    def mean(self, value: float, device: torch.device) -> float:
        """The mean of `value` over the replicas (the global batch's loss: replicas hold equal shares)."""
        t = torch.tensor([value], dtype=torch.float64, device=device)
        self._wait(dist.all_reduce(t, group=self.group, async_op=True), "averaging the loss")
        return float(t.item()) / self.size

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every replica (the inf / NaN check: a replica that skips its optimizer step
        alone would drift away from the others)."""
        t = torch.tensor([0.0 if flag else 1.0], device=self._device())
        self._wait(dist.all_reduce(t, group=self.group, async_op=True), "comparing the inf / NaN checks")
        return t.item() == 0.0

    def allgather(self, values: torch.Tensor) -> torch.Tensor:
        """Every replica's `values` (a small 1-d tensor) stacked in replica order (agreement.check_batch)."""
        values = values.to(self._device(values.device))
        parts = [torch.empty_like(values) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, values, group=self.group, async_op=True), "comparing the batches")
        return torch.stack(parts)

    def barrier(self, what: str) -> None:
        """Wait for every replica (a one-element all-reduce: a barrier that works on every backend)."""
        self._wait(dist.all_reduce(torch.zeros(1, device=self._device()), group=self.group, async_op=True), what)

    def _device(self, default: torch.device | str = "cpu") -> torch.device:
        """Where this group's collectives take their tensors: the current CUDA device on NCCL."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(default)

    def gather(self, tensors: Sequence[torch.Tensor], dims: Sequence[int | None] | None = None) -> list[torch.Tensor]:
        """Each tensor's replicas concatenated on its dim of `dims` (default 0) in replica order (the model's
        outputs, in batch order); a tensor whose dim is None (a parameter the model returns) as it is."""
        out = []
        for t, d in zip(tensors, dims if dims is not None else [0] * len(tensors)):
            if d is None:
                out.append(t)
                continue
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self._wait(dist.all_gather(parts, t.contiguous(), group=self.group, async_op=True),
                       "gathering the outputs")
            out.append(torch.cat(parts, d))
        return out
