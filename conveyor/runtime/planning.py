"""What a ``Pipeline``'s arguments make of it: its ranks in one process and its schedule
table (with a traced model's edges)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from conveyor.distributed.topology import Topology
from conveyor.engine.devices import Device
from conveyor.errors import BalanceError, ConveyorError, ScheduleError
from conveyor.schedules import V_SHAPES, Edge, Schedule, validate
from conveyor.schedules import build as build_schedule
from conveyor.schedules.replicas import StageReplicas

__all__: list[str] = []


def refuse_one_process(data_parallel: int | Sequence[int], stages: int | None,
                       plan: Any = None) -> None:
    """Raises if the options need several processes but this is one plain process (no
    process group, no torchrun's ``WORLD_SIZE``), before torch is asked to make a group
    and fails with its "environment variable RANK expected".

    Raises:
        ConveyorError: data-parallel replicas (``data_parallel=D`` or a plan's) in one
            process; the message gives the torchrun command that runs them.
    """
    if isinstance(data_parallel, int):
        if data_parallel <= 1:
            return
        ranks = plan.devices if plan is not None else data_parallel * (stages or 0)
    else:
        if set(data_parallel) == {1}:
            return
        ranks = sum(data_parallel)
    if (dist.is_available() and dist.is_initialized()) or \
            int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    shown = data_parallel if isinstance(data_parallel, int) else list(data_parallel)
    what = (f"the plan (replicas per stage {list(plan.replicas)})" if plan is not None
            else f"data_parallel={shown}")
    count = f"{ranks}" if ranks else "stages x data_parallel"
    raise ConveyorError(
        f"{what} runs one process per device, but this is one process without torchrun: "
        f"launch {count} of them under torchrun (torchrun --nproc-per-node {count} "
        "your_script.py); in one process, plan with --no-replicas or give data_parallel=1")


def local_ranks(stages: int | None, devices: Sequence[Device] | None,
                balance: Sequence[int] | str | None = None, virtual_stages: int = 1,
                schedule: str | Schedule | None = None) -> int:
    """The pipeline ranks of a pipeline in one process: ``stages``, else one per device,
    else what a balance list (its stages over ``virtual_stages``) or a schedule table
    says.

    Raises:
        BalanceError: they disagree, or nothing says how many.
    """
    if stages is not None:
        if devices is not None and len(devices) != stages:
            raise BalanceError(f"devices lists {len(devices)} devices for stages={stages}; "
                               "give one device per pipeline rank")
        return stages
    if devices is not None:
        return len(devices)
    if isinstance(schedule, Schedule):
        return schedule.num_ranks
    if balance is not None and not isinstance(balance, str):
        per_rank = 2 if schedule in V_SHAPES else virtual_stages
        if len(balance) % per_rank:
            raise BalanceError(f"balance {list(balance)} has {len(balance)} stages, not "
                               f"{per_rank} per rank; give stages=")
        return len(balance) // per_rank
    raise BalanceError("give stages= (the number of pipeline ranks), devices=, or a "
                       "balance list, or run under torchrun")


def make_schedule(schedule: str | Schedule, ranks: int, chunks: int,
                   virtual_stages: int) -> Schedule:
    if isinstance(schedule, Schedule):
        validate(schedule)
        if schedule.num_ranks != ranks or schedule.num_microbatches != chunks:
            raise ConveyorError(
                f"the schedule table has {schedule.num_ranks} ranks and "
                f"{schedule.num_microbatches} micro-batches, but the pipeline has {ranks} "
                f"ranks and chunks={chunks}"
            )
        return schedule
    table = build_schedule(schedule, ranks, chunks, virtual_stages=virtual_stages)
    validate(table)
    return table


def with_model_edges(schedule: Schedule, edges: tuple[Edge, ...]) -> Schedule:
    """``schedule`` with the edges of a traced model (values sent past the next stage),
    validated again; a table given with edges must give the model's.

    Raises:
        ScheduleError: the table lists other edges than the model has.
    """
    if schedule.edges and schedule.edges != tuple(sorted(edges)):
        raise ScheduleError(
            f"the schedule table lists edges {' '.join(map(str, schedule.edges)) or 'none'}, "
            f"but the model cut at split_at has {' '.join(map(str, edges)) or 'none'}; give "
            "the table without edges (the pipeline adds the model's)")
    table = schedule.with_edges(edges)
    validate(table)
    return table


def table_ranks(topology: Topology) -> int:
    """The ranks of the table a pipeline of processes runs: one per process, or with
    replicated stages one per stage."""
    return topology.pipeline_size if topology.replicas is None else len(topology.replicas.counts)


def refuse_replicated(replicas: StageReplicas, schedule: Schedule, *, sharding: str,
                      rebalance: object) -> None:
    """Raises unless replicated stages can run ``schedule`` with these options.

    Raises:
        ScheduleError: the table has more than one stage on a rank.
        ConveyorError: sharded stages or re-balancing (both assume equal replicas).
    """
    replicas.check(schedule)
    counts = list(replicas.counts)
    if sharding != "replicate":
        raise ConveyorError(f"data_parallel={counts} replicates stages unevenly, which "
                            f"sharding={sharding!r} cannot shard; give a number of "
                            "replicas for every stage, or sharding='replicate'")
    if rebalance is not None:
        raise ConveyorError(f"data_parallel={counts} replicates stages unevenly, and "
                            "re-balancing moves layers between stages of one replica "
                            "each; drop rebalance= or plan with uniform replicas")
