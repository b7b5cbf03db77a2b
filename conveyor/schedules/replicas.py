"""Tables whose stages have replicas, as PipeDream replicates a stage: each replica
dealt the stage's micro-batches in turn. :class:`StageReplicas` says which worker runs
what (the runtime's ranks follow it), :func:`simulate_replicas` predicts the run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from conveyor.errors import ScheduleError
from conveyor.schedules.clock import layout_clock
from conveyor.schedules.simulate import CostModel, run_columns
from conveyor.schedules.table import Action, Schedule
from conveyor.schedules.timeline import Timeline

__all__ = ["StageReplicas", "simulate_replicas"]


@dataclass(frozen=True)
class StageReplicas:
    """Stage s held by ``counts[s]`` workers, numbered stage by stage (stage 0's
    replicas first): replica j of stage s runs the micro-batches m with
    m % counts[s] == j, in the order of the stage's column; with ``dealt`` False,
    replica 0 runs them all (a pass without backward: its outputs in one place).

    Raises:
        ScheduleError: a stage with fewer than one replica.
    """

    counts: tuple[int, ...]
    dealt: bool = True

    def __post_init__(self) -> None:
        if not self.counts or min(self.counts) < 1:
            raise ScheduleError(f"replicas {list(self.counts)} must give each stage at "
                                "least one replica")

    @property
    def workers(self) -> int:
        return sum(self.counts)

    def first(self, stage: int) -> int:
        """The worker of stage ``stage``'s replica 0."""
        return sum(self.counts[:stage])

    def worker(self, stage: int, microbatch: int) -> int:
        """The worker that runs ``stage`` on ``microbatch``."""
        return self.first(stage) + (microbatch % self.counts[stage] if self.dealt else 0)

    def place(self, worker: int) -> tuple[int, int]:
        """The stage and replica of ``worker``."""
        for stage, count in enumerate(self.counts):
            if worker < count:
                return stage, worker
            worker -= count
        raise ScheduleError(f"worker {worker} is past the {self.workers} workers")

    def check(self, schedule: Schedule) -> None:
        """Raises ScheduleError unless ``schedule`` has one stage per rank, stage s on
        rank s, and a count for each stage."""
        if len(self.counts) != schedule.num_stages or \
                schedule.stage_ranks != tuple(range(schedule.num_stages)):
            raise ScheduleError(
                f"replicas {list(self.counts)} need a table of {len(self.counts)} stages "
                f"with stage s on rank s; {schedule.name or 'this table'} has "
                f"{schedule.num_stages} stages on {schedule.num_ranks} ranks (take "
                "gpipe, 1f1b or zero-bubble, not an interleaved or V schedule)")

    def table(self, schedule: Schedule) -> Schedule:
        """``schedule`` with a column per worker, each its share of its stage's (what
        a hang report draws: a row per process)."""
        everyone = self.columns(dict(enumerate(schedule.columns)))
        return Schedule(tuple(tuple(everyone[w]) for w in range(self.workers)),
                        schedule.num_stages, schedule.num_microbatches,
                        name=schedule.name, edges=schedule.edges)

    def columns(self, columns: Mapping[int, Sequence[Action]]) -> dict[int, list[Action]]:
        """Each worker's column, from the table's columns (rank s: stage s's)."""
        return {self.first(stage) + j: [a for a in columns.get(stage, ())
                                        if self.worker(stage, a.microbatch) ==
                                        self.first(stage) + j]
                for stage, count in enumerate(self.counts) for j in range(count)}


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
    dealt = StageReplicas(tuple(replicas))
    dealt.check(schedule)

    def worker(action: Action) -> int:
        return dealt.worker(action.stage, action.microbatch)

    if columns is None:
        everyone = dealt.columns(dict(enumerate(schedule.columns)))
        columns = [everyone[w] for w in range(dealt.workers)]

    def link(done: Action, later: Action) -> tuple[int, int, int]:
        lanes = min(replicas[done.stage], replicas[later.stage])
        return done.stage, later.stage, done.microbatch % lanes

    events = run_columns(schedule, costs, columns, worker, link)
    return Timeline(sum(replicas), events, source="simulated", name=schedule.name,
                    unit=costs.unit)
