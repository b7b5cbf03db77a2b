"""Receives waited for on watcher threads: what conveyor.distributed.watch promises.

A stand-in for gloo's work (a receive that finishes when the test says) keeps these
tests free of process groups; tests/test_distributed.py runs the real thing.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator

import pytest

from conveyor.distributed.watch import Watcher

FINISH = 5.0  # seconds a wait that should end may take


class Receive:
    """Looks like gloo's work: ``wait()`` blocks until the test finishes or fails it."""

    def __init__(self) -> None:
        self._arrived = threading.Event()
        self.error: BaseException | None = None
        self.threads: list[str] = []

    def wait(self) -> bool:
        self.threads.append(threading.current_thread().name)
        assert self._arrived.wait(FINISH), "the test never finished this receive"
        if self.error is not None:
            raise self.error
        return True

    def arrive(self, error: BaseException | None = None) -> None:
        self.error = error
        self._arrived.set()


@pytest.fixture
def watcher() -> Iterator[Watcher]:
    watcher = Watcher()
    yield watcher
    watcher.close()


def test_completion_is_read_without_waiting_once_the_thread_saw_it(watcher: Watcher) -> None:
    receive = Receive()
    watched = watcher.watch(1, receive)
    assert not watched.is_completed()
    receive.arrive()
    assert watched.done(FINISH)
    assert watched.is_completed()
    watched.wait(datetime.timedelta(seconds=FINISH))  # returns: it arrived
    assert receive.threads == ["conveyor-recv-from-1"]


def test_a_wait_times_out_saying_so_and_the_receive_stays_posted(watcher: Watcher) -> None:
    receive = Receive()
    watched = watcher.watch(0, receive)
    with pytest.raises(TimeoutError, match=r"^timed out after 0.05 s$"):
        watched.wait(datetime.timedelta(seconds=0.05))
    receive.arrive()
    watched.wait(datetime.timedelta(seconds=FINISH))


def test_a_failed_receive_raises_its_error_in_the_waiting_thread(watcher: Watcher) -> None:
    receive = Receive()
    watched = watcher.watch(2, receive)
    receive.arrive(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):
        watched.wait(datetime.timedelta(seconds=FINISH))
    assert watched.is_completed()


def test_a_peers_receives_are_waited_for_in_turn_by_one_thread(watcher: Watcher) -> None:
    first, second, other = Receive(), Receive(), Receive()
    watched = [watcher.watch(1, first), watcher.watch(1, second), watcher.watch(3, other)]
    second.arrive()
    other.arrive()
    assert watched[2].done(FINISH)
    assert not watched[1].done(0.05)  # behind the first, on the same thread
    first.arrive()
    assert watched[1].done(FINISH)
    assert first.threads == second.threads == ["conveyor-recv-from-1"]
    assert other.threads == ["conveyor-recv-from-3"]


def test_settle_waits_for_every_posted_receive(watcher: Watcher) -> None:
    assert watcher.settle(0.0)  # nothing posted
    done, pending = Receive(), Receive()
    watcher.watch(0, done)
    watcher.watch(1, pending)
    done.arrive()
    assert not watcher.settle(0.05)
    threading.Timer(0.05, pending.arrive).start()
    assert watcher.settle(FINISH)


def test_close_ends_the_threads(watcher: Watcher) -> None:
    receive = Receive()
    watcher.watch(4, receive)
    receive.arrive()
    [thread] = [t for t in threading.enumerate() if t.name == "conveyor-recv-from-4"]
    thread.join(0.05)
    assert thread.is_alive()  # idle, waiting for the next receive
    watcher.close()
    thread.join(FINISH)
    assert not thread.is_alive()
