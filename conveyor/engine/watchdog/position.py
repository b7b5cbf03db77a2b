"""Where each rank stands in its column of the table: what a hang report is made of.

The executor keeps one :class:`Position` per rank it runs. A rank moves through three
states around each action, and notes the time of every move::

    between ──begin(1F2)──> running ──awaiting(act of mb 2 from stage 0)──> waiting
       ^                      │  ^                                          │
       └──────end()───────────┘  └───────────────arrived()──────────────────┘

Reading a position never stops the rank: :func:`conveyor.where` and ``kill -USR1``
read them while the step runs, and a failed or timed-out step reports them from
every rank. Each move is a few attribute writes and one clock read (the benchmark
``benchmarks/hang_bookkeeping.py`` measures what they cost a step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.schedules import Action, Kind

__all__: list[str] = []

BETWEEN, RUNNING, WAITING, FINISHED, FAILED = "between", "running", "waiting", "finished", "failed"
KIND_WORDS = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward",
              Kind.INPUT: "input gradient", Kind.WEIGHT: "weight gradient"}
COLLECTIVE = "collective"  # after its actions, in one of the step's collectives
STOPPED = "stopped"  # told of a failure elsewhere (a peer's report, a timeout)


@dataclass(frozen=True)
class Awaited:
    """A message a rank waits for: its kind, the stage that sends it (on which rank),
    the stage it goes to, and its micro-batch."""

    kind: str
    source: int
    source_rank: int
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return (f"the {self.kind} of micro-batch {self.microbatch} from stage {self.source} "
                f"(rank {self.source_rank})")


class Position:
    """Where one rank is in its column during a run.

    Attributes:
        rank: the pipeline rank.
        column: the actions it runs this run, in order.
        done: how many of them have finished.
        action: the action it is in (None between actions and at the end).
        awaited: the message it waits for inside ``action`` (None: it computes).
        state: "between", "running", "waiting", "finished" or "failed".
        since: ``time.monotonic()`` when it entered the state.
        step: the pipeline's step number (counted from 1 by the pipeline).
        collective: the collective it is in after its actions (the tied weights'
            gradients, the loss), named.
    """

    __slots__ = ("rank", "column", "done", "action", "awaited", "state", "since", "step",
                 "collective", "waited")

    def __init__(self, rank: int, column: Sequence[Action], step: int = 0) -> None:
        self.rank = rank
        self.column = column
        self.step = step
        self.done = 0
        self.action: Action | None = None
        self.awaited: Awaited | None = None
        self.state = BETWEEN
        self.since = time.monotonic()
        self.collective: str | None = None
        self.waited: float | None = None  # how long it had waited when it stopped

    def begin(self, action: Action) -> None:
        self.action, self.state, self.since = action, RUNNING, time.monotonic()

    def awaiting(self, message: Awaited) -> None:
        self.awaited, self.state, self.since = message, WAITING, time.monotonic()

    def arrived(self) -> None:
        self.awaited, self.state, self.since = None, RUNNING, time.monotonic()

    def end(self) -> None:
        self.done += 1
        self.action, self.since = None, time.monotonic()
        self.state = FINISHED if self.done == len(self.column) else BETWEEN

    def joining(self, collective: str) -> None:
        self.collective, self.state, self.since = collective, COLLECTIVE, time.monotonic()

    def failed(self, elsewhere: bool = False) -> None:
        """The rank's run ended with an error: its own (``FAILED``), or, ``elsewhere``,
        one it was told of (``STOPPED``)."""
        now = time.monotonic()
        if self.state in (WAITING, COLLECTIVE):
            self.waited = now - self.since
        self.state, self.since = (STOPPED if elsewhere else FAILED), now

    def seconds(self) -> float:
        """How long it has been in its state."""
        return time.monotonic() - self.since

    def snapshot(self) -> dict[str, Any]:
        """The position as plain data (JSON), frozen now: what other ranks are sent."""
        awaited = self.awaited
        return {
            "rank": self.rank, "step": self.step, "state": self.state, "done": self.done,
            "actions": len(self.column),
            "last": str(self.column[self.done - 1]) if self.done else None,
            "action": None if self.action is None else str(self.action),
            "awaited": None if awaited is None else {
                "kind": awaited.kind, "source": awaited.source,
                "source_rank": awaited.source_rank, "stage": awaited.stage,
                "microbatch": awaited.microbatch},
            "seconds": round(self.seconds(), 3),
            "collective": self.collective,
            "waited": None if self.waited is None else round(self.waited, 3),
        }


def describe(snapshot: dict[str, Any]) -> str:
    """One line saying where a rank stands, from its :meth:`Position.snapshot`."""
    last = f"finished {snapshot['last']}" if snapshot["last"] else "finished nothing yet"
    seconds = f"{snapshot['seconds']:.1f} s"
    state = snapshot["state"]
    awaited = Awaited(**snapshot["awaited"]) if snapshot["awaited"] else None
    if state == WAITING:
        here = f"in {snapshot['action']}, waiting {seconds} for {awaited}"
    elif state in (FAILED, STOPPED) and awaited is not None:
        here = (f"stopped in {snapshot['action']} after waiting {snapshot['waited']:.1f} s "
                f"for {awaited}")
    elif state == COLLECTIVE:
        here = f"done with its actions; in {snapshot['collective']} for {seconds}"
    elif state in (FAILED, STOPPED) and snapshot["collective"]:
        here = (f"done with its actions; stopped in {snapshot['collective']} after "
                f"{snapshot['waited']:.1f} s")
    elif state == STOPPED:
        here = (f"stopped in {snapshot['action']} {seconds} ago" if snapshot["action"]
                else f"stopped before its next action {seconds} ago")
    elif state == RUNNING:
        here = f"in {snapshot['action']}, computing for {seconds}"
    elif state == FAILED:
        here = (f"failed in {snapshot['action']} {seconds} ago" if snapshot["action"]
                else f"failed {seconds} ago")
    elif state == FINISHED:
        here = f"done with its {snapshot['actions']} actions {seconds} ago"
    else:
        here = f"between actions for {seconds}"
    return f"{last}; {here} ({snapshot['done']}/{snapshot['actions']} done)"


def doing(action: Action) -> str:
    """What ``action`` does, in words: "forward of micro-batch 1 on stage 1"."""
    return f"{KIND_WORDS[action.kind]} of micro-batch {action.microbatch} on stage {action.stage}"
