"""A table laid out on a clock where every action takes one tick, and drawn as text.

The clock is how the validator finds deadlocks (a tick at which no rank can move) and
how a table is pictured: the paper's fill-drain diagram is the GPipe table on it; its
order (:func:`clock_order`) is how ranks that share a thread interleave their columns,
and where every rank joins a collective that one rank's action starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from conveyor.errors import ScheduleError
from conveyor.schedules.table import Action, Schedule, dependencies

__all__ = ["layout_clock", "render_clock"]


def layout_clock(schedule: Schedule) -> list[list[Action | None]]:
    """Lays the table out on a clock where every action takes one tick.

    An action starts at the first tick after the actions it depends on have finished
    and its rank has finished the previous action of its column.

    Returns:
        ``grid[r][t]``: the action rank ``r`` runs at tick ``t``, or None when idle.

    Raises:
        ScheduleError: the table deadlocks; the message shows the clock up to the stall
            and what every stuck rank waits for.
    """
    rank_of = {a: r for r, column in enumerate(schedule.columns) for a in column}
    done: set[Action] = set()
    position = [0] * schedule.num_ranks
    grid: list[list[Action | None]] = [[] for _ in schedule.columns]
    total = sum(len(column) for column in schedule.columns)
    while len(done) < total:
        ready = []
        for rank, column in enumerate(schedule.columns):
            step = position[rank]
            if step < len(column) and all(d in done for d in dependencies(column[step], schedule)):
                ready.append(column[step])
        if not ready:
            raise ScheduleError(_deadlock_message(schedule, grid, position, rank_of, done))
        for rank in range(schedule.num_ranks):
            column = schedule.columns[rank]
            step = position[rank]
            if step < len(column) and column[step] in ready:
                grid[rank].append(column[step])
                position[rank] += 1
            else:
                grid[rank].append(None)
        done.update(ready)
    return grid


def _deadlock_message(
    schedule: Schedule,
    grid: list[list[Action | None]],
    position: list[int],
    rank_of: dict[Action, int],
    done: set[Action],
) -> str:
    waits = []
    stuck: list[Action | None] = []
    for rank, column in enumerate(schedule.columns):
        step = position[rank]
        if step >= len(column):
            stuck.append(None)
            continue
        action = column[step]
        stuck.append(action)
        pending = [d for d in dependencies(action, schedule) if d not in done]
        named = ", ".join(
            (f"{d} (rank {rank_of[d]}{_edge_between(d, action)})" if d in rank_of
             else f"{d} (in no rank's column)")
            for d in pending
        )
        waits.append(f"  rank {rank} waits at {action} for {named}")
    tick = len(grid[0]) if grid else 0
    picture = render_clock(grid, waiting=stuck)
    return (
        f"schedule {schedule.name!r} deadlocks at tick {tick}:\n"
        + "\n".join(waits)
        + "\n"
        + picture
    )


def _edge_between(needed: Action, action: Action) -> str:
    """``, over edge 0->2`` when ``action`` waits for ``needed`` because of an edge."""
    low, high = sorted((needed.stage, action.stage))
    return f", over edge {low}->{high}" if high > low + 1 else ""


def render_clock(
    grid: Sequence[Sequence[Action | None]],
    *,
    waiting: Sequence[Action | None] | None = None,
    cell: Callable[[int, Action], str] = lambda rank, action: str(action),
    ticks: range | None = None,
) -> str:
    """Draws a clock grid as text, one row per rank; ``.`` is an idle tick.

    Args:
        grid: ``grid[r][t]`` as returned by :func:`layout_clock`.
        waiting: optionally, per rank, an action drawn as ``>1B0`` after the last tick:
            the action the rank is stuck on.
        cell: how rank r's action is drawn (by default as ``1F3``).
        ticks: the ticks to draw (by default all of them).
    """
    total = max((len(row) for row in grid), default=0)
    shown = ticks if ticks is not None else range(total)
    extra = 1 if waiting is not None and any(w is not None for w in waiting) else 0
    cells: list[list[str]] = []
    for rank, row in enumerate(grid):
        padded = list(row) + [None] * (total - len(row))
        line = [cell(rank, a) if a is not None else "." for a in (padded[t] for t in shown)]
        if extra:
            stuck = waiting[rank] if waiting is not None else None
            line.append(f">{stuck}" if stuck is not None else "")
        cells.append(line)
    numbers = [*shown, *([shown.stop] if extra else [])]
    width = max([len(str(t)) for t in numbers] + [len(c) for line in cells for c in line])
    label = max(len(f"rank {len(grid) - 1}"), 4)
    header = " " * label + "  " + " ".join(f"{t:<{width}}" for t in numbers)
    rows = [
        f"{f'rank {r}':<{label}}  " + " ".join(f"{c:<{width}}" for c in line)
        for r, line in enumerate(cells)
    ]
    return "\n".join(line.rstrip() for line in [header, *rows])


def clock_order(columns: Mapping[int, Sequence[Action]],
                 schedule: Schedule) -> list[tuple[int, Action]]:
    """Every column's actions by the tick they take on the table's clock, ranks in
    order within a tick (a dependency outside ``columns`` counts as done)."""
    present = {action for column in columns.values() for action in column}
    done: set[Action] = set()
    step = dict.fromkeys(columns, 0)
    order: list[tuple[int, Action]] = []
    while len(order) < len(present):
        ready = [(rank, column[step[rank]]) for rank, column in columns.items()
                 if step[rank] < len(column) and all(
                     d in done or d not in present
                     for d in dependencies(column[step[rank]], schedule))]
        if not ready:  # a validated table never stalls; keep each column's order
            return order + [(rank, a) for rank, column in columns.items()
                            for a in column[step[rank]:]]
        for rank, action in ready:
            step[rank] += 1
            done.add(action)
        order += ready
    return order
