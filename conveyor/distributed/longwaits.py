"""Receives waited for on the main thread itself, in gloo, and timed from a thread.

A small message's receive is posted when the rank comes to need it and waited for where
it is needed: on gloo, a receive posted ahead and waited for by a watcher thread
(:mod:`conveyor.distributed.watch`) costs every message the watcher's hop to the main
thread, and a 2-stage step of tiny layers 13% of its time (measured against this way,
both in one run). A wait in gloo cannot run out and go on, though: gloo closes every
connection of the group when one times out. So one thread per transport looks at the
main thread's wait a few times a second::

    main thread    posts irecv R ── R.wait() in gloo ......................... raises
    this thread    . . look . . look: past the deadline, no progress ── cuts it ─┘

* A wait past the step's deadline is weighed as a watched one is
  (:func:`~conveyor.engine.watchdog.liveness.keep_waiting`): while the pipeline makes
  progress it goes on, a deadline at a time. Otherwise this thread ends it, by timing out
  a wait of its own on the group, whose connections gloo then closes: the main thread's
  wait raises, and the rank raises the timeout, naming the peer (its transport refuses
  further steps, as after any wait that ran out).
* A failure a rank announced in the step (the store's notice, which every failing rank
  posts first) is noted, and the main thread raises it before its next action
  (:meth:`~conveyor.distributed.receiving.Receiving.poll`): a receive posted ahead
  would have brought the report of a peer it is not waiting for. A wait is not cut for
  a notice: the peer waited for sends its message or, stopping, its own report (cut,
  the group's connections would close under the peers that are still telling).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from conveyor.engine.watchdog.liveness import keep_waiting

__all__: list[str] = []

_log = logging.getLogger(__name__)

#: Seconds between two looks at the main thread's wait (and at the step's notice).
LOOK = 0.25
#: Messages of at most this many bytes (header included) are received when needed and
#: waited for on the main thread; a larger one keeps a receive posted ahead, watched, so
#: that its bytes move while the rank computes (64 KiB cross a loopback link in ~50 us).
RECEIVED_WHEN_NEEDED = 64 * 1024
#: ... and are needed within this many actions of the one in which the last came: a
#: receive needed later is posted ahead and watched, so that a peer's abort report lands
#: in it and the rank stops before its next action (as under GPipe, where stage 0 waits
#: for no message in its forwards). Three: zero-bubble's steady state (F, I and W of
#: each micro-batch) brings each kind of message every third action, and a watched
#: receive's hop to the main thread made its host-bound step 1.10-1.34x 1F1B's, against
#: 1.04-1.06x waited for inline (benchmarks/host_overhead.py's model, in one run).
NEEDED_SOON = 3
_CUT_TAG = 7919  # the tag of the receive whose timeout cuts the group's connections


@dataclass
class _Wait:
    """The main thread's wait now: for whom, since when, and what was seen of the ranks."""

    peer: int  # pipeline rank
    global_peer: int
    heard: bool  # the peer's messages of this step have come before
    step: int
    started: float = field(default_factory=time.monotonic)
    next_look: float = 0.0  # seconds into the wait at which the ranks are looked at
    seen: dict[int, int] | None = None


class LongWaits:
    """The thread that times one transport's waits on its main thread.

    Args:
        transport: the :class:`~conveyor.distributed.p2p.P2PTransport` (held weakly).

    Attributes:
        noticed: the failure a rank announced in the current step, once seen.
        cut: whether this thread ended the main thread's wait (it ran out, the pipeline
            silent).
        waited: the seconds the wait had taken when it was cut for its timeout.
    """

    def __init__(self, transport: Any) -> None:
        self._transport = weakref.ref(transport)
        self._waiting: _Wait | None = None
        self._in_step = False
        self.noticed: dict[str, Any] | None = None
        self.cut = False
        self.waited = 0.0
        self._cuts: list[Any] = []  # the works whose timeouts cut the group (kept till exit)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        _open.add(self)

    def step_begins(self) -> None:
        """A step starts: nothing noticed, nothing cut; looks at the notice from now on."""
        self.noticed, self.cut, self.waited, self._in_step = None, False, 0.0, True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="conveyor-long-waits")
            self._thread.start()

    def step_ends(self) -> None:
        self._in_step = False

    def waiting(self, peer: int, global_peer: int, *, heard: bool, step: int,
                within: float) -> None:
        """The main thread starts waiting in gloo for a message from ``peer``."""
        self._waiting = _Wait(peer, global_peer, heard, step, next_look=within)

    def done(self) -> None:
        """The main thread's wait is over."""
        self._waiting = None

    def close(self) -> None:
        """Ends the thread (within a look)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(LOOK + 2.0)

    def let_go(self) -> None:
        """Drops the works that cut the group (before the process group is destroyed)."""
        self._cuts = []

    def _run(self) -> None:
        while not self._closed.wait(LOOK):
            transport = self._transport()
            if transport is None:
                return
            try:
                self._look(transport)
            except Exception as exc:  # noqa: BLE001 - a look that fails is tried again
                _log.debug("a look at the main thread's wait failed: %s", exc)
            del transport

    def _look(self, transport: Any) -> None:
        if not self._in_step or transport._aborted:
            return
        if self.noticed is None and transport.notice is not None:
            report = transport.notice(transport.step)
            if report is not None and report.get("rank") != transport.topology.pipeline_rank:
                self.noticed = report
        wait = self._waiting
        if wait is None:
            return
        waited = time.monotonic() - wait.started
        if waited < wait.next_look:
            return
        deadlines = transport.deadlines
        seen = None if transport.locate_ranks is None else keep_waiting(
            transport.locate_ranks(wait.step), wait.peer, step=wait.step, heard=wait.heard,
            waited=waited, seen=wait.seen, deadlines=deadlines, progress=True)
        if seen is None:
            self.waited = waited
            self._cut(transport, wait)
        else:
            wait.seen, wait.next_look = seen, waited + deadlines.within

    def _cut(self, transport: Any, wait: _Wait) -> None:
        """Ends the main thread's wait: a receive of this thread's times out at once,
        and gloo closes the group's connections (the transport is broken from then on)."""
        if self._waiting is not wait:
            return  # the wait ended meanwhile
        self.cut = True
        work = dist.irecv(torch.empty(1, dtype=torch.uint8), wait.global_peer,
                          group=transport.topology.pipeline_group, tag=_CUT_TAG)
        if work is None:  # (this rank is not in the group: nothing to cut)
            return
        self._cuts.append(work)
        try:
            work.wait(datetime.timedelta(seconds=0.01))
        except Exception:  # noqa: BLE001 - the timeout is what closes the connections
            pass


_open: weakref.WeakSet[LongWaits] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Ends the threads before the interpreter does (one may be in a store call)."""
    for waits in list(_open):
        waits.close()
