"""The receiving half of the point-to-point transport: each peer's posted receive, and a
message moved on from it as far as it can go.

On NCCL, and on gloo for a peer whose messages are large, each peer always has a
receive posted for its next message (on gloo, data moves only once the receiver has
posted): its bytes move while the rank computes. On gloo a small message needed within
an action or two is received when the rank needs it, and waited for right there, timed
from a thread (:mod:`conveyor.distributed.longwaits`). What arrives is checked (its
header before its body is trusted with an allocation), dropped if a failed earlier step
sent it, raised if it is a peer's abort report, and otherwise kept until the action
that needs it::

    posted ── header arrived ── (body posted ── body arrived) ── stashed for recv()
                 │ an earlier step's: dropped, the next receive posted
                 └ an abort report: raised here, naming the rank that failed
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.distributed.envelope import (
    _ARRIVES,
    _ABORT,
    _BODY,
    _CODE,
    _HEADER_BYTES,
    _INLINE,
    _KINDS,
    _MICROBATCH,
    _SOURCE,
    _STAGE,
    _STEP,
    _abort_summary,
    _check_header,
    _decode,
    _unpickle,
)
from conveyor.distributed.faults.peerfailure import lost_peer, reported, timed_out, wait_failed
from conveyor.distributed.longwaits import NEEDED_SOON, RECEIVED_WHEN_NEEDED, LongWaits
from conveyor.distributed.topology import Topology
from conveyor.distributed.watch import Watched, Watcher
from conveyor.engine.transport import Aborted, LocalTransport, MessageKind, neighbour
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.engine.watchdog.liveness import keep_waiting
from conveyor.errors import ConveyorError, PeerFailure
from conveyor.schedules.replicas import StageReplicas

__all__: list[str] = []


@dataclass
class Incoming:
    """The message being received from one peer: its posted buffer and what is known."""

    key: tuple[str, int, int, int]  # kind, source stage, stage, micro-batch
    buffer: torch.Tensor
    work: Any  # None: posted when the rank comes to need it
    header: list[int] | None = None  # once the header has arrived and the body has not



class Receiving:
    """What :class:`~conveyor.distributed.p2p.P2PTransport` receives with (it sets what
    is declared here)."""

    topology: Topology
    stage_ranks: list[int]
    #: replicated stages: who runs what this step (None: the table's ranks)
    replicas: StageReplicas | None
    deadlines: Deadlines
    step: int
    broken: str | None
    device: torch.device
    envelopes: bool
    local: LocalTransport
    locate_ranks: Any
    _watcher: Watcher | None
    _long_waits: LongWaits | None  # gloo: the thread timing waits on the main thread
    _heard: set[int]
    _needed_at: dict[tuple[str, int, int], int]  # (kind, stage, micro-batch): its action
    _at: int  # the index of the action this rank is in (counted by poll)
    _expected: dict[int, list[tuple[str, int, int, int]]]
    _position: dict[int, int]
    _incoming: dict[int, Incoming]
    _capacity_in: dict[int, int]
    _stash: dict[tuple[str, int, int, int], Any]
    _arrives: dict[tuple[str, int, int, int], float]  # on emulated links: when, by key
    _aborted: bool
    boundary: Any  # a Crossing: what other stages' tensor groups sent, whole again

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The pipeline rank that runs ``stage`` on ``microbatch``."""
        if self.replicas is None:
            return self.stage_ranks[stage]
        return self.replicas.worker(stage, microbatch)

    def _post(self, peer: int, *, drain: bool = False) -> None:
        """Posts the receive of ``peer``'s next expected message, if any (``drain``:
        of the message that follows one of a failed step, whatever this step expects)."""
        position = self._position.get(peer, 0)
        expected = self._expected.get(peer, [])
        if position >= len(expected) and not drain:
            self._incoming.pop(peer, None)
            return
        key = expected[position] if position < len(expected) else ("drained", -1, -1, -1)
        size = self._capacity_in.get(peer, _HEADER_BYTES) if self.envelopes else _HEADER_BYTES
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        needed = self._needed_at.get((key[0], key[2], key[3]))  # (kind, stage, micro-batch)
        later = needed is None or needed - max(self._at, 0) > NEEDED_SOON
        self._incoming[peer] = Incoming(
            key, buffer, self._irecv(peer, buffer, ahead=later)
            if later or not self._when_needed(buffer) else None)

    def _when_needed(self, buffer: torch.Tensor) -> bool:
        """Whether a receive into ``buffer`` may be posted once the rank needs it, and
        waited for on the main thread (gloo, a small message)."""
        return self._long_waits is not None and buffer.numel() <= RECEIVED_WHEN_NEEDED

    def _irecv(self, peer: int, buffer: torch.Tensor, *, ahead: bool = False) -> Any:
        """Posts a receive of ``buffer`` from ``peer``: its work, watched on gloo unless
        the main thread waits for it itself (a small message, not posted ``ahead`` of
        the actions before it is needed).

        Raises:
            PeerFailure: the connection to ``peer`` is closed (it died, e.g. between
                two steps); the transport is broken from then on.
        """
        try:
            work = dist.irecv(buffer, self.topology.global_rank(peer),
                              group=self.topology.pipeline_group)
        except RuntimeError as exc:  # gloo: "Connection closed by peer"
            failure, self.broken = lost_peer(exc, self.topology.pipeline_rank, peer, self.step)
            raise failure from exc
        if self._watcher is None or (self._when_needed(buffer) and not ahead):
            return work
        return self._watcher.watch(peer, work)

    def poll(self) -> None:
        """Moves every incoming message on as far as it can without waiting.

        Raises:
            PeerFailure: a peer's abort report has arrived, from whichever peer, or a
                rank announced a failure in the step: this rank stops before its next
                action, as a receive from that peer would.
        """
        self._at += 1
        if self._long_waits is not None and self._long_waits.noticed is not None:
            raise reported(self._long_waits.noticed, self.topology.pipeline_rank,
                           "stopped before its next action")
        for peer, message in list(self._incoming.items()):
            if message.work is not None and message.work.is_completed():  # (else no move)
                self._advance(peer, wait=False)

    def _poll_after(self, what: str) -> None:
        """:meth:`poll`, once this rank has received ``what``: a failure it brings says so."""
        for peer, message in list(self._incoming.items()):
            if message.work is not None and message.work.is_completed():
                self._advance(peer, wait=False, stopped=f"stopped after receiving {what}")

    def recv(self, kind: MessageKind, stage: int, microbatch: int, *,
             source: int | None = None) -> Any:
        source_stage = neighbour(kind, stage) if source is None else source
        source = self.rank_of(source_stage, microbatch)
        if source == self.topology.pipeline_rank:
            return self.local.recv(kind, stage, microbatch, source=source_stage)
        key = (kind, source_stage, stage, microbatch)
        what = f"the {kind} of micro-batch {microbatch} from stage {source_stage} (rank {source})"
        if key not in self._stash:
            while key not in self._stash:
                if source not in self._incoming:
                    raise ConveyorError(f"rank {source} never sends {what} in this table")
                self._advance(source, wait=True, what=what)
            # While this rank waited for ``source``, another peer may have failed: stop
            # now rather than compute and send to a rank that is gone.
            self._poll_after(what)
        if self._arrives:  # sent over an emulated link: taken no earlier than it arrives
            time.sleep(max(0.0, self._arrives.pop(key, 0.0) - time.monotonic()))
        value = self._stash.pop(key)
        return value if self.boundary is None else self.boundary.join(value)

    def _advance(self, peer: int, *, wait: bool, what: str = "a message",
                 stopped: str | None = None) -> None:
        """Moves ``peer``'s message on; with ``wait``, until it has arrived whole.

        Without ``wait``, the body of an abort report whose header has arrived is still
        waited for: its sender sent it right behind the header, and the report is what
        this rank raises. ``stopped`` says, in that failure's message, where this rank
        stopped (by default waiting for ``what``, or before its next action).
        """
        asked, message = (wait, what), self._incoming.get(peer)
        while message is not None:
            if message.work is None:  # a receive posted when needed: now, if it is
                if not wait:
                    return
                message.work = self._irecv(peer, message.buffer)
            if not wait and not message.work.is_completed():
                return
            try:
                self._wait(message.work, what, peer)
            except PeerFailure as lost:
                if message.header is None or message.header[_CODE] != _ABORT:
                    raise
                # The failed rank exited before this one took its report's body.
                text = str(lost.__cause__ or lost).splitlines()[0]
                summary = _abort_summary(message.header, text)
                raise reported(summary, self.topology.pipeline_rank, stopped or _stopped(*asked))
            if message.header is None:
                header = message.buffer[:_HEADER_BYTES].view(torch.int64).tolist()
                _check_header(header)  # before trusting its body size with an allocation
                if not header[_INLINE] and header[_BODY]:
                    message.header = header  # the body follows in a message of its own
                    message.buffer = torch.empty(header[_BODY], dtype=torch.uint8,
                                                 device=self.device)
                    message.work = self._irecv(peer, message.buffer)
                    if header[_CODE] == _ABORT:
                        wait, what = True, f"the abort report of rank {peer}"
                    continue
                body = message.buffer[_HEADER_BYTES:]
            else:
                header, body = message.header, message.buffer
            self._capacity_in[peer] = max(self._capacity_in.get(peer, _HEADER_BYTES),
                                          _HEADER_BYTES + header[_BODY])
            if header[_STEP] < self.step:  # sent before an earlier step failed: drop it,
                self._post(peer, drain=True)  # and wait as asked (not for a report's body)
                message, (wait, what) = self._incoming.get(peer), asked
                continue
            if header[_CODE] == _ABORT:
                report = _unpickle(body[:header[_BODY]], f"the abort report of rank {peer}")
                raise reported(report, self.topology.pipeline_rank, stopped or _stopped(*asked))
            arrived = (_KINDS.get(header[_CODE], "?"), header[_SOURCE], header[_STAGE],
                       header[_MICROBATCH])
            if arrived != message.key:
                raise ConveyorError(f"expected {message.key} from rank {peer}, got "
                                    f"{arrived}: the ranks run different tables")
            self._stash[message.key] = _decode(header, body, checked=True)
            if header[_ARRIVES]:  # sent over an emulated link (a testing aid)
                self._arrives[message.key] = header[_ARRIVES] / 1e9
            self._heard.add(peer)
            self._position[peer] += 1
            self._post(peer)
            return

    def _wait(self, work: Any, what: str, peer: int | None = None) -> None:
        """Waits for ``work``: a receive from ``peer`` or a send (None), a step's timeout
        at a time while :func:`~conveyor.engine.watchdog.liveness.keep_waiting` says so
        (the pipeline makes progress; a peer not yet in the step). A send's wait, which
        on gloo closes its connection when it times out, is never taken up again.

        Raises:
            PeerFailure: the pipeline went silent, or the peer's connection closed; the
                transport is broken from then on.
        """
        if self._aborted:
            raise Aborted(what)
        if peer is not None and self._long_waits is not None and not isinstance(work, Watched):
            self._wait_here(work, what, peer)
            return
        waited, seen = 0.0, None
        try:
            while True:
                try:
                    work.wait(datetime.timedelta(seconds=self.deadlines.within))
                    return
                except Exception as exc:
                    waited += self.deadlines.within
                    if not timed_out(exc) or peer is None or self.locate_ranks is None:
                        raise
                    seen = keep_waiting(self.locate_ranks(self.step), peer, step=self.step,
                                        heard=peer in self._heard, waited=waited, seen=seen,
                                        deadlines=self.deadlines,
                                        progress=self._watcher is not None)
                    if seen is None:
                        raise
        except Exception as exc:  # gloo/nccl report timeouts and lost peers as RuntimeError
            failure, self.broken = wait_failed(exc, self.topology.pipeline_rank, peer, what,
                                               waited, self.step)
            raise failure from exc

    def _wait_here(self, work: Any, what: str, peer: int) -> None:
        """Waits in gloo for a receive from ``peer`` posted when needed, as long as the
        group allows; the thread of :mod:`~conveyor.distributed.longwaits` cuts the wait
        (closing the group's connections) once the pipeline goes silent.

        Raises:
            PeerFailure: as :meth:`_wait`.
        """
        if work.is_completed():  # waited for once (a failed step's): its message is in
            return
        waits = self._long_waits
        assert waits is not None
        waits.waiting(peer, self.topology.global_rank(peer), heard=peer in self._heard,
                      step=self.step, within=self.deadlines.within)
        started = time.monotonic()
        try:
            work.wait()  # no timeout: a wait that runs out closes the group's connections
        except Exception as exc:  # gloo reports timeouts and lost peers as RuntimeError
            if waits.cut:
                exc = TimeoutError(f"no message within {waits.waited:g} s")
            failure, self.broken = wait_failed(exc, self.topology.pipeline_rank, peer, what,
                                               waits.waited or time.monotonic() - started,
                                               self.step)
            raise failure from exc
        finally:
            waits.done()


def _stopped(wait: bool, what: str) -> str:
    """Where a rank stopped that was moving a message on (waiting for ``what``, or not)."""
    return f"stopped waiting for {what}" if wait else "stopped before its next action"
