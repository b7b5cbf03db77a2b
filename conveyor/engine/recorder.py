"""The runtime's recording hook: when set on an executor, each action's start, end,
waiting and transfer time is noted. ``conveyor.record`` turns the notes into a Timeline.

Off by default and free when off (the executor checks one attribute per action). When
on, each action costs two clock reads, plus two around each receive and send.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from conveyor.schedules import Action

__all__: list[str] = []


class ActionRecord(NamedTuple):
    """One action as a rank ran it, in seconds since the recorder's origin."""

    rank: int
    action: Action
    start: float
    end: float
    wait: float  # of the duration: waiting for a neighbour's message
    transfer: float  # of the duration: moving tensors out


class Recorder:
    """Collects action records from the ranks' threads of one process."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.records: list[ActionRecord] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def measure(self, rank: int, action: Action, run: Callable[[], None]) -> None:
        """Runs one action and records it, with its waiting and transfer time."""
        self._local.wait = self._local.transfer = 0.0
        start = time.perf_counter()
        try:
            run()
        finally:
            end = time.perf_counter()
            record = ActionRecord(rank, action, start - self.origin, end - self.origin,
                                  self._local.wait, self._local.transfer)
            with self._lock:
                self.records.append(record)

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """Counts the body as waiting for a neighbour (a receive)."""
        return self._counted("wait")

    def transferring(self) -> contextlib.AbstractContextManager[None]:
        """Counts the body as moving tensors out (a send)."""
        return self._counted("transfer")

    @contextlib.contextmanager
    def _counted(self, name: str) -> Iterator[None]:
        """Adds the body's time to this thread's ``name`` total for the action."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self._local, name,
                    getattr(self._local, name, 0.0) + time.perf_counter() - start)
