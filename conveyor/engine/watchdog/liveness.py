"""Whether a wait that ran out should go on: a pipeline is given up on when it goes
silent, not when one wait is long.

A schedule makes some waits long by design: under GPipe, stage 0's first gradient comes
only after every stage's forwards and the last stage's first backward, however slow a
stage is. So ``timeout=`` is not the length of a wait. It is:

* the longest one action may run (a stage computing one micro-batch longer than that
  is stuck: see :mod:`conveyor.engine.watchdog.threads`, and below for other ranks);
* the longest the pipeline may go without progress: when a wait for a message runs
  out, the waiting rank looks at every rank (its threads' positions, or under torchrun
  what each rank answers through the store) and waits another ``timeout`` if, since its
  last look, some rank finished an action, or one is computing an action it began less
  than ``timeout`` ago. A rank that froze, died or deadlocks makes no progress, and is
  named one ``timeout`` (plus the seconds a look takes) after the last progress.
* for a peer that has not reached the step yet (saving, evaluating), the opening
  timeout, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.engine.watchdog.position import RUNNING

__all__: list[str] = []


def progressed(snapshots: Mapping[int, dict[str, Any] | None], seen: dict[int, int] | None,
               within: float) -> tuple[bool, dict[int, int]]:
    """Whether the ranks of ``snapshots`` (their positions as plain data; None: no
    answer) moved since ``seen`` (the actions each had finished at the last look; None:
    no look yet): a rank finished an action since, or is computing one begun less than
    ``within`` seconds ago. Returns that, and what they have finished now.

    Positions of another step than the newest among them count as no progress (a rank
    between steps is not computing this step)."""
    answered = {rank: s for rank, s in snapshots.items() if s is not None}
    step = max((s["step"] for s in answered.values()), default=0)
    now = {rank: int(s["done"]) for rank, s in answered.items() if s["step"] == step}
    moved = seen is not None and any(done > seen.get(rank, -1) for rank, done in now.items())
    computing = any(s["state"] == RUNNING and s["step"] == step and s["seconds"] < within
                    for s in answered.values())
    return moved or computing, now


def keep_waiting(places: Mapping[int, dict[str, Any] | None], peer: int, *, step: int,
                 heard: bool, waited: float, seen: dict[int, int] | None,
                 deadlines: Deadlines, progress: bool) -> dict[int, int] | None:
    """Whether a rank of another process that waited ``waited`` seconds in ``step`` for
    ``peer`` should wait on, given where the ranks are (``places``): a peer not heard
    from in the step that has not reached it yet, up to the opening timeout; with
    ``progress``, while the pipeline makes progress (:func:`progressed`). Returns the
    finished actions to compare with at the next look, or None: give up."""
    place = places.get(peer)
    if not heard and place is not None and place["step"] < step and waited < deadlines.opening:
        return seen or {}  # the peer is saving, evaluating...: not in the step yet
    if not progress:
        return None
    alive, now = progressed(places, seen, deadlines.within)
    return now if alive else None
