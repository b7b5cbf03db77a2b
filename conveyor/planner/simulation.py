"""A cut's step, simulated: each replica of a stage dealt its own micro-batches, every
message on a serial link, and each stage's peak of micro-batches held per replica."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import ScheduleError
from conveyor.planner.plans import StageChoice
from conveyor.schedules import Action, Kind, build
from conveyor.schedules.replicas import simulate_replicas
from conveyor.schedules.simulate import CostModel
from conveyor.schedules.timeline import Timeline, peak_open

__all__ = ["CutSimulation", "simulate_cut"]


@dataclass(frozen=True)
class CutSimulation:
    """A cut's simulated step, per stage: when its last replica finished, and the most
    micro-batches one of its replicas held at once (from a forward to the end of its
    backward), and held rebuilt between an ``I`` and its ``W``."""

    timeline: Timeline
    finish: list[float]
    held: list[int]
    rebuilt: list[int]


def simulate_cut(cut: Sequence[StageChoice], schedule: str, chunks: int, *,
                 sync_each: bool = False) -> CutSimulation:
    """The schedule's simulation for a cut, its stages' replicas dealt the micro-batches
    in turn (:func:`conveyor.schedules.replicas.simulate_replicas`), each message on one
    of the min(r, r') serial links between two stages of r and r' replicas (with
    ``sync_each``, each backward followed by its replica's gradient all-reduce)."""
    table = build(schedule, len(cut), chunks)
    split = schedule == "zero-bubble"
    forward, backward, weight = [], [], []
    for stage in cut:
        # The backward, with the recomputed forward (and a synchronisation, if each).
        b = stage.compute + (stage.sync if sync_each else 0.0) - stage.forward
        forward.append(stage.forward)
        backward.append(b / 2 if split else b)
        weight.append(b / 2 if split else 0.0)
    costs = CostModel(tuple(forward), tuple(backward), tuple(weight),
                      tuple(0.0 for _ in cut), tuple(stage.send for stage in cut[:-1]),
                      serial_links=True)
    replicas = [stage.replicas for stage in cut]
    timeline = simulate_replicas(table, costs, replicas)
    if schedule == "1f1b" and max(replicas) > 1:
        try:  # each replica warming up as deep as its stage: often faster
            deeper = simulate_replicas(table, costs, replicas, _replica_1f1b(replicas, chunks))
            if deeper.makespan < timeline.makespan:
                timeline = deeper
        except ScheduleError:  # that order deadlocks here: keep the stage's own order
            pass
    stage_of = [k for k, count in enumerate(replicas) for _ in range(count)]
    finish, held, rebuilt = [0.0] * len(cut), [1] * len(cut), [1] * len(cut)
    workers, rank = timeline.num_ranks, (lambda e: e.rank)
    kept = peak_open(timeline.events, "F", {"B", "W"}, rank, workers)  # to its backward's end
    rebuilt_open = peak_open(timeline.events, "I", {"W"}, rank, workers)  # kept from I to W
    for worker, k in enumerate(stage_of):
        held[k], rebuilt[k] = max(held[k], kept[worker]), max(rebuilt[k], rebuilt_open[worker])
    for event in timeline.events:
        finish[stage_of[event.rank]] = max(finish[stage_of[event.rank]], event.end)
    return CutSimulation(timeline, finish, held, rebuilt)


def _replica_1f1b(replicas: Sequence[int], chunks: int) -> list[list[Action]]:
    """Each replica's 1F1B over its own micro-batches (m % r == j), warming up with as
    many forwards as its stage does in 1F1B, rather than the stage's column filtered
    (which leaves a replica 1/r of them)."""
    columns = []
    for stage, count in enumerate(replicas):
        warmup = len(replicas) - 1 - stage
        for j in range(count):
            mine = list(range(j, chunks, count))
            w = min(warmup, len(mine))
            column = [Action(stage, Kind.FORWARD, m) for m in mine[:w]]
            for i, m in enumerate(mine[w:]):
                column += [Action(stage, Kind.FORWARD, m), Action(stage, Kind.BACKWARD, mine[i])]
            column += [Action(stage, Kind.BACKWARD, m) for m in mine[len(mine) - w:]]
            columns.append(column)
    return columns
