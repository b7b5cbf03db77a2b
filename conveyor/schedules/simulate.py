"""Discrete-event simulation of a schedule table under a cost model.

Each rank runs its column in order; an action starts when the rank is free and the
results it needs have arrived (plus a transfer time when they come from another
rank). The result is the same :class:`~conveyor.schedules.timeline.Timeline` the runtime records,
with the makespan, each rank's bubble and the peak activations each stage holds. With
uniform costs the textbook results come out exactly: GPipe's and 1F1B's bubble is
(K-1)/(M+K-1), interleaving V stages per rank divides the bubble time by V, and ZB-H1's
bubble is a third of 1F1B's when F, I and W take the same time. Each action is charged by
its own kind, so a table may mix full (``B``) and split (``I`` + ``W``) backwards. The
table's edges (values sent from stage i straight to stage j) are dependencies like the
neighbours' messages, each with its own transfer time. Pure Python.

Costs are per stage. To compare schedules on one model, give every rank the same layers
with :meth:`CostModel.per_rank`: a rank that runs V stages (interleaved 1F1B) has 1/V of
its layers in each, so each stage costs 1/V of the rank's figures::

    1f1b, K=2          rank 0  [ F 1 ]              (each stage: a rank's layers)
    interleaved, V=2   rank 0  [F 0.5]..[F 0.5]     (stages 0 and 2: half each)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.errors import ScheduleError
from conveyor.schedules.timeline import Event, Timeline, peak_open
from conveyor.schedules.clock import layout_clock
from conveyor.schedules.table import Action, Kind, Schedule, dependencies

__all__ = ["CostModel", "Simulation", "run_columns", "simulate"]


_LISTS = ("forward", "backward", "weight", "activation_bytes", "communication")


@dataclass(frozen=True)
class CostModel:
    """What each stage's actions cost, in time and bytes.

    Attributes:
        forward: per stage, the forward of one micro-batch.
        backward: per stage, the input-gradient pass ``I``.
        weight: per stage, the weight-gradient pass ``W``. A full backward ``B`` does
            both and costs ``backward + weight``.
        activation_bytes: per stage, what one micro-batch's activations hold from its
            forward until its ``B`` (or its ``W``, after an ``I``) is done.
        communication: per boundary s -> s+1 (S-1 entries), moving an activation or a
            gradient between two ranks.
        unit: what the times are in: ``"s"`` for seconds (measured, or estimated from
            FLOPs), anything else names an abstract unit (``"units"``: relative costs,
            as in :meth:`uniform`). Timelines and pictures carry it.
        edge_communication: ``(i, j, time)`` per edge of a table that has some: moving
            the values of edge i -> j, or their gradients, between two ranks. An edge
            not listed costs ``communication[i]``, as much as stage i's activation.
        serial_links: whether the link from one rank to another carries one message at
            a time, in the order they are sent (a wire with a bandwidth: a message
            waits for the one before it). False: every transfer only delays its
            receiver, however many are under way at once.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    communication: tuple[float, ...]
    unit: str = "s"
    edge_communication: tuple[tuple[int, int, float], ...] = ()
    serial_links: bool = False

    @classmethod
    def uniform(cls, stages: int, *, forward: float = 1.0, backward: float = 1.0,
                weight: float = 1.0, activation_bytes: float = 1.0,
                communication: float = 0.0, unit: str = "units") -> CostModel:
        """The same costs on every one of ``stages`` stages (relative units by default)."""
        return cls((forward,) * stages, (backward,) * stages, (weight,) * stages,
                   (activation_bytes,) * stages, (communication,) * max(0, stages - 1),
                   unit)

    @classmethod
    def per_rank(cls, schedule: Schedule, *, forward: float = 1.0, backward: float = 1.0,
                 weight: float = 1.0, activation_bytes: float = 1.0,
                 communication: float = 0.0, unit: str = "units") -> CostModel:
        """One model's layers spread evenly over the ranks of ``schedule``.

        The figures are what one rank's layers cost per micro-batch. A rank that runs V
        stages holds 1/V of its layers in each, so each of those stages costs 1/V of
        them, in time and in activation bytes; a transfer moves the same tensor
        whatever the split. So schedules with and without interleaving compare on the
        same model, and with one stage per rank this is :meth:`uniform`.
        """
        shares = [1 / len(schedule.stages_of(r)) for r in schedule.stage_ranks]
        return cls(tuple(forward * v for v in shares), tuple(backward * v for v in shares),
                   tuple(weight * v for v in shares),
                   tuple(activation_bytes * v for v in shares),
                   (communication,) * max(0, schedule.num_stages - 1), unit)

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def check(self, stages: int) -> None:
        """Raises ScheduleError unless the model describes ``stages`` stages with finite
        costs of at least 0."""
        sizes = {"forward": len(self.forward), "backward": len(self.backward),
                 "weight": len(self.weight), "activation_bytes": len(self.activation_bytes)}
        wrong = {k: v for k, v in sizes.items() if v != stages}
        if wrong or len(self.communication) != max(0, stages - 1):
            raise ScheduleError(
                f"the cost model must give {stages} values per stage and {stages - 1} "
                f"communication times for a {stages}-stage table; got {sizes} and "
                f"{len(self.communication)} communication times"
            )
        for name in _LISTS:
            where = "boundary" if name == "communication" else "stage"
            for index, value in enumerate(getattr(self, name)):
                if not (math.isfinite(value) and value >= 0):
                    raise ScheduleError(
                        f"the cost model's {name} of {where} {index} is {value}; every "
                        "cost must be a finite number of at least 0"
                    )
        for i, j, time in self.edge_communication:
            if not (0 <= i and i + 1 < j < stages):
                raise ScheduleError(
                    f"the cost model gives a time for edge {i}->{j}, which is not an edge "
                    f"of a {stages}-stage table (edges go from a stage to a later one past "
                    "the next)")
            if not (math.isfinite(time) and time >= 0):
                raise ScheduleError(
                    f"the cost model's communication of edge {i}->{j} is {time}; every "
                    "cost must be a finite number of at least 0")

    def edge_time(self, source: int, destination: int) -> float:
        """The time of moving a message from stage ``source`` to ``destination`` (or
        back) between two ranks: a boundary's time for neighbours, an edge's else."""
        low, high = sorted((source, destination))
        if high == low + 1:
            return self.communication[low]
        for i, j, time in self.edge_communication:
            if (i, j) == (low, high):
                return time
        return self.communication[low]

    def to_dict(self) -> dict[str, Any]:
        """The five lists and the unit, as plain data (``from_dict`` reads it back);
        the edges' times as ``[i, j, time]`` triples, if any."""
        data: dict[str, Any] = {**{k: list(getattr(self, k)) for k in _LISTS},
                                "unit": self.unit}
        if self.edge_communication:
            data["edge_communication"] = [list(e) for e in self.edge_communication]
        if self.serial_links:
            data["serial_links"] = True
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Reads ``to_dict``'s form; ``unit`` may be left out (seconds), and
        ``edge_communication`` (none).

        Raises:
            ScheduleError: a list is missing or holds something other than numbers.
        """
        missing = [k for k in _LISTS if k not in data]
        if missing:
            raise ScheduleError("the cost model lacks " + ", ".join(map(repr, missing))
                                + "; it needs the lists " + ", ".join(_LISTS))
        lists = {}
        for key in _LISTS:
            try:
                lists[key] = tuple(float(x) for x in data[key])
            except (TypeError, ValueError):
                raise ScheduleError(f"{key} must be a list of numbers, got "
                                    f"{data[key]!r}") from None
        try:
            edges = tuple((int(i), int(j), float(t))
                          for i, j, t in data.get("edge_communication", ()))
        except (TypeError, ValueError):
            raise ScheduleError("edge_communication must be a list of [source, destination, "
                                f"time] triples, got {data['edge_communication']!r}") from None
        return cls(**lists, unit=str(data.get("unit", "s")), edge_communication=edges,
                   serial_links=bool(data.get("serial_links", False)))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Reads a JSON file with the five lists (see ``to_dict``).

        Raises:
            ScheduleError: the file cannot be read, is not JSON, or lacks a list.
        """
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ScheduleError(f"cannot read the cost model {path}: "
                                f"{exc.strerror or exc}") from None
        except ValueError as exc:
            raise ScheduleError(f"cannot read the cost model {path}: not JSON ({exc})") \
                from None
        if not isinstance(data, dict):
            raise ScheduleError(f"cannot read the cost model {path}: expected a JSON object "
                                f"with the lists {', '.join(_LISTS)}")
        try:
            return cls.from_dict(data)
        except ScheduleError as exc:
            raise ScheduleError(f"cannot read the cost model {path}: {exc}") from None

    @classmethod
    def from_timeline(cls, timeline: Timeline, stages: int, *,
                      activation_bytes: Sequence[float] | None = None) -> CostModel:
        """Per-stage mean compute of each kind of action in a measured timeline.

        A stage that ran split backwards gets the mean ``I`` as its ``backward`` and
        the mean ``W`` as its ``weight``; a stage that ran only full backwards gets the
        mean ``B`` as ``backward`` and no ``weight``, so that a ``B`` costs what it was
        measured to. Time spent waiting or moving tensors is not compute and is left
        out; the communication cost is taken as the mean measured transfer time.
        """
        def mean(kind: str, stage: int) -> float | None:
            values = [e.compute for e in timeline.events if e.kind == kind and e.stage == stage]
            return sum(values) / len(values) if values else None

        def backward(stage: int) -> float:
            split = mean(Kind.INPUT.value, stage)
            return split if split is not None else mean(Kind.BACKWARD.value, stage) or 0.0

        transfers = [e.transfer for e in timeline.events if e.transfer > 0]
        move = sum(transfers) / len(transfers) if transfers else 0.0
        return cls(tuple(mean(Kind.FORWARD.value, s) or 0.0 for s in range(stages)),
                   tuple(backward(s) for s in range(stages)),
                   tuple(mean(Kind.WEIGHT.value, s) or 0.0 for s in range(stages)),
                   tuple(activation_bytes or [0.0] * stages),
                   (move,) * max(0, stages - 1), timeline.unit)


@dataclass
class Simulation:
    """A simulated step.

    Attributes:
        timeline: every action's start and end.
        peak_inflight: per stage, the most micro-batches whose activations it held at
            once (each stage's own peak; a rank's stages may peak at different times).
        peak_bytes: per rank, the most activation bytes its stages held together at
            once: the sum over held micro-batches of their stage's ``activation_bytes``.
        peak_split: per stage, the most micro-batches between the start of an ``I`` and
            the end of its ``W`` at once. With recomputation, each holds the graph its
            ``I`` rebuilt (all the stage's activations) until its ``W``.
    """

    timeline: Timeline
    peak_inflight: list[int]
    peak_bytes: list[float]
    peak_split: list[int]

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def bubble(self) -> float:
        """The mean idle fraction of the step over ranks."""
        return self.timeline.mean_bubble

    def summary(self) -> dict[str, Any]:
        """The figures as plain data (what ``conveyor simulate --json`` prints)."""
        ranks = range(self.timeline.num_ranks)
        return {"schedule": self.timeline.name, "unit": self.timeline.unit,
                "makespan": self.makespan, "bubble": self.bubble,
                "bubble_per_rank": [self.timeline.bubble(r) for r in ranks],
                "peak_inflight": self.peak_inflight, "peak_bytes": self.peak_bytes,
                "peak_split": self.peak_split}


def simulate(schedule: Schedule, costs: CostModel) -> Simulation:
    """Runs ``schedule`` under ``costs``, as fast as its dependencies allow.

    Raises:
        ScheduleError: the table deadlocks (the message shows who waits for whom), or
            the cost model does not fit the table or has a negative or non-finite cost.
    """
    costs.check(schedule.num_stages)
    layout_clock(schedule)  # a deadlock does not depend on durations: report it first
    ranks = schedule.stage_ranks
    events = run_columns(schedule, costs, schedule.columns, lambda action: ranks[action.stage],
                  lambda done, later: (ranks[done.stage], ranks[later.stage]))
    timeline = Timeline(schedule.num_ranks, events, source="simulated", name=schedule.name,
                        unit=costs.unit,
                        edges=[(e.source, e.destination, e.gradient) for e in schedule.edges])
    inflight, peak_bytes = _memory(events, schedule, costs)
    return Simulation(timeline, inflight, peak_bytes, _split_windows(events, schedule))


def run_columns(schedule: Schedule, costs: CostModel, columns: Sequence[Sequence[Action]],
                rank_of: Callable[[Action], int],
                link_of: Callable[[Action, Action], Hashable]) -> list[Event]:
    """Every action of ``columns`` (rank r runs ``columns[r]`` in order; ``rank_of``
    says where an action runs, ``link_of`` which link a result takes to an action on
    another rank) with its start and end."""
    end: dict[Action, float] = {}
    arrival: dict[tuple[Action, Action], float] = {}  # a result reaching another rank
    dependents: dict[Action, list[Action]] = {}
    needs_of = {action: dependencies(action, schedule) for column in columns
                for action in column}
    for action, needs in needs_of.items():
        for needed in needs:
            dependents.setdefault(needed, []).append(action)
    link_free: dict[Hashable, float] = {}  # serial links: when each is next free
    events: list[Event] = []
    position = [0] * len(columns)
    free = [0.0] * len(columns)
    remaining = sum(len(column) for column in columns)
    while remaining:
        progressed = False
        for rank, column in enumerate(columns):
            while position[rank] < len(column):
                action = column[position[rank]]
                needs = needs_of[action]
                if any(d not in end for d in needs):
                    break
                start = max([free[rank]] + [arrival.get((d, action), end[d]) for d in needs])
                finish = start + _duration(action, costs)
                end[action] = free[rank] = finish
                # A rank's actions end in its column's order, so each of its links
                # takes messages in the order they are sent.
                for later in dependents.get(action, ()):
                    if rank_of(later) == rank:
                        continue
                    link = link_of(action, later)
                    leaves = max(finish, link_free.get(link, 0.0)) if costs.serial_links \
                        else finish
                    arrival[(action, later)] = leaves + costs.edge_time(action.stage,
                                                                        later.stage)
                    if costs.serial_links:
                        link_free[link] = arrival[(action, later)]
                events.append(Event(rank, action.stage, action.kind.value, action.microbatch,
                                    start, finish))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - layout_clock would have raised
            raise ScheduleError(f"schedule {schedule.name!r} cannot progress")
    return events


def _duration(action: Action, costs: CostModel) -> float:
    s = action.stage
    if action.kind is Kind.FORWARD:
        return costs.forward[s]
    if action.kind is Kind.INPUT:
        return costs.backward[s]
    if action.kind is Kind.WEIGHT:
        return costs.weight[s]
    return costs.backward[s] + costs.weight[s]  # B: input and weight gradients


def _memory(events: list[Event], schedule: Schedule,
            costs: CostModel) -> tuple[list[int], list[float]]:
    """Peak micro-batches per stage and bytes per rank held between F and B (or W).

    A micro-batch's activations go with its last backward action: its ``B``, or the
    ``W`` that follows its ``I`` (which keeps the graph for it).
    """
    release = {Kind.BACKWARD.value, Kind.WEIGHT.value}
    changes = []  # (time, order, stage, rank, +1/-1); releases first at equal times
    for e in events:
        if e.kind == Kind.FORWARD.value:
            changes.append((e.start, 1, e.stage, e.rank, 1))
        elif e.kind in release:
            changes.append((e.end, 0, e.stage, e.rank, -1))
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    held_bytes = [0.0] * schedule.num_ranks
    peak_bytes = [0.0] * schedule.num_ranks
    for _, _, stage, rank, delta in sorted(changes):
        held[stage] += delta
        held_bytes[rank] += delta * costs.activation_bytes[stage]
        peak[stage] = max(peak[stage], held[stage])
        peak_bytes[rank] = max(peak_bytes[rank], held_bytes[rank])
    return peak, peak_bytes


def _split_windows(events: Sequence[Event], schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches between the start of an ``I`` and the end of
    its ``W`` at once."""
    return peak_open(events, Kind.INPUT.value, {Kind.WEIGHT.value}, lambda e: e.stage,
                     schedule.num_stages)
