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

Stage s always hands its forward's values to stage s + 1, which sends their gradient
back. A table may also list *edges*: ``0->2`` says that stage 0's forward makes values
that stage 2's forward uses (a U-Net's long skip, an attention mask), sent from 0 to 2
directly, once per micro-batch, and not through stage 1; the gradient of those values
comes back from 2 to 0 in backward. ``0~>2`` is an edge whose values carry no gradient
(integer masks, position ids), so nothing comes back. The text form lists them on a
last line, ``edges: 0->2 0~>3``.

The functions that build tables live in :mod:`.builders`, the one validator every table
passes in :mod:`.validator`. This package imports nothing from torch, so schedules can be
built, printed, checked and simulated anywhere.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property

from conveyor.errors import ScheduleError

__all__ = ["Action", "Edge", "Kind", "Message", "Schedule", "actions_of", "check_size",
           "dependencies", "parse"]


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
_EDGE = re.compile(r"(\d+)([-~])>(\d+)")


@dataclass(frozen=True, order=True)
class Edge:
    """Stage ``source``'s forward makes values that stage ``destination``'s uses, and
    sends them there directly (stage s + 1 gets its values without an edge).

    Attributes:
        gradient: whether some of the values carry a gradient, which the destination's
            backward sends back to the source's; False for masks and ids.
    """

    source: int
    destination: int
    gradient: bool = True

    def __str__(self) -> str:
        return f"{self.source}{'-' if self.gradient else '~'}>{self.destination}"


@dataclass(frozen=True)
class Message:
    """What an action sends: the values (``"activation"``) or their gradients
    (``"gradient"``) of ``microbatch``, from stage ``source`` to stage ``destination``."""

    kind: str
    source: int
    destination: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind} of micro-batch {self.microbatch} from stage {self.source} to " \
               f"stage {self.destination}"


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
    schedules). A runtime sends a stage's output to whichever rank holds the next
    stage, and the values of each edge to the rank that holds its destination: what
    each action sends is :meth:`messages`.

    Attributes:
        columns: ``columns[r]`` is the ordered tuple of actions rank ``r`` runs.
        num_stages: the number of stages S; stages are ``0..S-1``.
        num_microbatches: the number of micro-batches M; they are ``0..M-1``.
        name: a label used in messages and pictures.
        edges: values sent past the next stage, straight to a later one (kept sorted);
            none for a sequence of layers.
    """

    columns: tuple[tuple[Action, ...], ...]
    num_stages: int
    num_microbatches: int
    name: str = "custom"
    edges: tuple[Edge, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "edges", tuple(sorted(self.edges)))

    @property
    def num_ranks(self) -> int:
        return len(self.columns)

    @cached_property
    def actions(self) -> frozenset[Action]:
        """Every action of the table, whatever its rank."""
        return frozenset(a for column in self.columns for a in column)

    @cached_property
    def splits_backward(self) -> bool:
        """Whether some backward is split into an ``I`` and a later ``W``."""
        return any(a.kind is Kind.WEIGHT for a in self.actions)

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

    def with_edges(self, edges: Iterable[Edge]) -> Schedule:
        """The same table with ``edges`` (in place of any it had)."""
        return replace(self, edges=tuple(edges))

    def forward_from(self, stage: int) -> tuple[int, ...]:
        """The stages whose values ``stage``'s forward receives: the one before it,
        then the sources of its edges."""
        return self._links[stage][0]

    def forward_to(self, stage: int) -> tuple[int, ...]:
        """The stages ``stage``'s forward sends values to: the next one, then the
        destinations of its edges."""
        return self._links[stage][1]

    def backward_from(self, stage: int) -> tuple[int, ...]:
        """The stages whose backward sends ``stage``'s backward a gradient: the next
        one, then the destinations of its edges that carry gradients."""
        return self._links[stage][2]

    def backward_to(self, stage: int) -> tuple[int, ...]:
        """The stages ``stage``'s backward sends gradients to: the one before it, then
        the sources of its edges that carry gradients."""
        return self._links[stage][3]

    @cached_property
    def _links(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """Per stage (runtimes ask at every action): forward from, forward to, backward
        from, backward to."""
        links: dict[int, tuple[tuple[int, ...], ...]] = {}
        for s in range(self.num_stages):
            before = (s - 1,) if s > 0 else ()
            after = (s + 1,) if s + 1 < self.num_stages else ()
            into = [e for e in self.edges if e.destination == s]
            out = [e for e in self.edges if e.source == s]
            links[s] = (before + tuple(e.source for e in into),
                        after + tuple(e.destination for e in out),
                        after + tuple(e.destination for e in out if e.gradient),
                        before + tuple(e.source for e in into if e.gradient))
        return links

    def messages(self, action: Action) -> tuple[Message, ...]:
        """What ``action`` sends, in the order a runtime sends it: a forward its values
        to each stage of :meth:`forward_to`, a ``B`` or ``I`` gradients to each stage
        of :meth:`backward_to`, a ``W`` nothing."""
        known = self._messages.get(action)
        if known is not None:
            return known
        s, m = action.stage, action.microbatch
        if action.kind is Kind.FORWARD:
            found = tuple(Message("activation", s, d, m) for d in self._links[s][1])
        elif action.kind is Kind.WEIGHT:
            found = ()
        else:
            found = tuple(Message("gradient", s, d, m) for d in self._links[s][3])
        self._messages[action] = found
        return found

    @cached_property
    def _messages(self) -> dict[Action, tuple[Message, ...]]:
        """What each action sends, as :meth:`messages` works it out."""
        return {}

    def to_text(self) -> str:
        """One line per rank, actions separated by spaces; ``-`` for an idle rank; the
        edges, if any, on a last line (``edges: 0->2 0~>3``)."""
        lines = [" ".join(map(str, column)) or "-" for column in self.columns]
        if self.edges:
            lines.append("edges: " + " ".join(map(str, self.edges)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def parse(text: str, *, name: str = "custom") -> Schedule:
    """Reads the text form written by :meth:`Schedule.to_text` (one line per rank).

    The numbers of stages and micro-batches are the largest ones mentioned, plus one.
    Blank lines are ignored; a rank that runs nothing is written ``-``; a line
    ``edges: 0->2 0~>3`` lists the edges.

    Raises:
        ScheduleError: a token is not an action, or not an edge on the edges line.
    """
    columns: list[tuple[Action, ...]] = []
    edges: list[Edge] = []
    for line in (line.strip() for line in text.strip().splitlines()):
        if not line:
            continue
        if line.startswith("edges:"):
            edges += [_parse_edge(token) for token in line.removeprefix("edges:").split()]
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
        edges=tuple(edges),
    )


def _parse_edge(token: str) -> Edge:
    match = _EDGE.fullmatch(token)
    if match is None:
        raise ScheduleError(f"edges: {token!r} is not an edge; write 0->2 (stage 0's values "
                            "used by stage 2, gradients back) or 0~>2 (no gradients)")
    return Edge(int(match[1]), int(match[3]), gradient=match[2] == "-")


def check_size(**sizes: int) -> None:
    """Raises ScheduleError unless every size is a positive integer."""
    for label, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{label} must be a positive integer, got {value!r}")


def dependencies(action: Action, schedule: Schedule) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes (on any rank).

    ``F`` of stage s needs the activation of stage s-1, and the values of every edge
    into s. ``B`` and ``I`` need their own forward and the gradient from stage s+1 (and
    from the destination of every edge out of s that carries gradients), which that
    stage's ``B`` or ``I`` of the micro-batch sends (whichever the table has). ``W``
    needs its own ``I``.
    """
    s, m = action.stage, action.microbatch
    if action.kind is Kind.FORWARD:
        return tuple(Action(i, Kind.FORWARD, m) for i in schedule.forward_from(s))
    if action.kind is Kind.WEIGHT:
        return (Action(s, Kind.INPUT, m),)
    return (Action(s, Kind.FORWARD, m),
            *(schedule.backward_of(j, m) for j in schedule.backward_from(s)))


def actions_of(schedule: Schedule, kinds: Iterable[Kind]) -> dict[int, list[Action]]:
    """Each rank's column restricted to ``kinds``, order kept (a phase of the table)."""
    wanted = set(kinds)
    return {rank: [a for a in column if a.kind in wanted]
            for rank, column in enumerate(schedule.columns)}
