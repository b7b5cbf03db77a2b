"""Every rank of a job builds the same pipeline, or none does.

Ranks started with different options would otherwise run silently wrong: with
``balance=[3, 3]`` on one rank and ``[2, 4]`` on another both train, each on its own
partition, and a different ``chunks`` surfaces later as a shape error in the loss. So
before anything else a pipeline's processes exchange their options and the names and
shapes of the model's parameters (one collective), and all refuse together, naming each
option that differs and its value on every rank.

The exchange goes through the job's store, each call bounded and the whole of it at
most ``seconds`` (a rank that never comes is named, not waited for 30 minutes).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from conveyor.distributed.faults import collective
from conveyor.distributed.faults.store import BoundedStore, StoreGone, StoreSilent, host
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.errors import ConfigError, PeerFailure

__all__: list[str] = []

_agreements = 0  # agreements made in this process: every rank makes them in one order


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


def agree(options: Mapping[str, Any], *, seconds: float | None = None,
          what: str = "pipelines") -> None:
    """Checks that every process of the job was given the same ``options`` (plain
    values: they cross as JSON).

    A collective over the default process group: every process calls it once, when it
    builds its pipeline, and waits at most ``seconds`` (default ``Deadlines.first``) for
    the others (start-up's timeout: processes may be started seconds or minutes apart).

    Raises:
        ConfigError: an option differs between processes; on every process, naming the
            option and each process's value.
            Also when a process did not take part in time (it failed before, or was
            started differently), naming it.
        PeerFailure: the job's store stopped answering (its host, rank 0 under env://,
            froze or died), naming the host.
    """
    mine = json.loads(json.dumps(dict(options)))  # as the others' come back
    gathered = _exchange(mine, Deadlines.first if seconds is None else seconds)
    differences = [_describe(key, [ranked.get(key) for ranked in gathered])
                   for key in mine if any(r.get(key) != mine[key] for r in gathered)]
    if differences:
        raise ConfigError(f"the ranks were started with different {what}: "
                          + "; ".join(differences)
                          + ". Start every rank with the same options and model")


def _exchange(options: dict[str, Any], seconds: float) -> list[Any]:
    """Every rank's ``options``: through the store, else a collective (both bounded)."""
    global _agreements
    _agreements += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    store = BoundedStore()
    if not store.available:
        return collective.exchange(options, group=None, what="the agreement on options",
                                   seconds=seconds)
    prefix = f"conveyor/agree/{_agreements}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.set(keys[rank], json.dumps(options).encode())
        end = time.monotonic() + seconds
        while not store.check(keys):
            if time.monotonic() > end:
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                raise ConfigError(
                    f"rank {rank} waited {seconds:g} s to compare its pipeline's options "
                    f"with the other ranks', but {_ranks(missing)} never came (failed before "
                    "building its pipeline, froze, or was started with another world size)")
            time.sleep(0.05)
        gathered = [json.loads(store.get(key)) for key in keys]
        _wait_until_all_read(store, prefix, rank, world, min(seconds, Deadlines.floor))
        return gathered
    except (StoreSilent, StoreGone) as exc:  # its host froze or died: a lost peer
        failure = PeerFailure(f"rank {rank} could not compare its pipeline's options with "
                              f"the other ranks': {exc}", stage=-1, microbatch=-1,
                              action="agree")
        failure.report = {"rank": host(), "stage": -1, "microbatch": -1, "action": "agree",
                          "silent": "timeout" if isinstance(exc, StoreSilent) else "closed",
                          "error": str(exc)}
        raise failure from exc
    finally:
        store.close()


def _wait_until_all_read(store: BoundedStore, prefix: str, rank: int, world: int,
                         seconds: float) -> None:
    """Says this rank has read every rank's options, and waits (up to ``seconds``) until
    every rank has: a rank that finds a difference ends its process at once, and under
    env:// rank 0's process hosts the store that the others are still reading from. A
    rank that stops answering after this rank has read is no concern of this one's."""
    keys = [f"{prefix}/read/{r}" for r in range(world)]
    try:
        store.set(keys[rank], b"1")
        end = time.monotonic() + seconds
        while not store.check(keys) and time.monotonic() < end:
            time.sleep(0.02)
    except (StoreSilent, StoreGone):
        pass


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
