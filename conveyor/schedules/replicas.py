"""Simulating a table whose stages have replicas, as PipeDream replicates a stage: each
replica dealt the stage's micro-batches in turn (see :func:`simulate_replicas`)."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.errors import ScheduleError
from conveyor.schedules.clock import layout_clock
from conveyor.schedules.simulate import CostModel, run_columns
from conveyor.schedules.table import Action, Schedule
from conveyor.schedules.timeline import Timeline

__all__ = ["simulate_replicas"]


def simulate_replicas(schedule: Schedule, costs: CostModel, replicas: Sequence[int],
                      columns: Sequence[Sequence[Action]] | None = None) -> Timeline:
    """Runs ``schedule`` with stage s dealt among ``replicas[s]`` workers, as PipeDream
    replicates a stage: its replica j runs the micro-batches m with m % replicas[s] ==
    j; each takes the stage's whole cost. Workers are numbered stage by stage (stage
    0's replicas first). Between two stages of r and r' replicas lie min(r, r') links
    each way (serial if the cost model says so): micro-batch m's message takes link
    m % min(r, r'). By default a replica runs its
    micro-batches in the order of the stage's column (filtering a column keeps its
    order, so a table that cannot deadlock still cannot); ``columns`` gives each
    worker's order instead.

    Raises:
        ScheduleError: as :func:`simulate`, a stage with fewer than one replica, a
            table with more than one stage per rank, or ``columns`` that deadlock.
    """
    costs.check(schedule.num_stages)
    layout_clock(schedule)
    if len(replicas) != schedule.num_stages or min(replicas) < 1 or \
            schedule.num_ranks != schedule.num_stages:
        raise ScheduleError(f"replicas {list(replicas)} must give each of the "
                            f"{schedule.num_stages} stages of a table with one stage per "
                            "rank at least one replica")
    first = [sum(replicas[:s]) for s in range(len(replicas))]

    def worker(action: Action) -> int:
        return first[action.stage] + action.microbatch % replicas[action.stage]

    if columns is None:
        columns = [[action for action in schedule.columns[stage]
                    if action.microbatch % replicas[stage] == j]
                   for stage in range(schedule.num_stages) for j in range(replicas[stage])]
    def link(done: Action, later: Action) -> tuple[int, int, int]:
        lanes = min(replicas[done.stage], replicas[later.stage])
        return done.stage, later.stage, done.microbatch % lanes

    events = run_columns(schedule, costs, columns, worker, link)
    return Timeline(sum(replicas), events, source="simulated", name=schedule.name,
                    unit=costs.unit)
