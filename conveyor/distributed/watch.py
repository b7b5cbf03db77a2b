"""Gloo receives waited for on threads, so that an arrival can be checked without waiting.

Between actions a rank asks whether a message has come from any peer (an abort report,
above all), and must not wait to find out. NCCL's ``Work.is_completed()`` answers
that; gloo's stays False until someone calls ``wait()`` on the work, and a ``wait``
with a short timeout closes every connection of the group. So on gloo a
:class:`Watcher` keeps a thread per peer that waits on that peer's receives, one after
the other as they are posted, and marks each done: asking is then reading a flag::

    main thread     posts irecv R1 --watch--> . . . . . is_completed()? no . . yes: decode R1
    watcher thread                    R1.wait() ......... arrived: done.set()
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, NoReturn

__all__: list[str] = []


class Watched:
    """A posted receive that a watcher thread waits on, answering like the work itself.

    Args:
        work: what ``dist.irecv`` returned.
    """

    __slots__ = ("work", "_done", "_error")

    def __init__(self, work: Any) -> None:
        self.work = work
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        """Whether the receive has finished (arrived, or failed): a flag, no waiting."""
        return self._done.is_set()

    def done(self, timeout: float) -> bool:
        """Whether the receive finishes within ``timeout`` seconds (errors aside)."""
        return self._done.wait(max(0.0, timeout))

    def wait(self, timeout: datetime.timedelta) -> None:
        """Waits until the receive has finished.

        Raises:
            TimeoutError: it has not after ``timeout`` (the receive stays posted).
            RuntimeError: the receive failed (gloo's error, e.g. the peer is gone).
        """
        if not self._done.wait(timeout.total_seconds()):
            raise TimeoutError(f"timed out after {timeout.total_seconds():g} s")
        if self._error is not None:
            raise self._error

    def run(self) -> None:
        """Waits for the receive; called on the watcher thread. The work is let go once
        done: a gloo work still held when the interpreter shuts down frees its tensors
        too late, and the process aborts."""
        try:
            self.work.wait()  # no timeout here: the group's own applies
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
            self._error = exc
        finally:
            self.work = None
            self._done.set()


_watchers: weakref.WeakSet[Watcher] = weakref.WeakSet()


@atexit.register
def _shut_down_cleanly() -> None:
    """Ends the process group before the interpreter does, or ends the process now.

    A script that exits (on an error, above all) without ``destroy_process_group()``
    leaves gloo's threads holding finished work whose tensors are freed during the
    interpreter's shutdown, and the process aborts ("terminate called without an
    active exception", exit -6) after its error was printed. So the group is destroyed
    here, while the interpreter still runs, and gloo's threads are let finish
    (:func:`_let_gloo_workers_finish`; also after a script's own destroy). If a receive
    is still inside gloo (a peer froze or died), destroying would wait for it: the
    process ends at once instead, with the code its command returned
    (:func:`end_process_group`), else 1 if an error is on its way out (else 0), its
    output flushed.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:  # torch was never loaded: no group, no thread of gloo's
        return
    if _stuck_teardowns or (dist.is_available() and dist.is_initialized() and any(
            watcher.pending() for watcher in list(_watchers))):
        failed = getattr(sys, "last_value", None) is not None
        _end_now(_exit_code if _exit_code is not None else 1 if failed else 0)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the error that matters is printed
            pass
    _let_gloo_workers_finish()


#: Seconds between two looks at gloo's worker threads, and the most spent looking.
_WORKER_LOOK, _WORKER_WAIT = 0.005, 1.0


def _let_gloo_workers_finish() -> None:
    """Waits (a second at most) until no worker thread of a gloo group is runnable.

    Such a thread frees each collective it has run after waking the rank that waits
    on it, and the collective's tensors with it, which takes the interpreter's lock.
    Where the thread shares a core with the main thread (a process pinned to one, as
    under a launcher's CPU binding), it may get there only once the interpreter is
    finalizing, and the process aborts ("terminate called without an active
    exception") after the script has ended well, even after ``destroy_process_group``:
    a group that a pipeline still holds keeps its threads until the interpreter frees
    it. Sleeping lets them run; Linux only (read from ``/proc``), elsewhere nothing.
    """
    tasks = "/proc/self/task"
    try:
        workers = [task for task in os.listdir(tasks)
                   if _read(f"{tasks}/{task}/comm") == "pt_gloo_runloop"]
    except OSError:
        return
    if not workers:
        return
    deadline, quiet = time.monotonic() + _WORKER_WAIT, 0
    while quiet < 2 and time.monotonic() < deadline:  # two looks in a row, none runnable
        time.sleep(_WORKER_LOOK)
        running = any(_read(f"{tasks}/{task}/stat").rpartition(")")[2].split()[:1] == ["R"]
                      for task in workers)
        quiet = 0 if running else quiet + 1


def _read(path: str) -> str:
    """A ``/proc`` file's text, stripped; empty if it is gone (its thread ended)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def end_process_group(code: int, seconds: float = 10.0) -> None:
    """Destroys the process group, waiting at most ``seconds`` for it, on the way out
    of a command that exits with ``code``.

    After a fault, work may still be inside the backend (a collective a frozen rank
    never joined): destroying the group would wait for it as long as its timeout. Then
    the group is left to :func:`_shut_down_cleanly`, which ends the process at exit
    with ``code`` without waiting; otherwise it is destroyed on a thread, waited for
    ``seconds``."""
    import torch.distributed as dist

    global _exit_code, _group_ended
    _exit_code = code
    if not dist.is_available() or not dist.is_initialized():
        return
    _group_ended = True
    if any(watcher.pending() for watcher in list(_watchers)):
        return
    ending = threading.Thread(target=dist.destroy_process_group, daemon=True,
                              name="conveyor-teardown")
    ending.start()
    ending.join(seconds)
    if ending.is_alive():  # stuck inside the backend: end the process at exit
        _stuck_teardowns.append(ending)


_stuck_teardowns: list[threading.Thread] = []
_exit_code: int | None = None  # what the command ending the process returns, if known
_group_ended = False  # whether a command ended a process group in this process


def group_ran() -> bool:
    """Whether a command of this process ran a process group (ended by
    :func:`end_process_group`)."""
    return _group_ended


def exit_process(code: int) -> NoReturn:
    """Ends the process of a ``conveyor`` command with ``code``.

    After a command that ran a process group, the process ends without the interpreter's
    finalization (its output flushed, the group destroyed first): gloo's objects freed
    that late can abort the process ("terminate called without an active exception",
    exit -6) after the command has finished and said so. Otherwise, ``sys.exit``.
    """
    if _group_ended:
        _shut_down_cleanly()  # destroys the group, or ends the process if it is stuck
        _end_now(code)
    sys.exit(code)


def _end_now(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watcher:
    """One daemon thread per peer, waiting on that peer's receives in the order posted.

    A peer has one receive posted at a time (the next is posted once the last is
    decoded), so its thread is idle or waits on exactly the one posted.
    """

    def __init__(self) -> None:
        self._queues: dict[int, queue.SimpleQueue[Watched | None]] = {}
        self._last: dict[int, Watched] = {}
        _watchers.add(self)

    def pending(self) -> bool:
        """Whether a receive it watches has not finished (a thread waits inside gloo)."""
        return any(not watched.is_completed() for watched in list(self._last.values()))

    def watch(self, peer: int, work: Any) -> Watched:
        """``work``, a receive from ``peer``, watched from now on."""
        watched = Watched(work)
        pending = self._queues.get(peer)
        if pending is None:
            pending = self._queues[peer] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(pending,), daemon=True,
                             name=f"conveyor-recv-from-{peer}").start()
        pending.put(watched)
        self._last[peer] = watched
        return watched

    def settle(self, timeout: float) -> bool:
        """Waits, at most ``timeout`` seconds in all, until every receive posted so far
        has finished; whether they all have.

        A watcher thread must not be inside gloo's wait when the interpreter exits:
        a daemon thread that comes back from C++ then is ended by a forced unwind, and
        the process aborts ("terminate called without an active exception"). After a
        failure every peer answers a posted receive, with its message or its own abort
        report, so a failed rank settles before it lets its error go.
        """
        deadline = time.monotonic() + timeout
        for watched in list(self._last.values()):
            if not watched.is_completed() and not watched.done(deadline - time.monotonic()):
                return False
        return True

    def close(self) -> None:
        """Ends every thread once it is done with what it waits on."""
        for pending in self._queues.values():
            pending.put(None)
        self._queues.clear()
        self._last.clear()


def _serve(pending: queue.SimpleQueue[Watched | None]) -> None:
    while (watched := pending.get()) is not None:
        watched.run()
