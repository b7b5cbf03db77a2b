"""Splitting a model's planned modules over a stage's tensor group, in place.

Each planned ``nn.Linear`` or ``nn.Embedding`` keeps its name and class family (its
class becomes a subclass whose ``forward`` runs this rank's part and the group's
operators of :mod:`conveyor.tensor.regions`) and holds only this rank's shard, as a
plain ``nn.Parameter``: the model's ``parameters()``, ``state_dict()`` and gradients
are this rank's shards, each marked with :data:`~conveyor.graph.weights.SHARD` so that
``weights=`` reads only its slice and :func:`conveyor.tensor.full.full_state_dict`
puts the whole tensors back together. Applied before the cut, on every rank alike, so a
traced model is traced with its shards' shapes and a stage of layers runs them as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.errors import TensorParallelError
from conveyor.graph.weights import SHARD
from conveyor.tensor import regions
from conveyor.tensor.checks import check_sizes
from conveyor.tensor.plan import planned_modules, resolve_plan

__all__: list[str] = []


@dataclass(frozen=True)
class Group:
    """A stage's tensor group as its modules see it."""

    name: str  # the process group's registered name
    size: int
    rank: int
    seconds: float


class _Colwise(nn.Linear):
    _tp: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self._tp
        return F.linear(regions.tp_copy(x, g.name, g.seconds), self.weight, self.bias)


class _ColwiseGathered(nn.Linear):
    _tp: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self._tp
        local = F.linear(regions.tp_copy(x, g.name, g.seconds), self.weight, self.bias)
        return regions.tp_gather(local, g.name, g.seconds, g.size, g.rank)


class _Rowwise(nn.Linear):
    _tp: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self._tp
        out = regions.tp_reduce(F.linear(x, self.weight), g.name, g.seconds)
        return out if self.bias is None else out + self.bias


class _VocabEmbedding(nn.Embedding):
    _tp: Group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = self._tp
        rows = self.weight.shape[0]
        first = g.rank * rows
        outside = (ids < first) | (ids >= first + rows)
        local = torch.where(outside, torch.zeros_like(ids), ids - first)
        padding = self.padding_idx
        padding = padding - first if padding is not None and first <= padding < first + rows \
            else None
        found = F.embedding(local, self.weight, padding, self.max_norm, self.norm_type,
                            self.scale_grad_by_freq, self.sparse)
        found = found.masked_fill(outside.unsqueeze(-1), 0.0)
        return regions.tp_reduce(found, g.name, g.seconds)


#: style -> (the class a planned module becomes, {parameter: the dimension split})
_SPLITS: dict[str, tuple[type[nn.Module], dict[str, int]]] = {
    "colwise": (_Colwise, {"weight": 0, "bias": 0}),
    "colwise_gather_output": (_ColwiseGathered, {"weight": 0, "bias": 0}),
    "rowwise": (_Rowwise, {"weight": 1}),
    "embedding_rowwise": (_VocabEmbedding, {"weight": 0}),
}


def kind_of(module: nn.Module) -> str:
    """A module's class as a person knows it: a split one's as its own class and style
    ("Linear, colwise")."""
    for style, (split, _) in _SPLITS.items():
        if type(module) is split:
            return f"{split.__mro__[1].__name__}, {style}"
    return type(module).__name__


def apply_plan(model: nn.Module, tp_plan: str | Mapping[str, Any] | None, *, group: Group,
               config: Any = None) -> dict[str, str]:
    """Splits the modules ``tp_plan`` names over ``group``, in place; returns
    {module name: style} of those split or kept whole with a summed gradient.

    Raises:
        TensorParallelError: a style conveyor does not implement (named), a module no
            style fits, a size ``group.size`` does not divide (module, dimension and the
            sizes that would), a weight tied across differently split modules.
    """
    plan = resolve_plan(model, tp_plan)
    planned = planned_modules(model, plan)
    check_sizes(model, planned, group.size, config or getattr(model, "config", None))
    owners: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            style = planned.get(name, ("", ""))[0]
            first, cut = owners.setdefault(id(param), (style, _cut_of(style, attr)))
            if cut != _cut_of(style, attr):
                raise TensorParallelError(
                    f"{name}.{attr} is tied to a weight the plan splits otherwise "
                    f"({first or 'kept whole'} against {style or 'kept whole'}); "
                    "give tied modules one style, or untie them")
    shards: dict[int, nn.Parameter] = {}  # a tied weight: one shard for all its modules
    for name, (style, _) in planned.items():
        module = model.get_submodule(name)
        if style in _SPLITS:
            _split(module, name, style, group, shards)
    return {name: style for name, (style, _) in planned.items()}


def _cut_of(style: str, attr: str) -> Any:
    """How a style holds a module's parameter ``attr``: the dimension it splits (the
    same rows of a tied weight for an embedding's vocabulary and a head's outputs), or
    the style itself where it keeps the parameter whole."""
    dim = _SPLITS[style][1].get(attr) if style in _SPLITS else None
    return ("split", dim) if dim is not None else style


def summed_parameters(owner: nn.Module, styles: Mapping[str, str]) -> list[nn.Parameter]:
    """The parameters ``owner`` holds (once cut: this rank's stages, under the model's
    names) in a module kept whole whose gradient is summed over the tensor group. Read
    after the cut: materialising a meta model makes new parameters."""
    summed = [name for name, style in styles.items()
              if style == "replicated_with_grad_allreduce"]
    return [param for name, param in owner.named_parameters()
            if any(name.startswith(f"{module}.") for module in summed)]


def _split(module: nn.Module, name: str, style: str, group: Group,
           shards: dict[int, nn.Parameter]) -> None:
    """``module``'s parameters as this rank's shards, its class the style's (a weight
    split before, tied to another module's, takes that one's shard from ``shards``)."""
    kind, dims = _SPLITS[style]
    base = kind.__mro__[1]
    if type(module) is not base:
        raise TensorParallelError(
            f"{name} is a {type(module).__name__}, but {style!r} splits an {base.__name__}"
            f"{' (Conv1D keeps its weight transposed)' if type(module).__name__ == 'Conv1D' else ''}"
            f"; map it to a module conveyor splits, or give it no style")
    for attr, param in list(module.named_parameters(recurse=False)):
        dim = dims.get(attr)
        if dim is None:
            continue
        if id(param) not in shards:
            shard = param.detach().chunk(group.size, dim)[group.rank].clone()
            shards[id(param)] = nn.Parameter(shard, requires_grad=param.requires_grad)
            setattr(shards[id(param)], SHARD, (dim, group.rank, group.size))
        setattr(module, attr, shards[id(param)])
    module.__class__ = kind
    module._tp = group  # type: ignore[assignment]
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings = module.weight.shape[0]
