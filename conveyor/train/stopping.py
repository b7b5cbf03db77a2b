"""Stopping ``conveyor train`` cleanly: a signal ends the run after the step in flight,
at the same step on every rank."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from conveyor.distributed import collective
from conveyor.pipeline import Pipeline

__all__: list[str] = []


class StopSignals:
    """SIGINT and SIGTERM ask the training loop to stop after the step in flight.

    ``received`` is the number of the first such signal (0: none). A second Ctrl-C
    interrupts at once, without saving (the last periodic checkpoint stays).
    """

    def __init__(self) -> None:
        self.received = 0
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self.previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame: Any) -> None:
        if self.received and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or number

    def __exit__(self, *exc: object) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def agree(pipe: Pipeline, *values: int) -> tuple[int, ...]:
    """Each of ``values``, the largest over every process of the run."""
    if not dist.is_initialized():
        return values
    flags = torch.tensor(values, device=pipe.topology.device)  # set under torchrun
    # Between two steps: the ranks may come at different times (one saving), so the
    # wait is the opening one of a step.
    collective.all_reduce(flags, group=None, op=dist.ReduceOp.MAX, seconds=pipe.timeouts.opening,
                          what="the ranks' agreement to stop (a signal, the time limit)")
    return tuple(int(v) for v in flags.tolist())
