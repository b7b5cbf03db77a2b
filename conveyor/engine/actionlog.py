"""The executor's debug log: each action a rank runs, what it received and sent, how long.

Off by default. Turn it on with the ``conveyor`` logger (or this module's) at DEBUG::

    logging.getLogger("conveyor").setLevel(logging.DEBUG)

The executor asks :func:`enabled` once per run and takes a separate path when it is
on: while it is off, nothing of this module is built and an action costs one
``is None`` test more than before (as for the recorder). A run logs one line when it
starts, one when each action ends, and one when it ends::

    run F+B on ranks 0, 1: 8 actions
    rank 0 0F0 micro-batch 0: 0.412 ms, in [2, 6] float32, out [2, 16] float32
    rank 1 1F0 micro-batch 0: 0.380 ms, in [2, 16] float32
    ...
    run F+B done in 4.812 ms

"in" is what the action received from a neighbour stage (for stage 0's forward: its
micro-batch), "out" what it sent to one. Durations are wall-clock time on the rank's
thread, waiting for a neighbour's message included (``conveyor.record`` tells the two
apart); on a GPU they cover launching the work, not finishing it. The rank is the
pipeline rank (under torchrun, this process's).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from conveyor.engine.transport import MessageKind, Transport
from conveyor.schedules import Action, Kind
from conveyor.torchprivate import pytree

__all__: list[str] = []

logger = logging.getLogger(__name__)

_SHOWN_LEAVES = 4  # a message with more tensors is cut short: "..., 3 more"


def enabled() -> bool:
    """Whether the action log is on (the ``conveyor`` logger, or this one, at DEBUG)."""
    return logger.isEnabledFor(logging.DEBUG)


def describe(value: Any) -> str:
    """A short form of a message: ``[4, 128] float32`` per tensor, pytrees flattened."""
    leaves = pytree.tree_leaves(value)
    words = [_describe_leaf(leaf) for leaf in leaves[:_SHOWN_LEAVES]]
    if len(leaves) > _SHOWN_LEAVES:
        words.append(f"{len(leaves) - _SHOWN_LEAVES} more")
    return ", ".join(words) if words else "nothing"


def _describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{list(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
    return "None" if leaf is None else type(leaf).__name__


class _NotingTransport:
    """A transport that notes, per thread, what the current action received and sent."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.traffic = inner.traffic
        self._local = threading.local()

    def begin_action(self) -> None:
        self._local.received, self._local.sent = [], []

    def noted(self) -> tuple[list[Any], list[Any]]:
        """What this thread received and sent since :meth:`begin_action`."""
        return self._local.received, self._local.sent

    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any, *,
             source: int | None = None) -> None:
        self._local.sent.append(value)
        self.inner.send(kind, stage, microbatch, value, source=source)

    def recv(self, kind: MessageKind, stage: int, microbatch: int, *,
             source: int | None = None) -> Any:
        value = self.inner.recv(kind, stage, microbatch, source=source)
        self._local.received.append(value)
        return value

    def abort(self, error: BaseException | None) -> None:
        self.inner.abort(error)

    def reset(self) -> None:
        self.inner.reset()

    def finish(self) -> None:
        self.inner.finish()

    def poll(self) -> None:
        self.inner.poll()


class ActionLog:
    """The log of one executor run.

    Args:
        transport: the executor's transport; use :attr:`transport` in its place for
            the run, so that messages can be described.
        columns: the actions of each rank in this run.
        stage0_inputs: the micro-batches stage 0's forward takes (not received).
    """

    def __init__(self, transport: Transport, columns: Mapping[int, Sequence[Action]],
                 stage0_inputs: Sequence[Any]) -> None:
        self.transport = _NotingTransport(transport)
        self._columns = columns
        self._stage0_inputs = stage0_inputs

    @contextmanager
    def phase(self) -> Iterator[None]:
        """Logs the run's start, and its end with its duration (or its failure)."""
        kinds = "+".join(k.value for k in Kind
                         if any(a.kind is k for column in self._columns.values() for a in column))
        busy = [str(r) for r, column in self._columns.items() if column]
        count = sum(len(column) for column in self._columns.values())
        logger.debug("run %s on %s %s: %d actions", kinds or "-",
                     "rank" if len(busy) == 1 else "ranks", ", ".join(busy) or "-", count)
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            logger.debug("run %s failed after %.3f ms: %s", kinds or "-",
                         _ms_since(start), type(exc).__name__)
            raise
        logger.debug("run %s done in %.3f ms", kinds or "-", _ms_since(start))

    def action(self, rank: int, action: Action, execute: Callable[[], None]) -> None:
        """Runs one action by ``execute()`` and logs it."""
        self.transport.begin_action()
        start = time.perf_counter()
        try:
            execute()
        except BaseException as exc:
            logger.debug("rank %d %s micro-batch %d: failed after %.3f ms: %s", rank, action,
                         action.microbatch, _ms_since(start), type(exc).__name__)
            raise
        took = _ms_since(start)
        received, sent = self.transport.noted()
        if action.kind is Kind.FORWARD and action.stage == 0:
            received = [self._stage0_inputs[action.microbatch]]
        parts = [f"{took:.3f} ms"]
        parts += [f"in {describe(value)}" for value in received]
        parts += [f"out {describe(value)}" for value in sent]
        logger.debug("rank %d %s micro-batch %d: %s", rank, action, action.microbatch,
                     ", ".join(parts))


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
