"""What a ``Pipeline``'s arguments make of it: its ranks in one process, its schedule
table (with a traced model's edges) and the balance of an ``nn.Sequential``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from conveyor.graph.source import LayerSource
from conveyor.engine.devices import Device
from conveyor.graph.balance import balance_by_time, solve_balance, validate_balance
from conveyor.errors import BalanceError, ConveyorError, ScheduleError
from conveyor.schedules import Edge, Schedule, validate
from conveyor.schedules import build as build_schedule

__all__: list[str] = []


def local_ranks(stages: int | None, devices: Sequence[Device] | None) -> int:
    if stages is not None:
        if devices is not None and len(devices) != stages:
            raise BalanceError(f"devices lists {len(devices)} devices for stages={stages}; "
                               "give one device per pipeline rank")
        return stages
    if devices is not None:
        return len(devices)
    raise BalanceError("give stages= (the number of pipeline ranks) or devices=, or run "
                       "under torchrun")


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


def resolve_balance(balance: Sequence[int] | str | None, source: LayerSource,
                     num_stages: int, sample: Any) -> list[int]:
    count = len(source.names)
    if balance is None:
        return solve_balance(source.parameter_counts(), num_stages)
    if isinstance(balance, str):
        if balance != "time":
            raise BalanceError(f"balance={balance!r}: give a list, None (by parameters) or "
                               "'time'")
        model = source.layers_if_known()
        if sample is None or not model:
            raise BalanceError("balance='time' profiles the model on a batch: pass "
                               "sample=<a micro-batch> with an nn.Sequential built on a device")
        result = balance_by_time(nn.Sequential(*[layer for _, layer in model]), sample,
                                 num_stages)
        if dist.is_available() and dist.is_initialized():
            shared = [result]
            dist.broadcast_object_list(shared, src=0)  # one rank's timings decide for all
            result = shared[0]
        return result
    result = validate_balance(balance, count)
    if len(result) != num_stages:
        raise BalanceError(f"balance {result} has {len(result)} stages but the schedule has "
                           f"{num_stages} (ranks x virtual stages)")
    return result
