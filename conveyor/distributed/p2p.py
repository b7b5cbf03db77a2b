"""Moving activations and gradients between processes with point-to-point ops.

A message is a header of 24 int64s and a body; the header carries the shapes and
dtypes, so a later batch with another sequence length needs nothing special (the layout
is drawn below). Receives are posted in the order the sender sends, which the receiver
knows from the table (``Schedule.messages``: to the neighbour stages, and over the
table's edges straight to a later stage and back): no tags (NCCL has none). Every send
is counted in ``traffic``, with the bytes that left the process.

Waiting is what makes a pipeline slow. With gloo, data moves only once the receiver
has posted its receive, and a round trip to announce one costs 0.2-0.3 ms, several
under load; three per message cost a 2-stage step 15%. So each peer always has a
receive posted for its next message, and on gloo header and body travel as one
*envelope* into it (drawn in :mod:`conveyor.distributed.envelope`). NCCL needs exact
sizes (and overlaps on the GPU anyway): there the header goes first, then the body.
"""

from __future__ import annotations

import atexit
import datetime
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.distributed.envelope import (
    _ABORT,
    _BODY,
    _CODE,
    _CODES,
    _HEADER_BYTES,
    _INLINE,
    _KINDS,
    _MICROBATCH,
    _SOURCE,
    _STAGE,
    _STEP,
    _abort_summary,
    _assemble,
    _check_header,
    _decode,
    _encode,
    _encode_abort,
    _unpickle,
)
from conveyor.distributed.faults import peerfailure
from conveyor.distributed.faults.peerfailure import lost_peer, reported, timed_out, wait_failed
from conveyor.distributed.topology import Topology
from conveyor.distributed.watch import Watcher
from conveyor.engine.transport import Aborted, LocalTransport, MessageKind, Traffic, neighbour
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.engine.watchdog.liveness import keep_waiting
from conveyor.errors import ConveyorError, PeerFailure
from conveyor.schedules import Action, Schedule

__all__: list[str] = []

SETTLE = 5.0  # seconds a failed rank waits for its posted receives to be answered
FLUSH = 1.0  # seconds a failed rank waits for its abort reports to leave


@dataclass
class _Incoming:
    """The message being received from one peer: its posted buffer and what is known."""

    key: tuple[str, int, int, int]  # kind, source stage, stage, micro-batch
    buffer: torch.Tensor
    work: Any
    header: list[int] | None = None  # once the header has arrived and the body has not


class P2PTransport:
    """Delivery between the ranks of one pipeline over torch.distributed.

    Args:
        topology: this process's place; its pipeline group carries the messages.
        schedule: the table every rank runs: where each stage runs, and what each
            action sends (to its neighbours, and over the table's edges).
        devices: the device of each stage held here.
        deadlines: how long a wait may take: a peer's first message of a step (ranks
            may reach a step at different times), and any other.

    Every message carries its step: a failed step's messages still arrive and the next
    step drops them, so a pipeline can be called again after a failure every rank was
    told of. A peer gone silent (a timeout, a closed connection) breaks the transport.
    """

    def __init__(self, topology: Topology, schedule: Schedule,
                 devices: Mapping[int, torch.device], deadlines: Deadlines) -> None:
        self.topology = topology
        self.schedule = schedule
        self.stage_ranks = list(schedule.stage_ranks)
        self.deadlines = deadlines
        self.step = 0  # this rank's step, counted by prepare()
        self.broken: str | None = None  # why no further step can run
        #: ``locate_ranks(step)``: where each peer is (see whereabouts), None: no answer;
        #: ``announce(step, report)``: posts a failure where collectives look, first thing.
        self.locate_ranks: Callable[[int], dict[int, dict[str, Any] | None]] | None = None
        self.announce: Callable[[int, dict[str, Any]], None] | None = None
        self._heard: set[int] = set()  # peers whose messages of this step have come
        self.device = topology.device or torch.device("cpu")
        self.envelopes = dist.get_backend(topology.pipeline_group) == "gloo"
        # gloo cannot tell without waiting whether a receive has arrived: threads wait
        # for this rank, so that poll() between actions sees a peer's abort report.
        self._watcher = Watcher() if self.envelopes else None
        if self._watcher is not None:
            weakref.finalize(self, self._watcher.close)
        _transports.add(self)
        peerfailure.tell_peers_on_uncaught(self)
        self.traffic = Traffic()
        self.local = LocalTransport([devices.get(s, self.device)
                                     for s in range(len(self.stage_ranks))], self.traffic,
                                    deadlines)
        self._expected: dict[int, list[tuple[str, int, int, int]]] = {}
        self._position: dict[int, int] = {}
        self._incoming: dict[int, _Incoming] = {}
        self._capacity_in: dict[int, int] = {}  # per peer, kept from step to step
        self._capacity_out: dict[int, int] = {}
        self._peers: set[int] = set()
        self._stash: dict[tuple[str, int, int, int], Any] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._reports: list[Any] = []  # the sends of this rank's abort reports
        self._aborted = False

    # ------------------------------------------------------------ the table

    def prepare(self, columns: Mapping[int, Sequence[Action]]) -> None:
        """Learns from every rank's column the order in which each peer sends to us,
        and posts the receive of each peer's first message (a receive still posted by
        a failed step stays: the next message lands in it).

        Raises:
            ConveyorError: an earlier step lost a peer; the transport is broken.
        """
        if self.broken is not None:
            raise ConveyorError(self.broken)
        self.step += 1
        self._heard = set()
        me = self.topology.pipeline_rank
        self._expected = {}
        for rank, column in columns.items():
            incoming = [key for action in column
                        for key, destination in self._messages_of(action)
                        if destination == me and rank != me]
            if incoming:
                self._expected[rank] = incoming
        outgoing = {destination for action in columns.get(me, ())
                    for _, destination in self._messages_of(action)
                    if destination != me}
        self._peers = set(self._expected) | outgoing
        self._position = dict.fromkeys(self._expected, 0)
        posted, self._incoming = self._incoming, {}
        for peer in self._expected:
            if peer in posted:  # a failed step's receive: the peer's next message fills it
                self._incoming[peer] = posted.pop(peer)
                self._incoming[peer].key = self._expected[peer][0]
            else:
                self._post(peer)
        self._incoming.update(posted)  # from peers not heard from this step: drained

    def _messages_of(self, action: Action) -> list[tuple[tuple[str, int, int, int], int]]:
        """What ``action`` sends, in order, each with the pipeline rank it goes to."""
        return [((message.kind, message.source, message.destination, message.microbatch),
                 self.stage_ranks[message.destination])
                for message in self.schedule.messages(action)]

    def reset(self) -> None:
        self.local.reset()
        self._stash.clear()
        self._aborted, self._reports = False, []

    # ------------------------------------------------------------ sending

    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any, *,
             source: int | None = None) -> None:
        source = neighbour(kind, stage) if source is None else source
        destination = self.stage_ranks[stage]
        if destination == self.topology.pipeline_rank:
            self.local.send(kind, stage, microbatch, value, source=source)  # counts it
            return
        header, pieces = _encode(_CODES[kind], stage, microbatch, value, source)
        wire = self._send_message(destination, header, pieces)
        self.traffic.note(kind, source, stage, value, wire)

    def _send_message(self, destination: int, header: list[int], pieces: list[Any]) -> int:
        """Sends a message to pipeline rank ``destination``; returns the bytes sent."""
        peer = self.topology.global_rank(destination)
        header[_STEP] = self.step
        total = _HEADER_BYTES + header[_BODY]
        if self.envelopes:
            capacity = self._capacity_out.get(destination, _HEADER_BYTES)
            self._capacity_out[destination] = max(capacity, total)
            if total <= capacity:
                header[_INLINE] = 1
                self._isend(peer, _assemble(header, pieces, with_header=True,
                                            device=self.device))
                return total
        self._isend(peer, torch.tensor(header, dtype=torch.int64,
                                       device=self.device).view(torch.uint8))
        if header[_BODY]:
            self._isend(peer, _assemble(header, pieces, with_header=False, device=self.device))
        return total

    def _isend(self, peer: int, buffer: torch.Tensor) -> None:
        """Sends ``buffer`` to global rank ``peer`` without waiting; a closed connection
        (the peer exited) raises PeerFailure and breaks the transport."""
        try:
            work = dist.isend(buffer, peer, group=self.topology.pipeline_group)
        except RuntimeError as exc:  # gloo: "Connection closed by peer"
            failure, self.broken = lost_peer(exc, self.topology.pipeline_rank,
                                             self.topology.pipeline_ranks.index(peer),
                                             self.step, sending=True)
            raise failure from exc
        self._sends.append((work, buffer))
        self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]

    # ------------------------------------------------------------ receiving

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
        self._incoming[peer] = _Incoming(key, buffer, self._irecv(peer, buffer))

    def _irecv(self, peer: int, buffer: torch.Tensor) -> Any:
        """Posts a receive of ``buffer`` from ``peer``: its work, watched on gloo.

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
        return work if self._watcher is None else self._watcher.watch(peer, work)

    def poll(self) -> None:
        """Moves every incoming message on as far as it can without waiting.

        Raises:
            PeerFailure: a peer's abort report has arrived, from whichever peer: this
                rank stops before its next action, as a receive from that peer would.
        """
        for peer in list(self._incoming):
            self._advance(peer, wait=False)

    def _poll_after(self, what: str) -> None:
        """:meth:`poll`, once this rank has received ``what``: a failure it brings says so."""
        for peer in list(self._incoming):
            self._advance(peer, wait=False, stopped=f"stopped after receiving {what}")

    def recv(self, kind: MessageKind, stage: int, microbatch: int, *,
             source: int | None = None) -> Any:
        source_stage = neighbour(kind, stage) if source is None else source
        source = self.stage_ranks[source_stage]
        if source == self.topology.pipeline_rank:
            return self.local.recv(kind, stage, microbatch, source=source_stage)
        key = (kind, source_stage, stage, microbatch)
        what = f"the {kind} of micro-batch {microbatch} from stage {source_stage} (rank {source})"
        if key in self._stash:
            return self._stash.pop(key)
        while key not in self._stash:
            if source not in self._incoming:
                raise ConveyorError(f"rank {source} never sends {what} in this table")
            self._advance(source, wait=True, what=what)
        # While this rank waited for ``source``, another peer may have failed: stop now
        # rather than compute and send to a rank that is gone.
        self._poll_after(what)
        return self._stash.pop(key)

    def _advance(self, peer: int, *, wait: bool, what: str = "a message",
                 stopped: str | None = None) -> None:
        """Moves ``peer``'s message on; with ``wait``, until it has arrived whole.

        Without ``wait``, the body of an abort report whose header has arrived is still
        waited for: its sender sent it right behind the header, and the report is what
        this rank raises. ``stopped`` says, in that failure's message, where this rank
        stopped (by default waiting for ``what``, or before its next action).
        """
        stopped = stopped or (f"stopped waiting for {what}" if wait
                              else "stopped before its next action")
        asked, message = (wait, what), self._incoming.get(peer)
        while message is not None:
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
                raise reported(summary, self.topology.pipeline_rank, stopped)
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
                raise reported(report, self.topology.pipeline_rank, stopped)
            arrived = (_KINDS.get(header[_CODE], "?"), header[_SOURCE], header[_STAGE],
                       header[_MICROBATCH])
            if arrived != message.key:
                raise ConveyorError(f"expected {message.key} from rank {peer}, got "
                                    f"{arrived}: the ranks run different tables")
            self._stash[message.key] = _decode(header, body)
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

    # ------------------------------------------------------------ ending

    def abort_uncaught(self, error: BaseException) -> None:
        """The script raised ``error`` between steps: peers in the next step hear of it."""
        if not self._aborted and self.broken is None:
            self.step += 1
            self.abort(error, action="between steps")

    def abort(self, error: BaseException | None, action: str | None = None) -> None:
        """Tells every peer that sends to or receives from us that this rank stopped (in
        ``action``, by default the error's).

        On gloo it then waits (a few seconds at most) until every receive still posted
        has its answer, each peer's message or abort report, which comes within an
        action of that peer: no watcher thread may be left inside gloo at exit. A
        frozen peer never answers; that wait gives up.
        """
        self.local.abort(error)
        if self._aborted:
            return
        self._aborted = True
        report = getattr(error, "report", None)  # a failure elsewhere: pass it on as is
        if report is None:
            text = (f"{type(error).__name__}: {error}".splitlines()[0] if error is not None
                    else "interrupted")
            report = {"rank": self.topology.pipeline_rank, "error": text,
                      "stage": getattr(error, "stage", -1),
                      "microbatch": getattr(error, "microbatch", -1),
                      "action": action or getattr(error, "action", "?")}
        if self.announce is not None:
            self.announce(self.step, report)
        pending = {id(work) for work, _ in self._sends}
        for rank in sorted(self._peers):
            try:
                self._send_message(rank, *_encode_abort(report))
            except Exception:  # noqa: BLE001 - the peer may be gone; keep telling the rest
                pass
        self._reports = [work for work, _ in self._sends if id(work) not in pending]
        if self._watcher is not None:
            self._watcher.settle(min(self.deadlines.within, SETTLE))

    def finish(self) -> None:
        """Waits until every message this rank sent has been taken by its receiver."""
        for work, _ in self._sends:
            self._wait(work, "a peer to receive what this rank sent")
        self._sends = []


_transports: weakref.WeakSet[P2PTransport] = weakref.WeakSet()


@atexit.register
def _let_go_of_works() -> None:
    """Drops the gloo works (sends, posted receives) the transports still hold, before
    the process group is destroyed at exit (see ``watch._shut_down_cleanly``): a work
    freed while the interpreter shuts down aborts the process. First, for at most
    ``FLUSH`` seconds in all, lets the abort reports leave: a peer would otherwise see
    this rank's connection close, not why it stopped. (Not before exit: gloo sends
    only to a posted receive, and a send's wait that times out closes its connection.)"""
    deadline = time.monotonic() + FLUSH
    for work in [work for transport in list(_transports) for work in transport._reports]:
        try:
            work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        except Exception:  # noqa: BLE001 - its peer is gone or frozen: nothing more to do
            pass
    for transport in list(_transports):
        transport._reports = []
        transport._sends = []
        transport._incoming = {}
