"""Gradients across ranks: data-parallel replicas and global norms.

After a pipelined step each stage holds the gradients of its own parameters (tied
weights' copies already summed, :mod:`conveyor.engine.ties`). Two things then need
more than one rank:

* data-parallel replicas of a stage average their gradients (as DDP would), or, for a
  ``(loss_sum, count)`` loss, sum them and divide by the count over every replica;
* clipping by the global norm needs the norm over every stage, counting a tied weight
  once.

(The step's loss and float16's overflow check, agreed on by every rank, are the
runtime's: :mod:`conveyor.runtime.steps`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.torchprivate import flatten_dense_tensors, unflatten_dense_tensors

__all__: list[str] = []

_BUCKET_BYTES = 25 << 20  # as DDP's default bucket


Reduce = Callable[[torch.Tensor, Any], None]  # reduce(tensor, op): an all-reduce over a group


def reduce_across_replicas(params: Sequence[nn.Parameter], group: Any, replicas: int,
                           divisor: float, reduce: Reduce) -> None:
    """Sums gradients over the data-parallel replicas, in flattened buckets, and divides
    them by ``divisor``: ``replicas`` to average them as DDP does, or the step's count of
    a ``(loss_sum, count)`` loss over every replica. ``reduce(flat, op)`` sums a bucket
    over ``group`` (with a bounded wait: see :mod:`conveyor.distributed.faults.collective`)."""
    grads = [p.grad for p in params if p.grad is not None]
    if replicas == 1:
        if divisor != 1:
            for grad in grads:
                grad.div_(divisor)
        return
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}  # bytes in the last bucket
    for grad in grads:
        key = (grad.device, grad.dtype)
        bucket_list = buckets.setdefault(key, [[]])
        if filled.get(key, 0) > _BUCKET_BYTES:
            bucket_list.append([])
            filled[key] = 0
        bucket_list[-1].append(grad)
        filled[key] = filled.get(key, 0) + grad.numel() * grad.element_size()
    for bucket_list in buckets.values():
        for bucket in bucket_list:
            flat = flatten_dense_tensors(bucket)
            reduce(flat, dist.ReduceOp.SUM)
            for grad, reduced in zip(bucket, unflatten_dense_tensors(flat, bucket)):
                torch.div(reduced, divisor, out=grad)  # divided as it is copied back


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's parameters and gradients); a plain
    tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def clip_grad_norm(params: Sequence[nn.Parameter], counted: Sequence[nn.Parameter],
                   max_norm: float, norm_type: float, group: Any,
                   reduce: Reduce, share: float = 1.0, *,
                   parts: Callable[[nn.Parameter], int] = lambda p: 1) -> torch.Tensor:
    """Scales ``params``' gradients so that their global norm is at most ``max_norm``.

    Args:
        params: every local parameter, tied copies included (all are scaled).
        counted: the local parameters whose gradients make up the norm (each tied
            weight once).
        max_norm: the largest allowed norm.
        norm_type: the p of the p-norm (``float("inf")`` for the largest entry).
        group: the processes whose norms combine (None: this one); with sharded
            gradients, ``reduce`` also combines the shards of each stage.
        reduce: ``reduce(norm, op)`` combines the norms over ``group`` (with a bounded
            wait).
        share: the part of this process's ``norm ** p`` the sum over ``group`` counts:
            1 / r where r processes hold the same gradients (a replicated stage).
        parts: of a parameter, how many processes hold the same whole gradient that
            ``reduce`` also sums over (a weight kept whole over a tensor group of T:
            T; a tensor-parallel shard, or none: 1); each counts 1 / parts of it.

    Returns:
        The global norm before clipping.
    """
    grads = [(local_shard(p.grad), parts(p)) for p in counted if p.grad is not None]
    device = grads[0][0].device if grads else next(iter(params)).device
    inf = norm_type == float("inf")
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type).to(device)
                             for g, _ in grads])
        counts = norms.new_tensor([1 / count for _, count in grads])
        local = norms.max() if inf else (norms.pow(norm_type) * counts).sum()
    else:
        local = torch.zeros((), device=device)
    local = local.to(torch.float64)
    if not inf:
        local = local * share
    if group is not None:
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        reduce(local, op)
    total = local if inf else local.pow(1.0 / norm_type)
    coefficient = max_norm / (float(total) + 1e-6)
    if coefficient < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)
    return total.to(torch.float32)
