"""Moving activations and gradients between processes with point-to-point ops.

A message is a header of 32 int64s and a body; the header carries the shapes and
dtypes, so a later batch with another sequence length needs nothing special (the layout
is drawn below). Receives are posted in the order the sender sends, which the receiver
knows from the table (``Schedule.messages``: to the neighbour stages, and over the
table's edges straight to a later stage and back): no tags (NCCL has none). Every send
is counted in ``traffic``, with the bytes that left the process.

Waiting is what makes a pipeline slow. With gloo, data moves only once the receiver
has posted its receive, and a round trip to announce one costs 0.2-0.3 ms, several
under load; three per message cost a 2-stage step 15%. So on gloo header and body travel
as one *envelope* (drawn in :mod:`conveyor.distributed.envelope`). A large message's
receive is posted ahead, for its bytes to move while the rank computes, and waited for
by a watcher thread; a small one's is posted when the rank needs it and waited for on
the main thread itself, timed by :mod:`conveyor.distributed.longwaits` (the watcher's
hop cost a 2-stage 1F1B step of tiny layers 13-20% of its time). NCCL needs exact sizes
(and overlaps on the GPU anyway): there each peer has a receive posted ahead, the header
first, then the body.
"""

from __future__ import annotations

import atexit
import datetime
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from conveyor.distributed.envelope import (
    _ARRIVES,
    _BODY,
    _CODES,
    _HEADER_BYTES,
    _INLINE,
    _STEP,
    _assemble,
    _encode,
    _encode_abort,
    header_bytes,
)
from conveyor.distributed.faults import peerfailure
from conveyor.distributed.faults.peerfailure import lost_peer
from conveyor.distributed.longwaits import LongWaits
from conveyor.distributed.receiving import Incoming, Receiving
from conveyor.distributed.topology import Topology
from conveyor.distributed.watch import Watched, Watcher
from conveyor.engine.transport import (LocalTransport, MessageKind, Traffic, emulated,
                                       neighbour)
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.errors import ConveyorError, PeerFailure
from conveyor.schedules import Action, Kind, Schedule

__all__: list[str] = []

SETTLE = 5.0  # seconds a failed rank waits for its posted receives to be answered
FLUSH = 1.0  # seconds a failed rank waits for its abort reports to leave


class Crossing(Protocol):
    """How a value crosses between two stages' tensor groups, rank t to rank t."""

    def cut(self, kind: str, source: int, stage: int, value: Any) -> Any:
        """What this rank sends of ``value``."""

    def join(self, value: Any) -> Any:
        """``value`` whole again, from what this rank received."""


class P2PTransport(Receiving):
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
        self.replicas = topology.replicas
        self.deadlines = deadlines
        self.step = 0  # this rank's step, counted by prepare()
        self.broken: str | None = None  # why no further step can run
        #: ``locate_ranks(step)``: where each peer is (see whereabouts), None: no answer;
        #: ``announce(step, report)``: posts a failure where collectives look, first thing;
        #: ``notice(step)``: the failure a rank posted so, if any.
        self.locate_ranks: Callable[[int], dict[int, dict[str, Any] | None]] | None = None
        self.announce: Callable[[int, dict[str, Any]], None] | None = None
        self.notice: Callable[[int], dict[str, Any] | None] | None = None
        self._heard: set[int] = set()  # peers whose messages of this step have come
        self._needed_at: dict[tuple[str, int, int], int] = {}
        self._at = -1
        self.device = topology.device or torch.device("cpu")
        self.envelopes = dist.get_backend(topology.pipeline_group) == "gloo"
        # gloo cannot tell without waiting whether a receive has arrived: threads wait
        # for this rank, so that poll() between actions sees a peer's abort report.
        # Small messages are received when needed and waited for on the main thread,
        # timed from a thread of their own (see longwaits).
        self._watcher = Watcher() if self.envelopes else None
        self._long_waits = LongWaits(self) if self.envelopes else None
        if self._watcher is not None:
            weakref.finalize(self, self._watcher.close)
        if self._long_waits is not None:
            weakref.finalize(self, self._long_waits.close)
        _transports.add(self)
        peerfailure.tell_peers_on_uncaught(self)
        self.traffic = Traffic()
        self.local = LocalTransport([devices.get(s, self.device)
                                     for s in range(len(self.stage_ranks))], self.traffic,
                                    deadlines)
        self._expected: dict[int, list[tuple[str, int, int, int]]] = {}
        #: the columns of the last :meth:`prepare` (the Runtime hands a phase's columns
        #: unchanged from step to step; replicated stages deal new ones every step)
        self._learned_from: Mapping[int, Sequence[Action]] | None = None
        self._position: dict[int, int] = {}
        self._incoming: dict[int, Incoming] = {}
        self._capacity_in: dict[int, int] = {}  # per peer, kept from step to step
        self._capacity_out: dict[int, int] = {}
        self._peers: set[int] = set()
        self._stash: dict[tuple[str, int, int, int], Any] = {}
        self._arrives: dict[tuple[str, int, int, int], float] = {}  # emulated links
        self._link_free: dict[int, float] = {}
        self._sends: list[tuple[Any, torch.Tensor, int]] = []  # work, bytes, global rank
        #: under tensor parallelism, how a value crosses to the same tensor rank of
        #: another stage (:class:`conveyor.tensor.boundary.Boundary`); None: whole
        self.boundary: Crossing | None = None
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
        if self._long_waits is not None:
            self._long_waits.step_begins()
        if columns is not self._learned_from:  # (a step of the same phase: as learned)
            self._learn(columns)
        self._position = dict.fromkeys(self._expected, 0)
        self._at = -1  # the action this rank is in: poll() comes before each
        posted, self._incoming = self._incoming, {}
        for peer in self._expected:
            if peer in posted:  # a failed step's receive: the peer's next message fills it
                self._incoming[peer] = posted.pop(peer)
                self._incoming[peer].key = self._expected[peer][0]
            else:
                self._post(peer)
        self._incoming.update(posted)  # from peers not heard from this step: drained

    def _learn(self, columns: Mapping[int, Sequence[Action]]) -> None:
        """What :meth:`prepare` learns from ``columns``: each peer's messages to this
        rank in order, the peers it talks to, where in its column each message is
        needed."""
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
        self._needed_at = needed_at(columns.get(me, ()))
        self._learned_from = columns

    def _messages_of(self, action: Action) -> list[tuple[tuple[str, int, int, int], int]]:
        """What ``action`` sends, in order, each with the pipeline rank it goes to."""
        return [((message.kind, message.source, message.destination, message.microbatch),
                 self.rank_of(message.destination, message.microbatch))
                for message in self.schedule.messages(action)]

    def reset(self) -> None:
        self.local.reset()
        self._stash.clear()
        self._arrives.clear()
        self._link_free.clear()
        self._aborted, self._reports = False, []

    # ------------------------------------------------------------ sending

    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any, *,
             source: int | None = None) -> None:
        source = neighbour(kind, stage) if source is None else source
        destination = self.rank_of(stage, microbatch)
        if destination == self.topology.pipeline_rank:
            self.local.send(kind, stage, microbatch, value, source=source)  # counts it
            return
        if self.boundary is not None:
            value = self.boundary.cut(kind, source, stage, value)
        header, pieces = _encode(_CODES[kind], stage, microbatch, value, source)
        links = emulated()
        if links is not None:  # a testing aid: the receiver takes it no earlier
            bandwidth, latency = links.link(self.topology.global_rank(
                self.topology.pipeline_rank), self.topology.global_rank(destination))
            leaves = max(time.monotonic(), self._link_free.get(destination, 0.0)) \
                + (_HEADER_BYTES + header[_BODY]) / bandwidth
            self._link_free[destination] = leaves
            header[_ARRIVES] = int((leaves + latency) * 1e9)
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
        self._isend(peer, header_bytes(header).to(self.device))
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
        self._sends.append((work, buffer, peer))
        if not self.envelopes:  # NCCL: let go of what has landed (gloo's sends tell only
            # once waited for, by finish())
            self._sends = [send for send in self._sends if not send[0].is_completed()]

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
        if self._long_waits is not None:
            self._long_waits.step_ends()
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
        pending = {id(work) for work, _, _ in self._sends}
        for rank in sorted(self._peers):
            try:
                self._send_message(rank, *_encode_abort(report))
            except Exception:  # noqa: BLE001 - the peer may be gone; keep telling the rest
                pass
        self._reports = [work for work, _, _ in self._sends if id(work) not in pending]
        if self._watcher is not None:
            self._watch_what_is_expected()
            self._watcher.settle(min(self.deadlines.within, SETTLE))

    def _watch_what_is_expected(self) -> None:
        """Posts (and watches) the receive of each peer's next expected message that
        waits to be posted when needed, and watches one posted that nobody waits for
        now: each peer's pending send (or its report) lands, as in a receive posted
        ahead, and no receive is left to no one in gloo (one already waited for, whose
        message this rank stopped on, is read again by the next step and dropped)."""
        assert self._watcher is not None
        if self.broken is not None:  # the group's connections are closed: nothing lands
            return
        for peer, message in self._incoming.items():
            if message.work is None:
                try:
                    message.work = self._watcher.watch(peer, self._irecv(peer, message.buffer))
                except PeerFailure:  # that peer is gone: the error that stopped us stands
                    continue
            elif not isinstance(message.work, Watched) and not message.work.is_completed():
                message.work = self._watcher.watch(peer, message.work)

    def finish(self) -> None:
        """Waits until every message this rank sent has been taken by its receiver."""
        ranks = self.topology.pipeline_ranks
        for work, _, peer in self._sends:
            self._wait(work, f"rank {ranks.index(peer)} to receive what this rank sent")
        self._sends = []
        if self._long_waits is not None:
            self._long_waits.step_ends()


def needed_at(column: Sequence[Action]) -> dict[tuple[str, int, int], int]:
    """Where in ``column`` each message it receives is needed: by (kind, receiving
    stage, micro-batch), the index of the action that takes it (a forward its
    activations, a backward or ``I`` its gradients)."""
    needed: dict[tuple[str, int, int], int] = {}
    for at, action in enumerate(column):
        kind = "activation" if action.kind is Kind.FORWARD else (
            "gradient" if action.kind in (Kind.BACKWARD, Kind.INPUT) else None)
        if kind is not None:
            needed.setdefault((kind, action.stage, action.microbatch), at)
    return needed


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
        if transport._long_waits is not None:
            transport._long_waits.let_go()
