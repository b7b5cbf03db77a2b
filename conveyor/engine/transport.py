"""Moving activations and gradients between stages.

A transport delivers a stage's output to the stage that consumes it, keyed by what it
is (activation or gradient), the receiving stage and the micro-batch, so that receives
match sends whatever order the ranks run in. What arrives is ready to use: detached
tensors on the receiving stage's device, each with the ``requires_grad`` flag its
sender's tensor had.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
import torch.utils._pytree as pytree

__all__: list[str] = []

MessageKind = Literal["activation", "gradient"]


class Aborted(Exception):
    """Raised in a waiting rank when another rank failed and the step is abandoned."""


class Transport(Protocol):
    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any) -> None:
        """Delivers ``value`` (a pytree) to ``stage`` for ``microbatch``."""

    def recv(self, kind: MessageKind, stage: int, microbatch: int) -> Any:
        """Waits for and returns what was sent to ``stage`` for ``microbatch``."""

    def abort(self, error: BaseException | None) -> None:
        """Stops the step: every waiting receive raises :class:`Aborted`.

        ``error`` (if any) is what went wrong here; a transport between processes
        passes it on to the ranks that wait for this one.
        """

    def reset(self) -> None:
        """Prepares for a new run after a finished or aborted one."""

    def finish(self) -> None:
        """Completes what the run still has in flight (sends) once its actions are done."""

    def poll(self) -> None:
        """Moves messages on without waiting (called before every action).

        Raises:
            Aborted: the step was aborted here (another thread's rank failed).
            PeerFailure: a peer's failure has arrived; this rank stops too.
        """


def deliver(tree: Any, device: torch.device, copy_streams: dict[Any, Any] | None = None) -> Any:
    """The tensors of ``tree`` detached, on ``device``, each with its ``requires_grad`` flag.

    A tensor already on ``device`` is not copied: the delivery shares its memory.
    """

    def move(t: torch.Tensor) -> torch.Tensor:
        out = _move(t.detach(), device, copy_streams)
        return out.requires_grad_() if t.requires_grad else out

    if isinstance(tree, torch.Tensor):
        return move(tree)
    return pytree.tree_map_only(torch.Tensor, move, tree)


def _move(t: torch.Tensor, device: torch.device, copy_streams: dict[Any, Any] | None) -> torch.Tensor:
    if t.device == device:
        return t
    if t.device.type == "cuda" and device.type == "cuda" and copy_streams is not None:
        # Copy on a side stream of the source device, so that the copy overlaps with
        # compute. The side stream first waits for the producer's work; the copy itself
        # makes the destination's current stream wait for it (a two-way barrier).
        key = (t.device, device)
        stream = copy_streams.get(key)
        if stream is None:
            stream = copy_streams[key] = torch.cuda.Stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            out = t.to(device, non_blocking=True)
        t.record_stream(stream)  # keep the source's memory until the copy is done
        return out
    # Device to host must block: the host would otherwise read before the copy lands.
    return t.to(device, non_blocking=device.type == "cuda")


class LocalTransport:
    """Mailboxes between threads of one process, one device per stage.

    Args:
        devices: ``devices[s]`` is the device of stage s; deliveries land there.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self._boxes: dict[tuple[str, int, int], Any] = {}
        self._ready = threading.Condition()
        self._aborted = False
        self._copy_streams: dict[Any, Any] = {}

    def reset(self) -> None:
        """Empties the mailboxes and clears an abort, before a new phase."""
        with self._ready:
            self._boxes.clear()
            self._aborted = False

    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any) -> None:
        with self._ready:
            self._boxes[(kind, stage, microbatch)] = value
            self._ready.notify_all()

    def recv(self, kind: MessageKind, stage: int, microbatch: int) -> Any:
        key = (kind, stage, microbatch)
        with self._ready:
            while key not in self._boxes:
                if self._aborted:
                    raise Aborted(f"stage {stage} stopped waiting for {kind} of "
                                  f"micro-batch {microbatch}")
                self._ready.wait()
            value = self._boxes.pop(key)
        return deliver(value, self.devices[stage], self._copy_streams)

    def abort(self, error: BaseException | None) -> None:
        with self._ready:
            self._aborted = True
            self._ready.notify_all()

    def finish(self) -> None:
        """Nothing is in flight between threads once every action has run."""

    def poll(self) -> None:
        """Raises :class:`Aborted` once the step is aborted, so that every rank stops
        before its next action (threads hand over messages directly: nothing to move).

        The executor calls this before every action: a plain read of the flag, without
        the lock. A rank that reads it just before another sets it runs one more action
        and stops at the next check, or at a receive, which reads it under the lock.
        """
        if self._aborted:
            raise Aborted("another rank failed; this rank stops before its next action")
