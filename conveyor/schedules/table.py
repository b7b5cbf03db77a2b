"""The schedule table: actions, one ordered column per rank, and what each action needs.

A schedule never decides anything at run time. It is a table: rank r runs the actions
of ``schedule.columns[r]`` in order, and every runtime, the validator and the renderers
read that same table. Actions print compactly as ``{stage}{kind}{microbatch}``; the GPipe
table for 2 stages and 3 micro-batches reads::

    0F0 0F1 0F2 0B2 0B1 0B0
    1F0 1F1 1F2 1B2 1B1 1B0

Laid out on a clock where every action takes one tick (:mod:`.clock`), the same table is
the fill-drain picture of the paper::

            0   1   2   3   4   5   6   7
    rank 0  0F0 0F1 0F2 .   .   0B2 0B1 0B0
    rank 1  .   1F0 1F1 1F2 1B2 1B1 1B0 .

An action means the same thing whatever else the table holds: ``F`` is a forward,
``B`` a full backward (input and weight gradients), and ``I`` then ``W`` the same
backward split in two, the input gradient first so that it can travel upstream and the
weight gradient later, in what would be a bubble. Tables may mix them: one micro-batch
or stage with ``B``, another with ``I`` and ``W``.

The functions that build tables live in :mod:`.builders`, the one validator every table
passes in :mod:`.validator`. This package imports nothing from torch, so schedules can be
built, printed, checked and simulated anywhere.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from conveyor.errors import ScheduleError

__all__ = ["Action", "Kind", "Schedule", "actions_of", "check_size", "dependencies", "parse"]


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


def actions_of(schedule: Schedule, kinds: Iterable[Kind]) -> dict[int, list[Action]]:
    """Each rank's column restricted to ``kinds``, order kept (a phase of the table)."""
    wanted = set(kinds)
    return {rank: [a for a in column if a.kind in wanted]
            for rank, column in enumerate(schedule.columns)}
