"""Elastic runs of ``conveyor train`` under torchrun: a layout planned for the world that
torchrun started, and what a restart at another size changed.

``torchrun --nnodes 1:2 --max-restarts 3`` restarts every worker when a node leaves (its
peers fail their step) or joins (the agents see it waiting). The restarted command is
the same, so the layout cannot come from it: the number of pipeline ranks comes from the
world, each restart resumes from the newest complete checkpoint in ``--out``
(``--resume auto``), and checkpoints are torch.distributed.checkpoint directories that
load at any layout. A restart loses the steps since that checkpoint and nothing else::

    world 2:  step 5  step 6 [save 6]  step 7 X  (a node leaves: step 7 is lost)
    world 1:                   load 6 -- step 7  step 8 [save 8] ... step 11 [save 11]
                                                   (a node joins: SIGTERM, save, exit)
    world 2:                                                  load 11 -- step 12 ...

Kept free of torch at import, like the options: the plan is arithmetic on integers.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Protocol

from conveyor.errors import ConfigError, ConveyorError
from conveyor.schedules import build

__all__: list[str] = []


class PipelineShape(Protocol):
    """What a run's options say of its layout (a ``TrainConfig``, which imports this
    module, has these)."""

    stages: int
    data_parallel: int
    tensor_parallel: int
    chunks: int

RESUME_AUTO = "auto"  # --resume auto: continue the run in --out if it has a checkpoint


def under_torchrun() -> bool:
    """Whether torchrun (its elastic agent) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def restart_count() -> int:
    """How many times torchrun has restarted this node's workers (0: the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resume_mode(text: str) -> str:
    """The value of ``--resume WHEN`` (argparse ``type``): only ``auto`` is known.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not ``auto`` (a usage error).
    """
    if text != RESUME_AUTO:
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', got {text!r}")
    return text


def plan_layout(values: dict[str, Any], *, given: set[str], world: int) -> dict[str, Any]:
    """The options ``values`` with the layout planned for ``world`` processes.

    Options in ``given`` (the command line and ``--config``) are kept as they are; the
    others, such as the stages a resumed run had, give way to the world:
    ``tensor_parallel`` stays if it divides ``world`` (else 1), ``data_parallel`` if it
    divides what is left (else 1), ``stages`` is ``world / (data_parallel x
    tensor_parallel)``, and ``chunks`` grows to the fewest the schedule can run on that
    many stages, if it must. The balance is not an option: the pipeline recomputes it
    (by parameters) for the new number of stages.

    Args:
        values: every option by name (defaults filled in).
        given: the names of the options the user gave for this launch.
        world: the processes torchrun started (``WORLD_SIZE``).

    Returns:
        A new dict of options.

    Raises:
        ConfigError: a given ``--tensor-parallel`` or ``--data-parallel`` does not divide
            the world, or a given ``--stages`` does not fit it.
    """
    planned = dict(values)
    tensors = _divisor(planned, "tensor_parallel", world, given)
    replicas = _divisor(planned, "data_parallel", world // tensors, given,
                        f"process groups of --tensor-parallel {tensors} that the {world} "
                        "processes torchrun started make" if tensors > 1 else "")
    inner = replicas * tensors
    if "stages" in given:
        stages = int(values["stages"])
        if stages * inner != world:  # one process too: a checkpoint of one kind
            split = f" x --tensor-parallel {tensors}" if tensors > 1 else ""
            raise ConfigError(f"--stages {stages} x --data-parallel {replicas}{split} needs "
                              f"{stages * inner} processes but torchrun started {world}; "
                              "leave out --stages to plan the pipeline for the world "
                              f"({world // inner} stages)")
        return planned
    stages = planned["stages"] = max(1, world // inner)
    chunks = _fitting_chunks(planned, stages, replicas)
    if chunks is not None:
        planned["chunks"] = chunks
    return planned


def _divisor(planned: dict[str, Any], name: str, world: int, given: set[str],
             what: str = "") -> int:
    """``planned[name]`` where it divides ``world`` (``what``: processes torchrun
    started); else 1 (set in ``planned``) unless the user gave it.

    Raises:
        ConfigError: the user gave it, and it does not divide ``world``.
    """
    value = int(planned.get(name, 1))
    if world % value == 0:
        return value
    flag = "--" + name.replace("_", "-")
    if name in given:
        raise ConfigError(f"{flag} {value} does not divide the {world} "
                          f"{what or 'processes torchrun started'}; use a divisor of {world}, "
                          f"or leave out {flag} to let the world decide")
    planned[name] = 1
    return 1


def _fitting_chunks(values: dict[str, Any], stages: int, replicas: int) -> int | None:
    """The fewest micro-batches, from the current number up, that the schedule runs on
    ``stages`` ranks within a replica's share of the batch; None where the current number
    does (or none does: the options' check then says why)."""
    chunks = int(values["chunks"])
    for candidate in range(chunks, max(chunks, int(values["batch"]) // replicas) + 1):
        try:
            build(str(values["schedule"]), stages, candidate,
                  virtual_stages=int(values["virtual_stages"]))
        except ConveyorError:
            continue
        return None if candidate == chunks else candidate
    return None


def join_world(*, processes: int, timeout: float, within: float | None = None) -> None:
    """Opens the process group of a run of several processes (under torchrun, or
    launched by hand with env://), before anything else, so that the processes can
    compare their options first; under torchrun even for a world of one process, so
    that the run saves the same kind of checkpoint at every size it shrinks or grows
    to. Does nothing where the group is open already, or where the layout's
    ``processes`` are not the world's (which :func:`plan_layout` refuses under torchrun,
    and the pipeline itself otherwise). The join itself ends within ``within`` seconds
    (default ``timeout``, the process group's own).

    Raises:
        RendezvousError: the group could not be joined in time (one line: the address,
            the rank, what did not answer).
    """
    from conveyor.distributed.faults.rendezvous import join

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (not (under_torchrun() or world > 1) or not dist.is_available()
            or dist.is_initialized() or processes != world):
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    join(backend, seconds=timeout if within is None else within, timeout=timeout)


def world_size() -> int:
    """The processes of the run: the process group's size, 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def restart_hint() -> str:
    """What to add to a refusal to overwrite a checkpoint, when torchrun restarted us."""
    if not (under_torchrun() and restart_count()):
        return ""
    return (" (torchrun restarted this worker: launch with --resume auto so that restarts "
            "continue the run)")


def describe_replan(saved: dict[str, Any], config: PipelineShape, *,
                    balance: list[int]) -> str | None:
    """What changed since the checkpoint ``saved`` (its ``extra``) was written, in one
    line: ``restart 1 of torchrun: world 2 -> 1: 2 stages -> 1, balance [3, 4] -> [7]``;
    None when the layout is the same. Checkpoints from before elastic runs lack the
    world and balance: the world is then their stages times replicas, and the balance
    is not shown."""
    world, stages, replicas = world_size(), config.stages, config.data_parallel
    tensors = config.tensor_parallel
    old = saved.get("config", {})
    old_stages = int(old.get("stages", stages))
    old_replicas = int(old.get("data_parallel", replicas))
    old_tensors = int(old.get("tensor_parallel", 1))
    old_world = int(saved.get("world", old_stages * old_replicas * old_tensors))
    old_balance = saved.get("balance")
    if (old_world, old_stages, old_replicas, old_tensors) == (
            world, stages, replicas, tensors) and (
            old_balance is None or list(old_balance) == balance):
        return None
    changes = [f"{old_stages} stage{'s' * (old_stages != 1)} -> {stages}"]
    if old_replicas != replicas:
        changes.append(f"{old_replicas} replica{'s' * (old_replicas != 1)} -> {replicas}")
    if old_tensors != tensors:
        changes.append(f"{old_tensors} tensor rank{'s' * (old_tensors != 1)} -> {tensors}")
    if old_balance is not None:
        changes.append(f"balance {list(old_balance)} -> {balance}")
    old_chunks = int(old.get("chunks", config.chunks))
    if old_chunks != config.chunks:
        changes.append(f"{old_chunks} micro-batches -> {config.chunks}")
    restart = f"restart {restart_count()} of torchrun: " if restart_count() else ""
    return f"{restart}world {old_world} -> {world}: " + ", ".join(changes)


def check_resumable(out: Path, resume: bool, holds_checkpoint: bool) -> None:
    """Raises ConfigError where the run would overwrite a checkpoint (``out`` holds one)
    or resume from none."""
    if holds_checkpoint and not resume:
        raise ConfigError(f"{out} already holds a checkpoint; pass --resume to continue it "
                          f"or choose another --out{restart_hint()}")
    if resume and not holds_checkpoint:
        raise ConfigError(f"--resume: there is no checkpoint in {out}")
