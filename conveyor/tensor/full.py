"""The whole tensors of a tensor-parallel model, put back together from its shards."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.graph.weights import SHARD
from conveyor.tensor import regions

__all__: list[str] = []


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor-parallel shard replaced by the whole
    tensor (the plain model's, by the plain model's names), on every rank of its
    tensor group: a collective, so each rank of the group calls it alike.

    Under a pipeline each rank holds only its stages: this gives those stages' tensors.
    """
    groups = tensor_groups(module)
    return {name: whole_of(tensor, groups)
            for name, tensor in module.state_dict(keep_vars=True).items()}


def tensor_groups(module: nn.Module) -> dict[int, Any]:
    """The tensor group of each split parameter of ``module``, by the parameter's id."""
    return {id(param): sub._tp for sub in module.modules() if hasattr(sub, "_tp")
            for param in sub.parameters(recurse=False)}


def whole_of(tensor: torch.Tensor, groups: dict[int, Any]) -> torch.Tensor:
    """``tensor`` whole: a shard (of a parameter in ``groups``, from
    :func:`tensor_groups`) put together over its group, a collective; any other as it
    is (detached)."""
    shard = getattr(tensor, SHARD, None)
    group = groups.get(id(tensor))
    if shard is None or group is None:
        return tensor.detach()
    return full_tensor(tensor.detach(), shard, group.name, group.seconds)


def full_tensor(shard: torch.Tensor, where: tuple[int, int, int], group: str,
                seconds: float) -> torch.Tensor:
    """The whole tensor of which ``shard`` is part ``index`` of ``parts`` along ``dim``
    (``where``), summed over the group from each rank's part laid into zeros (exact)."""
    dim, index, parts = where
    size = shard.shape[dim]
    full_shape = list(shard.shape)
    full_shape[dim] = size * parts
    full = shard.new_zeros(full_shape)
    full.narrow(dim, index * size, size).copy_(shard)
    return regions.sum_over(full, group, seconds, "the gathering of a tensor-parallel weight")


def full_grad(param: torch.Tensor, group: str, seconds: float) -> torch.Tensor | None:
    """The whole gradient of a parameter (a shard's, put together; a whole one's, as
    it is), or None without one."""
    if param.grad is None:
        return None
    shard = getattr(param, SHARD, None)
    if shard is None:
        return param.grad.detach()
    return full_tensor(param.grad.detach(), shard, group, seconds)
