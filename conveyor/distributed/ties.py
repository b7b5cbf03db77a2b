"""Weights tied across stages: one copy per stage, kept equal by summed gradients.

A language model often uses one matrix as its input embedding (first stage) and its
output head (last stage). Declared once (the layers share the Parameter, or the names
are listed in ``tie_weights``), the weight becomes one copy per stage that uses it; the
copies start equal, :func:`conveyor.gradients.sum_tied_gradients` gives each the sum
of their gradients, and so every optimizer step keeps them equal, as the plain model's
single weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.distributed.topology import Topology
from conveyor.errors import BalanceError
from conveyor.distributed.gradients import TiedParameter

__all__: list[str] = []


def find_ties(layers: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, ...]]:
    """Names of parameters that are one Parameter object used by different layers."""
    uses: dict[int, list[str]] = {}
    for name, layer in layers:
        for path, param in layer.named_parameters(remove_duplicate=False):
            uses.setdefault(id(param), []).append(f"{name}.{path}")
    return [tuple(names) for names in uses.values()
            if len({n.split(".", 1)[0] for n in names}) > 1]


def tie_layers(
    groups: Sequence[tuple[str, ...]],
    stage_layers: Mapping[int, list[tuple[str, nn.Module]]],
    stage_of_layer: Mapping[str, int],
    topology: Topology,
    stage_ranks: Sequence[int],
) -> list[TiedParameter]:
    """Gives each local stage its own copy of every tied weight, equal to the others.

    Args:
        groups: each a tuple of parameter names (plain-model names) that are one weight.
        stage_layers: the local stages' layers, by stage.
        stage_of_layer: the stage of every layer of the model, by layer name.
        topology: where this process sits (process groups are made for distributed ties).
        stage_ranks: the pipeline rank of each stage.

    Raises:
        BalanceError: a name does not belong to the model.
    """
    ties = []
    for names in groups:
        stages = sorted({_stage_of(name, stage_of_layer) for name in names})
        if len(stages) < 2:
            continue  # used within one stage: autograd sums the uses itself
        tie = TiedParameter(names=tuple(names))
        claimed: dict[int, nn.Parameter] = {}
        for s in stages:
            if s not in stage_layers:
                continue
            copy = _own_copy(names, s, stage_layers[s], stage_of_layer, claimed)
            tie.copies.append(copy)
        tie.counted = stages[0] in stage_layers
        if topology.distributed:
            tie.group = _tie_group(stages, stage_ranks, topology)
            if tie.group is not None and tie.copies:
                source = topology.global_rank(stage_ranks[stages[0]])
                dist.broadcast(tie.copies[0].data, src=source, group=tie.group)
        with torch.no_grad():  # copies start as the lowest stage's value
            for copy in tie.copies[1:]:
                copy.copy_(tie.copies[0])
        ties.append(tie)
    return ties


def _stage_of(name: str, stage_of_layer: Mapping[str, int]) -> int:
    layer = name.split(".", 1)[0]
    if layer not in stage_of_layer:
        raise BalanceError(f"tie_weights names {name!r}, but the model has no layer "
                           f"{layer!r}; use the names of model.state_dict()")
    return stage_of_layer[layer]


def _own_copy(names: Sequence[str], stage: int, layers: list[tuple[str, nn.Module]],
              stage_of_layer: Mapping[str, int],
              claimed: dict[int, nn.Parameter]) -> nn.Parameter:
    """The stage's parameter for the tie; a fresh copy if another stage holds the object."""
    by_name = dict(layers)
    uses = [name for name in names if _stage_of(name, stage_of_layer) == stage]
    first = _resolve(by_name, uses[0])
    copy = first
    if id(first) in claimed:
        copy = nn.Parameter(first.detach().clone(), requires_grad=first.requires_grad)
    for name in uses:
        _assign(by_name, name, copy)
    claimed[id(copy)] = copy
    return copy


def _resolve(by_name: Mapping[str, nn.Module], name: str) -> nn.Parameter:
    layer, _, path = name.partition(".")
    try:
        return by_name[layer].get_parameter(path)
    except AttributeError as exc:
        raise BalanceError(f"tie_weights names {name!r}, which is not a parameter of the "
                           "model") from exc


def _assign(by_name: Mapping[str, nn.Module], name: str, param: nn.Parameter) -> None:
    layer, _, path = name.partition(".")
    owner_path, _, attribute = path.rpartition(".")
    owner = by_name[layer].get_submodule(owner_path) if owner_path else by_name[layer]
    setattr(owner, attribute, param)


def _tie_group(stages: Sequence[int], stage_ranks: Sequence[int], topology: Topology) -> Any:
    """The process group of the ranks holding copies, for this data replica.

    Every process must create every group, in the same order (a torch.distributed rule),
    so this loops over all replicas and returns the one this process belongs to.
    """
    pipeline_ranks = sorted({stage_ranks[s] for s in stages})
    if len(pipeline_ranks) < 2:
        return None
    mine = None
    for replica in range(topology.data_size):
        members = [k * topology.data_size + replica for k in pipeline_ranks]
        group = dist.new_group(members)
        if replica == topology.data_rank and topology.pipeline_rank in pipeline_ranks:
            mine = group
    return mine
