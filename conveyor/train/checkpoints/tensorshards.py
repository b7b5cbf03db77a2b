"""Tensor-parallel shards in a checkpoint under torchrun: written and read as the parts
of whole tensors.

A tensor-parallel rank holds its shard of a split weight as a plain tensor under the
plain model's name (:mod:`conveyor.tensor.apply`). Handed to DCP as such, the T shards
of one name would look like copies of one tensor (DCP keeps one of them) and be checked
against each other's checksums. Here each shard, and the optimizer's moments of its
weight, become a DTensor sharded over the stage's tensor group before DCP sees them:
DCP writes each rank's part of the whole tensor, its index holds the whole shape, and a
load reads whatever part the template asks for, so that the same checkpoint loads at
another tensor-parallel size (or none: plain whole tensors), and ``load_weights`` gives
the whole tensors by plain names::

    rank t of T:   "model.4.feed_forward.0.weight"  (hidden/T, width)  shard t
    to DCP:        DTensor of (hidden, width), Shard(0) over the tensor group
    on disk:       one tensor (hidden, width), T chunks
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from conveyor.graph.weights import SHARD

__all__: list[str] = []


def split_weights(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """{plain name: (dimension, index, parts)} of the model's tensor-parallel shards."""
    return {name: getattr(tensor, SHARD) for name, tensor in
            model.state_dict(keep_vars=True).items() if hasattr(tensor, SHARD)}


def whole_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """The shape of each of the model's tensors by plain name, a shard's that of its
    whole tensor."""
    shapes = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        shape = list(tensor.shape)
        if hasattr(tensor, SHARD):
            dim, _, parts = getattr(tensor, SHARD)
            shape[dim] *= parts
        shapes[name] = torch.Size(shape)
    return shapes


def as_whole(state: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state`` ({"model": ..., "optimizer": {name: {key: tensor}}}) with each shard,
    and each optimizer tensor of a shard's weight but its step count, as a DTensor of
    the whole tensor over the tensor group (the same storage)."""
    split = split_weights(model)
    if not split:
        return dict(state)
    from torch.distributed.tensor import DTensor, Shard

    mesh: Any = getattr(model, "topology").mesh["tensor"]  # a pipeline's (its shards')
    return _changed(state, split, lambda t, name: DTensor.from_local(
        t, mesh, [Shard(split[name][0])], run_check=False) if t.dim() else t)


def as_local(state: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state`` with each DTensor :func:`as_whole` made this rank's shard again (FSDP's
    own DTensors stay as they are)."""
    return _changed(state, split_weights(model),
                    lambda t, _: t.to_local() if hasattr(t, "to_local") else t)


def _changed(state: Mapping[str, Any], split: Mapping[str, Any],
             change: Any) -> dict[str, Any]:
    """``state`` with ``change(tensor, name)`` in place of each tensor of a name in
    ``split``, the model's and the optimizer's."""
    changed = dict(state)
    changed["model"] = {name: change(t, name) if name in split else t
                        for name, t in state["model"].items()}
    if "optimizer" in state:
        changed["optimizer"] = {name: {key: change(t, name) if name in split else t
                                       for key, t in kept.items()}
                                for name, kept in state["optimizer"].items()}
    return changed
