"""Moving activations and gradients between stages.

A transport delivers a stage's output to the stage that consumes it, keyed by what it
is (activation or gradient), the sending stage, the receiving stage and the
micro-batch, so that receives match sends whatever order the ranks run in. The sender
is the receiver's neighbour unless said otherwise (an edge of the schedule: values sent
from stage i straight to stage j, and their gradients back). What arrives is ready to
use: detached tensors on the receiving stage's device, each with the ``requires_grad``
flag its sender's tensor had. Every transport counts what it sends in its
:class:`Traffic`, per (kind, source, destination): clear it before a step, read it after.

A testing aid: inside ``with emulated_links(bandwidth=1e8, latency=1e-4):`` the threads'
transport holds every message between two stages as a wire would: it leaves once the
messages sent before it on that link (source to destination) have, takes its bytes over
the bandwidth, and arrives a latency later. ``between=`` gives each link its own
(a cluster of levels: the devices of a node near, the nodes far). A pipeline of CPU threads then shows what a
slow interconnect does to a plan (``benchmarks/pipedream.py``). Between processes on
one machine (each in the block) the sender stamps each message with when it would
arrive, and the receiver takes it no earlier (:mod:`conveyor.distributed.p2p`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.engine.watchdog.liveness import progressed
from conveyor.errors import StepTimeout
from conveyor.torchprivate import pytree

__all__: list[str] = []

MessageKind = Literal["activation", "gradient"]


@dataclass(frozen=True)
class EmulatedLinks:
    """Every link between two stages: ``bandwidth`` bytes per second each way, and
    ``latency`` seconds added to each message; or, where ``between`` is given, the
    (bandwidth, latency) it says for the link from one to the other (stages on threads,
    global ranks between processes)."""

    bandwidth: float
    latency: float = 0.0
    between: Callable[[int, int], tuple[float, float]] | None = None

    def link(self, source: int, destination: int) -> tuple[float, float]:
        """(bandwidth, latency) of the link from ``source`` to ``destination``."""
        if self.between is None:
            return self.bandwidth, self.latency
        bandwidth, latency = self.between(source, destination)
        if bandwidth <= 0 or latency < 0:
            raise ValueError(f"emulated link {source}->{destination} needs bandwidth > 0 "
                             f"and latency >= 0; got bandwidth={bandwidth}, "
                             f"latency={latency}")
        return bandwidth, latency


_emulated: list[EmulatedLinks] = []  # the innermost emulated_links() in force, last


@contextlib.contextmanager
def emulated_links(*, bandwidth: float = 0.0, latency: float = 0.0,
                   between: Callable[[int, int], tuple[float, float]] | None = None
                   ) -> Iterator[EmulatedLinks]:
    """Within the block, threads' transports deliver messages between stages as over
    links of ``bandwidth`` bytes per second and ``latency`` seconds, or over the link
    ``between(source, destination)`` gives as (bandwidth, latency) (a testing aid)."""
    if between is None and (bandwidth <= 0 or latency < 0):
        raise ValueError(f"emulated_links needs bandwidth > 0 and latency >= 0 (or "
                         f"between=); got bandwidth={bandwidth}, latency={latency}")
    links = EmulatedLinks(bandwidth, latency, between)
    _emulated.append(links)
    try:
        yield links
    finally:
        _emulated.remove(links)


def emulated() -> EmulatedLinks | None:
    """The emulated links in force in this process (None: real ones)."""
    return _emulated[-1] if _emulated else None


def _on_its_way(arrives: Mapping[Any, float], key: Any) -> bool:
    """Whether the message ``key``, on an emulated link, has yet to arrive."""
    return arrives.get(key, 0.0) > time.monotonic()


class Aborted(Exception):
    """Raised in a waiting rank when another rank failed and the step is abandoned."""


def neighbour(kind: MessageKind, stage: int) -> int:
    """The stage that sends ``stage`` a message of ``kind`` when no source is named: the
    one before it for an activation, the one after it for a gradient."""
    return stage - 1 if kind == "activation" else stage + 1


@dataclass
class Flow:
    """What went from one stage to another, of one kind, since the traffic was cleared.

    Attributes:
        messages: how many messages.
        bytes: the bytes of their tensors.
        wire: the bytes that left the process (headers, padding and pickled structure
            included); 0 for messages delivered within it.
    """

    messages: int = 0
    bytes: int = 0
    wire: int = 0


class Traffic:
    """What a transport sent, per (kind, source stage, destination stage).

    Counters, not a log: they stay small however long a run is. Clear them before a
    step and read them after, e.g. ``traffic.bytes`` or ``traffic.flows``.
    """

    def __init__(self) -> None:
        self.flows: dict[tuple[str, int, int], Flow] = {}
        self._lock = threading.Lock()

    def note(self, kind: str, source: int, destination: int, value: Any, wire: int = 0) -> None:
        """Counts one message of ``value`` (a pytree); ``wire`` bytes left the process."""
        size = _tensor_bytes(value)
        with self._lock:
            flow = self.flows.setdefault((kind, source, destination), Flow())
            flow.messages += 1
            flow.bytes += size
            flow.wire += wire

    def clear(self) -> None:
        with self._lock:
            self.flows.clear()

    @property
    def bytes(self) -> int:
        """The bytes of every tensor sent."""
        return sum(flow.bytes for flow in self.flows.values())

    @property
    def wire(self) -> int:
        """The bytes that left the process."""
        return sum(flow.wire for flow in self.flows.values())

    @property
    def messages(self) -> int:
        return sum(flow.messages for flow in self.flows.values())

    def between(self, source: int, destination: int, kind: str = "activation") -> Flow:
        """What went from stage ``source`` to ``destination`` (nothing: an empty Flow)."""
        return self.flows.get((kind, source, destination), Flow())


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value``: a tensor, or lists, tuples and dicts of
    them (what stages send; cheaper than flattening a pytree at every message)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


class Transport(Protocol):
    traffic: Traffic

    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any, *,
             source: int | None = None) -> None:
        """Delivers ``value`` (a pytree) to ``stage`` for ``microbatch``, from ``source``
        (by default the neighbour that sends ``kind``)."""

    def recv(self, kind: MessageKind, stage: int, microbatch: int, *,
             source: int | None = None) -> Any:
        """Waits for and returns what ``source`` (by default the neighbour that sends
        ``kind``) sent to ``stage`` for ``microbatch``."""

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
        traffic: where sends are counted (by default a Traffic of its own).
    """

    def __init__(self, devices: Sequence[torch.device], traffic: Traffic | None = None,
                 deadlines: Deadlines | None = None) -> None:
        self.devices = list(devices)
        self.traffic = traffic if traffic is not None else Traffic()
        self.deadlines = deadlines if deadlines is not None else Deadlines(None)
        self._boxes: dict[tuple[str, int, int, int], Any] = {}
        self._arrives: dict[tuple[str, int, int, int], float] = {}  # emulated links
        self._link_free: dict[tuple[int, int], float] = {}
        self._ready = threading.Condition()
        self._aborted = False
        self._copy_streams: dict[Any, Any] = {}
        #: every rank's position (plain data), to tell a slow pipeline from a stuck one
        #: when a receive runs out of time (see :mod:`conveyor.engine.watchdog.liveness`)
        self.liveness: Callable[[], Mapping[int, dict[str, Any] | None]] | None = None

    def reset(self) -> None:
        """Empties the mailboxes and clears an abort, before a new phase."""
        with self._ready:
            self._boxes.clear()
            self._arrives.clear()
            self._link_free.clear()
            self._aborted = False

    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any, *,
             source: int | None = None) -> None:
        source = neighbour(kind, stage) if source is None else source
        self.traffic.note(kind, source, stage, value)
        key = (kind, source, stage, microbatch)
        with self._ready:
            links = emulated()
            if links is not None and source != stage:
                bandwidth, latency = links.link(source, stage)
                leaves = max(time.monotonic(), self._link_free.get((source, stage), 0.0)) \
                    + _tensor_bytes(value) / bandwidth
                self._link_free[(source, stage)] = leaves
                self._arrives[key] = leaves + latency
            self._boxes[key] = value
            self._ready.notify_all()

    def recv(self, kind: MessageKind, stage: int, microbatch: int, *,
             source: int | None = None) -> Any:
        source = neighbour(kind, stage) if source is None else source
        key = (kind, source, stage, microbatch)
        timeout = self.deadlines.within
        start = time.monotonic()
        deadline = start + timeout
        seen: dict[int, int] | None = None  # actions done by each rank at the last look
        with self._ready:
            while key not in self._boxes or (self._arrives and _on_its_way(self._arrives, key)):
                if key in self._boxes:  # on an emulated link, still on its way
                    self._ready.wait(self._arrives[key] - time.monotonic())
                    continue
                if self._aborted:
                    raise Aborted(f"stage {stage} stopped waiting for {kind} of "
                                  f"micro-batch {microbatch} from stage {source}")
                left = deadline - time.monotonic()
                if left <= 0 and self.liveness is not None:
                    alive, seen = progressed(self.liveness(), seen, timeout)
                    if alive:  # a slow stage, not a stuck one: wait another timeout
                        deadline, left = time.monotonic() + timeout, timeout
                if left <= 0:
                    raise StepTimeout(
                        f"stage {stage} waited {time.monotonic() - start:.3g} s for the "
                        f"{kind} of micro-batch {microbatch} from stage {source}, which never "
                        f"came, and no stage made progress for {timeout:g} s: stage {source} "
                        "is stuck (or an action takes longer than the timeout: raise "
                        "timeout=)", stage=stage, microbatch=microbatch, action="recv")
                self._ready.wait(left)
            value = self._boxes.pop(key)
            if self._arrives:
                self._arrives.pop(key, None)
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
