"""Recording what a pipeline does: every action's start and end, per rank.

::

    with conveyor.record(pipe) as timeline:
        pipe.step(inputs, targets)
    timeline.save_chrome_trace("step.json")          # open in Perfetto
    conveyor.plot_timelines([timeline], "step.png")

Off by default and free when off (the runtime checks one attribute per action). When on,
each action costs two clock reads, plus two around each receive and send to attribute
the time spent waiting for a neighbour and moving tensors. Under torchrun every rank
records its own actions; when the block ends, every rank gets all the ranks' events,
on clocks aligned by a barrier taken when recording began.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from conveyor.schedules import Action
from conveyor.trace import Event, Timeline

__all__ = ["Recorder", "record"]


class Recorder:
    """Collects events from the ranks' threads of one process."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.events: list[Event] = []
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
            event = Event(rank, action.stage, action.kind.value, action.microbatch,
                          start - self.origin, end - self.origin,
                          wait=self._local.wait, transfer=self._local.transfer)
            with self._lock:
                self.events.append(event)

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


@contextlib.contextmanager
def record(pipe: Any) -> Iterator[Timeline]:
    """Records every step of ``pipe`` (a GPipe or a Pipeline) run inside the block.

    Yields:
        A Timeline, filled when the block ends (under torchrun, with every rank's events).
    """
    executor = pipe._executor
    topology = getattr(pipe, "topology", None)
    group = topology.pipeline_group if topology is not None and topology.distributed else None
    if group is not None:
        dist.barrier(group=group)
    recorder = Recorder()
    timeline = Timeline(num_ranks=len(set(executor.stage_ranks)), source="measured",
                        name=getattr(getattr(pipe, "schedule", None), "name", "gpipe"))
    executor.recorder = recorder
    try:
        yield timeline
    finally:
        executor.recorder = None
        events = recorder.events
        if group is not None:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, events, group=group)
            events = [e for part in gathered for e in part]
        timeline.events = sorted(events, key=lambda e: (e.start, e.rank))
