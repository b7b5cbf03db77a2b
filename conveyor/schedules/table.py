"""The schedule table: actions, one ordered column per rank, and its one validator.

A schedule never decides anything at run time. It is a table: rank r runs the actions
of ``schedule.columns[r]`` in order, and every runtime, the validator and the renderers
read that same table. Actions print compactly as ``{stage}{kind}{microbatch}``; the GPipe
table for 2 stages and 3 micro-batches reads::

    0F0 0F1 0F2 0B2 0B1 0B0
    1F0 1F1 1F2 1B2 1B1 1B0

Laid out on a clock where every action takes one tick (``render_clock``), the same table
is the fill-drain picture of the paper::

            0   1   2   3   4   5   6   7
    rank 0  0F0 0F1 0F2 .   .   0B2 0B1 0B0
    rank 1  .   1F0 1F1 1F2 1B2 1B1 1B0 .

An action means the same thing whatever else the table holds: ``F`` is a forward,
``B`` a full backward (input and weight gradients), and ``I`` then ``W`` the same
backward split in two, the input gradient first so that it can travel upstream and the
weight gradient later, in what would be a bubble. Tables may mix them: one micro-batch
or stage with ``B``, another with ``I`` and ``W``.

The functions that build tables live in :mod:`conveyor.schedules`. This module imports
nothing from torch, so schedules can be built, printed, checked and simulated anywhere.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from conveyor.errors import ScheduleError

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "actions_of",
    "check_size",
    "dependencies",
    "layout_clock",
    "parse",
    "render_clock",
    "validate",
]


class Kind(str, enum.Enum):
    """What an action does to one micro-batch on one stage."""

    #: The forward pass.
    FORWARD = "F"
    #: The full backward pass: the input gradient, sent upstream, and the weight gradient.
    BACKWARD = "B"
    #: The input gradient only; the same micro-batch's ``W`` computes its weight gradient.
    INPUT = "I"
    #: The weight gradient left by ``I``, deferred so that it can fill bubbles (zero-bubble).
    WEIGHT = "W"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, order=True)
class Action:
    """One step of a schedule: ``kind`` of micro-batch ``microbatch`` on ``stage``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


def _parse_action(token: str, where: str) -> Action:
    match = _ACTION.fullmatch(token)
    if match is None:
        raise ScheduleError(
            f"{where}: {token!r} is not an action; write actions like 1F3 "
            "(stage 1, forward, micro-batch 3), with kinds F, B, I or W"
        )
    return Action(int(match[1]), Kind(match[2]), int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """A table of actions, one ordered column per rank.

    A rank is one worker: a thread driving a device in one process, or one process
    under torchrun. Each stage belongs to exactly one rank (several, for interleaved
    schedules). The table says nothing about transfers: a runtime sends a stage's
    output to whichever rank holds the next stage.

    Attributes:
        columns: ``columns[r]`` is the ordered tuple of actions rank ``r`` runs.
        num_stages: the number of stages S; stages are ``0..S-1``.
        num_microbatches: the number of micro-batches M; they are ``0..M-1``.
        name: a label used in messages and pictures.
    """

    columns: tuple[tuple[Action, ...], ...]
    num_stages: int
    num_microbatches: int
    name: str = "custom"

    @property
    def num_ranks(self) -> int:
        return len(self.columns)

    @cached_property
    def actions(self) -> frozenset[Action]:
        """Every action of the table, whatever its rank."""
        return frozenset(a for column in self.columns for a in column)

    def backward_of(self, stage: int, microbatch: int) -> Action:
        """The action that computes ``stage``'s input gradient of ``microbatch``.

        That is its ``I`` where the table splits this backward, else its ``B`` (also
        when the table has neither: the validator then reports it missing).
        """
        split = Action(stage, Kind.INPUT, microbatch)
        return split if split in self.actions else Action(stage, Kind.BACKWARD, microbatch)

    @cached_property
    def stage_ranks(self) -> tuple[int, ...]:
        """``stage_ranks[s]`` is the rank that runs stage ``s``. Needs a valid table."""
        owner: dict[int, int] = {}
        for rank, column in enumerate(self.columns):
            for action in column:
                owner.setdefault(action.stage, rank)
        return tuple(owner[s] for s in range(self.num_stages))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    def to_text(self) -> str:
        """One line per rank, actions separated by spaces; ``-`` for an idle rank."""
        return "\n".join(" ".join(map(str, column)) or "-" for column in self.columns)

    def __str__(self) -> str:
        return self.to_text()


def parse(text: str, *, name: str = "custom") -> Schedule:
    """Reads the text form written by :meth:`Schedule.to_text` (one line per rank).

    The numbers of stages and micro-batches are the largest ones mentioned, plus one.
    Blank lines are ignored; a rank that runs nothing is written ``-``.

    Raises:
        ScheduleError: a token is not an action.
    """
    columns: list[tuple[Action, ...]] = []
    for line in (line.strip() for line in text.strip().splitlines()):
        if not line:
            continue
        rank = len(columns)
        tokens = [] if line == "-" else line.split()
        columns.append(tuple(_parse_action(t, f"rank {rank}") for t in tokens))
    actions = [a for column in columns for a in column]
    if not actions:
        raise ScheduleError("a schedule needs at least one action")
    return Schedule(
        tuple(columns),
        num_stages=max(a.stage for a in actions) + 1,
        num_microbatches=max(a.microbatch for a in actions) + 1,
        name=name,
    )


def check_size(**sizes: int) -> None:
    """Raises ScheduleError unless every size is a positive integer."""
    for label, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{label} must be a positive integer, got {value!r}")


def dependencies(action: Action, schedule: Schedule) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes (on any rank).

    ``F`` of stage s needs the activation of stage s-1. ``B`` and ``I`` need their own
    forward and the gradient from stage s+1, which that stage's ``B`` or ``I`` of the
    micro-batch sends (whichever the table has). ``W`` needs its own ``I``.
    """
    s, m = action.stage, action.microbatch
    if action.kind is Kind.FORWARD:
        return (Action(s - 1, Kind.FORWARD, m),) if s > 0 else ()
    if action.kind is Kind.WEIGHT:
        return (Action(s, Kind.INPUT, m),)
    own = Action(s, Kind.FORWARD, m)
    if s + 1 < schedule.num_stages:
        return (own, schedule.backward_of(s + 1, m))
    return (own,)


def validate(schedule: Schedule) -> None:
    """Checks that ``schedule`` is complete, consistent and free of deadlock.

    Every stage must live on one rank; every (stage, micro-batch) needs exactly one
    ``F`` and one backward: either ``B``, or ``I`` and ``W``; and the table must run to
    the end when each rank follows its column and waits for the results it needs.

    Raises:
        ScheduleError: the first problem found, with the table and the failing step.
    """
    check_size(num_stages=schedule.num_stages, num_microbatches=schedule.num_microbatches)
    seen: dict[Action, tuple[int, int]] = {}
    owner: dict[int, int] = {}
    for rank, column in enumerate(schedule.columns):
        for step, action in enumerate(column):
            where = (rank, step)
            if not (0 <= action.stage < schedule.num_stages) or not (
                0 <= action.microbatch < schedule.num_microbatches
            ):
                _fail(
                    schedule,
                    f"{action} is outside the table's {schedule.num_stages} stages "
                    f"and {schedule.num_microbatches} micro-batches",
                    where,
                )
            if action in seen:
                first = seen[action]
                _fail(schedule, f"{action} appears twice (first at rank {first[0]}, "
                      f"step {first[1]})", where)
            if owner.setdefault(action.stage, rank) != rank:
                _fail(
                    schedule,
                    f"stage {action.stage} runs on rank {owner[action.stage]} and "
                    f"rank {rank}; each stage belongs to one rank",
                    where,
                )
            seen[action] = where
    _check_backward_kinds(schedule, seen)
    for action, where in seen.items():
        for needed in dependencies(action, schedule):
            # A stage's actions share a rank; one in no column is reported missing below.
            if needed.stage == action.stage and seen.get(needed, where) > where:
                _fail(schedule, f"{action} comes before {needed} on its own rank", where)
    missing = [
        needed
        for s in range(schedule.num_stages)
        for m in range(schedule.num_microbatches)
        for needed in (Action(s, Kind.FORWARD, m), schedule.backward_of(s, m))
        if needed not in seen
    ]
    if missing:
        listed = " ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(
            f"schedule {schedule.name!r} is incomplete: {len(missing)} actions missing "
            f"({listed})\n{_render_text(schedule, None)}"
        )
    layout_clock(schedule)


def _check_backward_kinds(schedule: Schedule, seen: dict[Action, tuple[int, int]]) -> None:
    """Each (stage, micro-batch) runs one backward: ``B``, or ``I`` and then ``W``.

    ``seen`` maps each action to its (rank, step), in table order."""
    for action, where in seen.items():
        s, m = action.stage, action.microbatch
        full = Action(s, Kind.BACKWARD, m)
        split = Action(s, Kind.INPUT, m)
        weight = Action(s, Kind.WEIGHT, m)
        if action in (full, split) and (full in seen and split in seen):
            later = max(full, split, key=seen.__getitem__)
            earlier = split if later == full else full
            _fail(schedule, f"{later} and {earlier} both run the backward of stage {s}, "
                  f"micro-batch {m}: keep {full} (full backward) or {split} followed by "
                  f"{weight} (split backward), not both", seen[later])
        if action == weight and split not in seen:
            fix = (f"{full} already computes the weight gradient: drop {weight}, or split "
                   f"{full} into {split} and {weight}" if full in seen else
                   f"add {split} before it, or write {full} (full backward) instead")
            _fail(schedule, f"{weight} has no {split} to take the weight gradient from; "
                  f"{fix}", where)
        if action == split and weight not in seen:
            _fail(schedule, f"{split} computes only the input gradient and no {weight} "
                  f"follows with the weight gradient: add {weight} after it, or write "
                  f"{full} (full backward) instead", where)


def _fail(schedule: Schedule, problem: str, where: tuple[int, int]) -> None:
    rank, step = where
    raise ScheduleError(
        f"schedule {schedule.name!r}, rank {rank}, step {step}: {problem}\n"
        f"{_render_text(schedule, where)}"
    )


def _render_text(schedule: Schedule, mark: tuple[int, int] | None) -> str:
    """The text form with ``rank r:`` labels; the action at ``mark`` is bracketed."""
    lines = []
    for rank, column in enumerate(schedule.columns):
        cells = [
            f"[{a}]" if (rank, step) == mark else str(a) for step, a in enumerate(column)
        ]
        lines.append(f"  rank {rank}: " + (" ".join(cells) or "-"))
    return "\n".join(lines)


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
            f"{d} (rank {rank_of[d]})" if d in rank_of else f"{d} (in no rank's column)"
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


def render_clock(
    grid: Sequence[Sequence[Action | None]],
    *,
    waiting: Sequence[Action | None] | None = None,
) -> str:
    """Draws a clock grid as text, one row per rank; ``.`` is an idle tick.

    Args:
        grid: ``grid[r][t]`` as returned by :func:`layout_clock`.
        waiting: optionally, per rank, an action drawn as ``>1B0`` after the last tick:
            the action the rank is stuck on.
    """
    ticks = max((len(row) for row in grid), default=0)
    extra = 1 if waiting is not None and any(w is not None for w in waiting) else 0
    cells: list[list[str]] = []
    for rank, row in enumerate(grid):
        line = [str(a) if a is not None else "." for a in row] + ["."] * (ticks - len(row))
        if extra:
            stuck = waiting[rank] if waiting is not None else None
            line.append(f">{stuck}" if stuck is not None else "")
        cells.append(line)
    width = max([len(str(ticks + extra))] + [len(c) for line in cells for c in line])
    label = max(len(f"rank {len(grid) - 1}"), 4)
    header = " " * label + "  " + " ".join(f"{t:<{width}}" for t in range(ticks + extra))
    rows = [
        f"{f'rank {r}':<{label}}  " + " ".join(f"{c:<{width}}" for c in line)
        for r, line in enumerate(cells)
    ]
    return "\n".join(line.rstrip() for line in [header, *rows])


def actions_of(schedule: Schedule, kinds: Iterable[Kind]) -> dict[int, list[Action]]:
    """Each rank's column restricted to ``kinds``, order kept (a phase of the table)."""
    wanted = set(kinds)
    return {rank: [a for a in column if a.kind in wanted]
            for rank, column in enumerate(schedule.columns)}
