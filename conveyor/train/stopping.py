"""Stopping ``conveyor train`` cleanly: a signal ends the run after the step in flight,
at the same step on every rank; a step whose gradients are not finite names its stages;
``kill -USR1`` shows where the ranks are."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from conveyor.distributed.faults import collective
from conveyor.observe.where import report_on_signal
from conveyor.pipeline import Pipeline

__all__: list[str] = []


class StopSignals:
    """SIGINT and SIGTERM ask the training loop to stop after the step in flight.

    ``received`` is the number of the first such signal (0: none). A second one (Ctrl-C
    again, or a scheduler's second SIGTERM) interrupts at once, without saving (the
    last periodic checkpoint stays).
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
        if self.received:  # a second signal: the step in flight does not end (stuck)
            raise KeyboardInterrupt
        self.received = number

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


@contextlib.contextmanager
def where_on_usr1(pipe: Pipeline) -> Iterator[None]:
    """``kill -USR1 <pid>`` prints where the ranks of this process are in their step."""
    if (not hasattr(signal, "SIGUSR1")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    previous = report_on_signal(pipe)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def stages_not_finite(pipe: Pipeline) -> list[int]:
    """The stages whose gradients hold a NaN or an infinity (under torchrun: every
    rank's, agreed)."""
    flags = torch.zeros(pipe.schedule.num_stages)
    for index, stage in pipe.runtime.stages.items():
        flags[index] = float(any(not bool(torch.isfinite(p.grad).all())
                                 for p in stage.trainable_parameters() if p.grad is not None))
    if dist.is_initialized():
        collective.all_reduce(flags, group=None, op=dist.ReduceOp.MAX,
                              seconds=pipe.timeouts.opening,
                              what="the agreement on the stages of a gradient not finite")
    return [index for index, flag in enumerate(flags.tolist()) if flag]
