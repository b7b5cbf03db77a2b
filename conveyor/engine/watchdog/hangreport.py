"""The hang report: where every rank stood when a step failed or stopped moving.

Made from the ranks' :class:`~conveyor.engine.watchdog.position.Position` snapshots (in one
process, read from the threads; under torchrun, gathered from the surviving ranks), it
says for each rank the last action it finished, the action it is in, the message it
waits for and for how long, and draws the table's clock with each rank's place marked::

    where each rank stood (step 3 of '1f1b', 2 ranks, 4 micro-batches; forward+backward):
      rank 0  finished 0F3; in 0B0, waiting 5.0 s for the gradient of micro-batch 0 ...
      rank 1  finished 1F0; in 1B0, computing for 5.1 s (1/8 done)  <- stuck
    clock: UPPER done, >here, lower not reached
            0    1    2    3    4    5    6
      rank 0  0F0  0F1  0F2  0F3  .    >0B0 0f4 ...

A rank that did not answer is named as such, with what the others saw of it (its
connection closed: it died; no answer: frozen, or stuck outside Python).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from conveyor.engine.watchdog.position import KIND_WORDS, describe
from conveyor.schedules import (
    Action,
    Kind,
    Schedule,
    actions_of,
    layout_clock,
    render_clock,
)

__all__: list[str] = []

_WINDOW = 8  # ticks drawn on each side of the marked places


def render_report(schedule: Schedule, kinds: Iterable[Kind],
                  snapshots: Mapping[int, dict[str, Any] | None],
                  notes: Mapping[int, str] = {}, absent: str = "no answer",
                  place: str = "") -> str:
    """The report of one run of ``kinds`` of ``schedule``, from each rank's snapshot.

    Args:
        snapshots: per pipeline rank, its :meth:`Position.snapshot` (None: it did not
            answer).
        notes: per rank, what to add to its line (why it did not answer, "stuck").
        absent: what a rank without a snapshot is said to be.
        place: which pipeline of a mesh this is, for the first line ("" for the only one).
    """
    kinds = set(kinds)
    phase = actions_of(schedule, kinds)
    step = next((s["step"] for s in snapshots.values() if s), 0)
    what = "+".join(KIND_WORDS[k] for k in Kind if k in kinds)
    lines = [f"where each rank stood (step {step} of {schedule.name!r}, "
             f"{schedule.num_ranks} ranks, {schedule.num_microbatches} micro-batches; {what}"
             f"{place}):"]
    for rank in range(schedule.num_ranks):
        snapshot = snapshots.get(rank)
        text = describe(snapshot) if snapshot else absent
        note = notes.get(rank)
        lines.append(f"  rank {rank}  {text}" + (f"  <- {note}" if note else ""))
    lines.append("clock (one tick per action): UPPER done, >here, lower not reached")
    lines.append(_marked_clock(schedule, kinds, phase, snapshots))
    return "\n".join(lines)


def _marked_clock(schedule: Schedule, kinds: set[Kind], phase: Mapping[int, list[Action]],
                  snapshots: Mapping[int, dict[str, Any] | None]) -> str:
    table = schedule
    if kinds == {Kind.FORWARD}:  # laid out alone: its backward never runs
        table = Schedule(tuple(tuple(a for a in column if a.kind is Kind.FORWARD)
                               for column in schedule.columns),
                         schedule.num_stages, schedule.num_microbatches,
                         name=schedule.name, edges=schedule.edges)
    grid = layout_clock(table)
    state: dict[Action, str] = {}  # "done", "here" or "later" for this run's actions
    for rank, column in phase.items():
        snapshot = snapshots.get(rank)
        done = snapshot["done"] if snapshot else 0
        for index, action in enumerate(column):
            here = snapshot is not None and index == done and snapshot["action"] is not None
            state[action] = "done" if index < done else "here" if here else "later"

    def cell(rank: int, action: Action) -> str:
        mark = state.get(action, "done")  # not run now: a forward before this backward
        text = str(action)
        return f">{text}" if mark == "here" else text.lower() if mark == "later" else text

    marked = [t for row in grid for t, a in enumerate(row)
              if a is not None and state.get(a) == "here"]
    reached = [t for row in grid for t, a in enumerate(row)
               if a is not None and state.get(a) == "done"]
    centre = marked or reached[-1:] or [0]
    total = max(len(row) for row in grid)
    ticks = range(max(0, min(centre) - _WINDOW), min(total, max(centre) + _WINDOW + 1))
    return render_clock(grid, cell=cell, ticks=ticks)
