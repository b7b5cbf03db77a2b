"""Weights that separate ranks hold separately though the model shares them: a tie the
pipeline cannot see (a layer holding another layer in a list), or one a layer function
did not declare. :mod:`conveyor.checking.compare` names them as the cause of a
gradient that differs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.checking import causes
from conveyor.checking.runs import PipelineRun
from conveyor.engine.ties import find_ties
from conveyor.graph.source import sequential_layers

__all__: list[str] = []


def hidden_ties(run: PipelineRun) -> dict[str, str]:
    """Parameters that a rank's layers used without holding them (a tie the pipeline
    cannot see): their gradient went into that rank's own copy of the model. Each is
    named with the cause the check reports."""
    found: dict[str, str] = {}
    if not run.rank_models:  # one model copy per process: nothing for another to hold
        return found
    ours = {id(p) for p in run.pipe.parameters()}
    ranks = run.pipe.schedule.stage_ranks
    by_name = {layer.name: layer for layer in run.layers}
    for rank, model in (run.rank_models or {}).items():
        mine = [layer for layer in run.layers if ranks[layer.stage] == rank]
        for name, param in model.named_parameters():
            if id(param) in ours or param.grad is None or not param.grad.any():
                continue
            owner = by_name.get(name.split(".", 1)[0])
            for layer in mine:
                path = (None if layer.module is None
                        else _path_to(layer.module, param, layer.name))
                if path is not None or layer is mine[-1]:
                    found.setdefault(name, causes.hidden_tie(
                        layer.describe(), layer.stage, name,
                        owner.describe() if owner else "another layer", path))
                    break
    return found


def undeclared_ties(run: PipelineRun, plain: nn.Module,
                    declared: list[tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """For a layer function: parameters one in the model it builds but not declared
    tied, so that separate ranks hold separate weights."""
    by_name = {layer.name: layer for layer in run.layers}
    groups = {frozenset(group) for group in declared}
    missing = {}
    for group in find_ties(sequential_layers(plain)):
        stages = {by_name[n.split(".", 1)[0]].stage for n in group}
        if len(stages) > 1 and frozenset(group) not in groups:
            missing.update({name: group for name in group})
    return missing


def _path_to(root: nn.Module, target: torch.Tensor, prefix: str) -> str | None:
    """An attribute path from ``root`` to ``target`` through attributes that are not
    registered submodules or parameters (a list, a dict, a plain attribute)."""
    seen: set[int] = set()

    def walk(value: Any, path: str, hidden: bool, depth: int) -> str | None:
        if value is target:
            return path if hidden else None
        if id(value) in seen or depth > 6:
            return None
        seen.add(id(value))
        items: list[tuple[str, Any, bool]] = []
        if isinstance(value, nn.Module):
            items += [(f".{k}", v, hidden) for k, v in value._parameters.items()]
            items += [(f".{k}", v, hidden) for k, v in value._modules.items()]
            items += [(f".{k}", v, True) for k, v in vars(value).items()
                      if not k.startswith("_") and isinstance(v, (nn.Module, list, tuple, dict))]
        elif isinstance(value, (list, tuple)):
            items += [(f"[{i}]", v, True) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            items += [(f"[{k!r}]", v, True) for k, v in value.items()]
        for suffix, item, item_hidden in items:
            result = walk(item, path + suffix, item_hidden, depth + 1)
            if result is not None:
                return result
        return None

    return walk(root, prefix, False, 0)
