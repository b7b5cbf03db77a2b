"""Every rank of a job builds the same pipeline, or none does.

Ranks started with different options would otherwise run silently wrong: with
``balance=[3, 3]`` on one rank and ``[2, 4]`` on another both train, each on its own
partition, and a different ``chunks`` surfaces later as a shape error in the loss. So
before anything else a pipeline's processes exchange their options and the names and
shapes of the model's parameters (one collective), and all refuse together, naming each
option that differs and its value on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from conveyor.errors import ConfigError

__all__: list[str] = []


def model_shapes(module: Any) -> list[tuple[str, tuple[int, ...], str]] | None:
    """The name, shape and dtype of every parameter of ``module`` (None when it is a
    function that builds layers, whose shapes no rank knows before building)."""
    if not isinstance(module, nn.Module):
        return None
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in module.named_parameters(remove_duplicate=False)]


def schedule_of(schedule: Any) -> str:
    """A schedule as compared between ranks: its name, or a digest of a table's repr."""
    if isinstance(schedule, str):
        return schedule
    return f"a table ({hashlib.sha256(repr(schedule).encode()).hexdigest()[:12]})"


def agree(options: Mapping[str, Any]) -> None:
    """Checks that every process of the job was given the same ``options``.

    A collective over the default process group: every process calls it once, when it
    builds its pipeline.

    Raises:
        ConfigError: an option differs between processes; on every process, naming the
            option and each process's value.
            Also when a process did not take part (it failed before, or was started
            differently).
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, dict(options))
    except RuntimeError as exc:
        raise ConfigError(f"rank {dist.get_rank()} could not compare its pipeline's options "
                          "with the other ranks' (one failed before building its pipeline, "
                          f"or was started with another world size): {exc}") from exc
    differences = [_describe(key, [ranked.get(key) for ranked in gathered])
                   for key in options if any(r.get(key) != options[key] for r in gathered)]
    if differences:
        raise ConfigError("the ranks were started with different pipelines: "
                          + "; ".join(differences)
                          + ". Start every rank with the same options and model")


def _describe(key: str, values: list[Any]) -> str:
    """``key``'s value on each rank, grouped; for the model, its first difference."""
    if key == "model" and all(isinstance(v, list) for v in values):
        return _first_model_difference(values)
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), []).append(rank)
    return f"{key} is " + " but ".join(f"{value} on {_ranks(ranks)}"
                                      for value, ranks in groups.items())


def _first_model_difference(models: list[list[Any]]) -> str:
    first = models[0]
    for rank, other in enumerate(models[1:], start=1):
        for index in range(max(len(first), len(other))):
            mine = first[index] if index < len(first) else None
            theirs = other[index] if index < len(other) else None
            if mine != theirs:
                return (f"the model differs: parameter {index} is {_parameter(mine)} on rank "
                        f"0 but {_parameter(theirs)} on rank {rank}")
    return "the model differs"


def _parameter(entry: Any) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype = entry
    return f"{name} {list(shape)} {dtype}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
