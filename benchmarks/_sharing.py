"""Processes that share cores: a pipeline's simulated step replayed at the speeds they get.

The planner simulates a step as if every rank had a device of its own. On this machine
the 4 processes of a launch share 2 cores, and a process computes slower the more of
them compute at once: ``slowdown[n]``, how much longer a process's work takes with n
processes computing than with one. A profile scaled to the step timed with every
process computing holds for a mesh whose ranks all compute all the time (TP, DP); a
pipeline's ranks take turns as it fills and drains, and then the ones computing run
faster. :func:`shared_makespan` replays the planner's timeline so: each action's work
(its simulated duration, every figure in it timed or scaled to every process computing)
is done at ``slowdown[P] / slowdown[n]`` of that speed while n of the P processes
compute, each message ``link_s`` after the action that sends it. benchmarks/mesh.py
gives it :func:`taking_turns`: the cores' time shares alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.schedules import Action, Kind, build
from conveyor.schedules.table import dependencies
from conveyor.schedules.timeline import Timeline

#: Work left below this (seconds) is done: float rounding of the rates.
DONE = 1e-12


def taking_turns(cores: int, processes: int) -> dict[int, float]:
    """``slowdown[n]`` for n = 1 ... ``processes`` computing on ``cores``, counting only
    how the cores' time is shared: alone up to one process a core, then n / cores. The
    CPU a process spends on its work is taken to stay what it is with every process
    computing (as a pipeline's ranks' does: they compute after waiting)."""
    return {n: max(cores, n) / cores for n in range(1, processes + 1)}


def shared_makespan(timeline: Timeline, schedule: str, chunks: int,
                    slowdown: Mapping[int, float], per_rank: int, link_s: float) -> float:
    """When the last action of ``timeline`` (the planner's simulation of ``schedule``
    with ``chunks`` micro-batches, one rank per stage) ends, its ranks' ``per_rank``
    processes each (a stage's TP group) sharing the cores as ``slowdown`` says."""
    table = build(schedule, timeline.num_ranks, chunks)
    columns = [sorted((e for e in timeline.events if e.rank == r), key=lambda e: e.start)
               for r in range(timeline.num_ranks)]
    actions = [[Action(e.stage, Kind(e.kind), e.microbatch) for e in column]
               for column in columns]
    rank_of = {a: r for r, column in enumerate(actions) for a in column}
    everyone = per_rank * timeline.num_ranks
    position = [0] * len(columns)

    def work(r: int) -> float:
        """Rank r's next action's seconds, with every process computing."""
        event = columns[r][position[r]]
        return event.end - event.start

    left = [work(r) if column else 0.0 for r, column in enumerate(columns)]
    free = [0.0] * len(columns)  # when each rank's previous action ended
    end: dict[Action, float] = {}
    now = 0.0

    def ready(r: int) -> float:
        """When rank r's next action may start (inf: a result it needs is not done)."""
        action = actions[r][position[r]]
        times = [free[r]]
        for needed in dependencies(action, table):
            if needed not in end:
                return float("inf")
            times.append(end[needed] + (link_s if rank_of[needed] != r else 0.0))
        return max(times)

    while any(p < len(c) for p, c in zip(position, columns)):
        waiting = [r for r in range(len(columns)) if position[r] < len(columns[r])]
        starts = {r: ready(r) for r in waiting}
        running = [r for r in waiting if starts[r] <= now]
        if not running:
            now = min(starts.values())
            continue
        rate = slowdown[everyone] / slowdown[per_rank * len(running)]
        later = [t for t in starts.values() if now < t < float("inf")]
        step = min([left[r] / rate for r in running] + [t - now for t in later])
        now += step
        for r in running:
            left[r] -= step * rate
            if left[r] <= DONE:
                end[actions[r][position[r]]] = free[r] = now
                position[r] += 1
                if position[r] < len(columns[r]):
                    left[r] = work(r)
    return max(end.values(), default=0.0)
