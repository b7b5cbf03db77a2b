"""The ranks of one process on threads, watched so that a step never hangs.

Each rank runs its column on a thread of its own while the caller watches them. A
receive waits at most the timeout (the transport raises :class:`StepTimeout`); the
caller also stops the run when a rank has been computing one action longer than the
timeout (a layer stuck in a loop sends nothing, so the ranks that wait for it are the
ones to time out, but a rank nobody waits for would hang the step). Once the run has
failed, every rank stops at its next action or receive; a thread that has not ended
after a grace period is left behind::

    caller     start ranks ── join 0.25 s ── join ── ... rank 1 runs 1F2 > timeout:
                                                     abort ── grace (<= 5 s) ── raise
    rank 0     0F0 0F1 [waits for 1B0 .......................] Aborted: ends
    rank 1     1F0 1F1 [1F2: an endless loop ....................................]
                                                           left behind, daemon

A thread cannot be stopped from outside in Python: the one left behind keeps running
until it leaves its layer (then it stops before its next action) or the process ends.
It may still touch its stage, so the executor refuses further runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from conveyor.engine.transport import Transport
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.engine.watchdog.position import FAILED, RUNNING, Position, doing
from conveyor.errors import StepTimeout, add_note
from conveyor.schedules import Action

__all__: list[str] = []

GRACE = 5.0  # seconds the other ranks get to stop once a run has failed



class WatchedRanks:
    """One run of several ranks on threads, and the caller's watch over them.

    Args:
        positions: where each rank stands (the executor's, updated by ``work``).
        deadlines: the timeout of an action.
        transport: aborted when a rank is stuck (every receive then stops).
        errors: where the ranks' errors go (the first is raised by the executor).
        lock: guards ``errors``.
    """

    def __init__(self, positions: Mapping[int, Position], deadlines: Deadlines,
                 transport: Transport, errors: list[BaseException],
                 lock: threading.Lock) -> None:
        self.positions = positions
        self.deadlines = deadlines
        self.transport = transport
        self.errors = errors
        self.lock = lock

    def run(self, ranks: Sequence[int], work: Callable[[int], None], step: int) -> str | None:
        """Runs ``work(rank)`` for each rank on its own thread until all have ended, or
        the run failed and a grace period passed; returns why threads were left behind
        (None: none was)."""
        threads = {rank: threading.Thread(target=work, args=(rank,), daemon=True,
                                          name=f"conveyor-rank{rank}") for rank in ranks}
        for thread in threads.values():
            thread.start()
        try:
            return self._watch(threads, step)
        except BaseException:  # the caller was interrupted (Ctrl-C): stop the ranks
            self.transport.abort(None)
            raise

    def _watch(self, threads: Mapping[int, threading.Thread], step: int) -> str | None:
        given_up_at: float | None = None
        while alive := [t for t in threads.values() if t.is_alive()]:
            alive[0].join(0.25)
            if not self.errors:
                stuck = stuck_action(self.positions, self.deadlines.within)
                if stuck is not None:
                    with self.lock:
                        self.errors.append(stuck)
                    self.transport.abort(stuck)
            if self.errors and given_up_at is None:
                given_up_at = time.monotonic() + min(self.deadlines.within, GRACE)
            if given_up_at is not None and time.monotonic() > given_up_at:
                left = [rank for rank, t in threads.items() if t.is_alive()]
                if not left:
                    return None
                why = (f"step {step} was abandoned with "
                       + ", ".join(f"rank {r} still in {self.positions[r].action or 'its column'}"
                                   for r in left)
                       + "; a thread cannot be stopped from outside, so it is left running "
                       "(a daemon thread: it ends with the process) and may still touch its "
                       "stage: this pipeline refuses further steps. Build a new one, or "
                       "restart the process")
                with self.lock:
                    self.errors[0] = _abandoned(self.errors[0], why, [
                        self.positions[r] for r in left])
                return why
        return None


def stuck_action(positions: Mapping[int, Position], limit: float) -> StepTimeout | None:
    """A StepTimeout for a rank that has run one action longer than ``limit`` seconds."""
    for position in positions.values():
        action = position.action
        if position.state == RUNNING and action is not None and position.seconds() > limit:
            return _too_long(position, action, f"for more than {limit:g} s: stuck in a "
                                               "layer, or slower than the timeout (raise "
                                               "timeout=)")
    return None


def notes(positions: Mapping[int, Position], limit: float) -> dict[int, str]:
    """What a report says beside each rank: which one stopped the run, and how."""
    said = {}
    for rank, position in positions.items():
        if position.state == RUNNING and position.seconds() > limit:
            said[rank] = "stuck"
        elif position.state == FAILED:
            said[rank] = "failed here" if position.awaited is None else "timed out here"
    return said


def attach_report(error: BaseException, report: str) -> None:
    """Gives ``error`` a run's hang report, as ``where`` and as a note (once)."""
    if getattr(error, "where", None) is not None:
        return
    try:
        error.where = report  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__
        return
    add_note(error, report)


def _abandoned(error: BaseException, why: str, left: Sequence[Position]) -> BaseException:
    """The error of a run that left threads behind: a StepTimeout naming the first rank
    still computing (the run's first error as its cause), else ``error``; with ``why``
    as a note."""
    computing = [p for p in left if p.state == RUNNING and p.action is not None]
    if computing and not (isinstance(error, StepTimeout) and error.action != "recv"):
        position = computing[0]
        action = position.action
        assert action is not None
        stuck = _too_long(position, action, f"for {position.seconds():.1f} s and did not stop "
                                            "when the step failed: stuck in a layer "
                                            f"({type(error).__name__} elsewhere: {error})")
        stuck.__cause__ = error
        error = stuck
    add_note(error, why)
    return error


def _too_long(position: Position, action: Action, how: str) -> StepTimeout:
    """The StepTimeout of a rank that has run ``action`` too long, ``how`` said."""
    return StepTimeout(f"rank {position.rank} has run {action} ({doing(action)}) {how}",
                       stage=action.stage, microbatch=action.microbatch, action=str(action))
