"""Weights tied across stages: one copy per stage, kept equal by summed gradients.

A language model often uses one matrix as its input embedding (first stage) and its
output head (last stage). Declared once (the layers share the Parameter, or the names
are listed in ``tie_weights``), the weight becomes one copy per stage that uses it, on
that stage's device; the copies start equal, :func:`sum_tied_gradients` gives each the
sum of their gradients (the plain weight's gradient), and so every optimizer step keeps
them equal, as the plain model's single weight. Between processes,
:mod:`conveyor.distributed.ties` adds the process group that the sum runs over.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.errors import BalanceError

__all__: list[str] = []

NamedLayers = list[tuple[str, nn.Module]]


@dataclass
class TiedParameter:
    """One weight used by several stages, and the copies of it held in this process.

    Attributes:
        names: the parameter's names in the plain model, one per use.
        stages: every stage that uses the weight, in increasing order.
        copies: this process's copies (one per local stage that uses the weight).
        counted: whether the first copy here is the one counted in norms (the copy of
            the lowest stage that uses the weight).
        group: the processes holding copies, to sum over (None in one process).
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    copies: list[nn.Parameter] = field(default_factory=list)
    counted: bool = False
    group: Any = None

    def duplicates(self) -> list[nn.Parameter]:
        """The copies here that a norm over all parameters must not count again."""
        return self.copies[int(self.counted):]


def find_ties(layers: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, ...]]:
    """Names of parameters that are one Parameter object used by different layers."""
    uses: dict[int, list[str]] = {}
    for name, layer in layers:
        for path, param in layer.named_parameters(remove_duplicate=False):
            uses.setdefault(id(param), []).append(f"{name}.{path}")
    return [tuple(names) for names in uses.values()
            if len({n.split(".", 1)[0] for n in names}) > 1]


def stage_of_layer(names: Sequence[str], starts: Sequence[int]) -> dict[str, int]:
    """The stage of every layer, by name; stage s holds layers ``starts[s]..starts[s+1]-1``."""
    return {name: s for s in range(len(starts) - 1) for name in names[starts[s]:starts[s + 1]]}


def distinct_per_stage(stage_layers: Mapping[int, NamedLayers]) -> dict[int, NamedLayers]:
    """The layers with a copy for each later stage that a layer object appears in again
    (one module used twice in an ``nn.Sequential``), so that every stage owns its layers;
    :func:`tie_layers` then keeps the copies' parameters tied."""
    placed: dict[int, int] = {}  # id of a layer object -> the stage it went to
    result = {}
    for s, named in stage_layers.items():
        result[s] = [(name, layer if placed.setdefault(id(layer), s) == s
                      else copy.deepcopy(layer)) for name, layer in named]
    return result


def tie_layers(groups: Sequence[tuple[str, ...]], stage_layers: Mapping[int, NamedLayers],
               stage_of_layer: Mapping[str, int],
               devices: Mapping[int, torch.device]) -> list[TiedParameter]:
    """Gives each local stage its own copy of every tied weight, equal to the others.

    Args:
        groups: each a tuple of parameter names (plain-model names) that are one weight.
        stage_layers: the local stages' layers, by stage.
        stage_of_layer: the stage of every layer of the model, by layer name.
        devices: the device of each local stage (a copy is made there).

    Raises:
        BalanceError: a name does not belong to the model.
    """
    ties = []
    for names in groups:
        stages = tuple(sorted({_stage_of(name, stage_of_layer) for name in names}))
        if len(stages) < 2:
            continue  # used within one stage: autograd sums the uses itself
        tie = TiedParameter(names=tuple(names), stages=stages,
                            counted=stages[0] in stage_layers)
        claimed: set[int] = set()
        for s in stages:
            if s in stage_layers:
                tie.copies.append(_own_copy(names, s, stage_layers[s], stage_of_layer,
                                            devices[s], claimed))
        equalize(tie)
        ties.append(tie)
    return ties


def equalize(tie: TiedParameter) -> None:
    """Sets every local copy to the first one's value."""
    with torch.no_grad():
        for duplicate in tie.copies[1:]:
            duplicate.copy_(tie.copies[0])


def sum_tied_gradients(ties: Iterable[TiedParameter],
                       reduce: Callable[[torch.Tensor, Any], None] | None = None) -> None:
    """Gives every copy of each tied weight the sum of all copies' gradients.

    ``reduce(total, group)`` sums a tie's total over the processes of its group (a
    pipeline's all-reduce, whose wait is bounded; not needed in one process).
    """
    for tie in ties:
        if not tie.copies:
            continue
        total = torch.zeros_like(tie.copies[0])
        for held in tie.copies:
            if held.grad is not None:
                total += held.grad.to(total.device)
        if tie.group is not None:
            if reduce is None:
                raise ValueError("a weight tied across processes needs reduce=, an "
                                 "all-reduce with a bounded wait")
            reduce(total, tie.group)
        for held in tie.copies:
            held.grad = total.to(held.device, copy=True)


def _stage_of(name: str, stage_of_layer: Mapping[str, int]) -> int:
    layer = name.split(".", 1)[0]
    if layer not in stage_of_layer:
        raise BalanceError(f"tie_weights names {name!r}, but the model has no layer "
                           f"{layer!r}; use the names of model.state_dict()")
    return stage_of_layer[layer]


def _own_copy(names: Sequence[str], stage: int, layers: NamedLayers,
              stage_of_layer: Mapping[str, int], device: torch.device,
              claimed: set[int]) -> nn.Parameter:
    """The stage's parameter for the tie; a fresh copy if another stage holds the object."""
    by_name = dict(layers)
    uses = [name for name in names if _stage_of(name, stage_of_layer) == stage]
    param = _resolve(by_name, uses[0])
    if id(param) in claimed:
        param = nn.Parameter(param.detach().to(device, copy=True),
                             requires_grad=param.requires_grad)
    for name in uses:
        _assign(by_name, name, param)
    claimed.add(id(param))
    return param


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
