"""The job's key-value store, each call waited for at most a few seconds.

Reports, whereabouts, the agreement and the failure notice travel through the c10d
store of the default process group. Its host is torchrun's agent, or, in a job
launched by hand with env:// (``srun``, ``MASTER_ADDR`` pointing at rank 0), rank 0's
own process: a host that is frozen (SIGSTOP, a debugger) answers no call, and torch's
calls then wait as long as the group's timeout, 30 minutes by default; a timeout set
on the store does not bound them (measured on torch 2.13: ``add`` and ``check`` wait on
a frozen host whatever it is). So every call here runs on one thread of the store's
own and the caller waits for it at most ``seconds``::

    caller          call(add, 2 s) ── waits on the result ── 2 s: StoreSilent, the store
    store thread    ── store.add(...) ── stuck in the host's socket   is silent from now on
    later callers   StoreSilent at once (the thread is still stuck: nothing queues up)

A host that died answers with an error at once (StoreGone). Either error names the host
(:func:`host`) so that a survivor can say which rank it lost.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


from conveyor.torchprivate import default_store

__all__: list[str] = []

SECONDS = 3.0  # the most a store call may take


#: What a call raises when the store's host does not answer in time (frozen, overloaded),
#: and when it closed the connection or cannot be reached (it died): built-in errors.
StoreSilent = TimeoutError
StoreGone = ConnectionError


def host() -> int | None:
    """The global rank whose process hosts the job's store: 0 in a job launched by hand
    with env:// (torch's rendezvous makes rank 0 the server), None under torchrun (its
    agent hosts it) or with a file store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return 0
    return None


_outliving = False  # whether outlive_peers_at_exit has registered its wait


def outlive_peers_at_exit(seconds: float) -> None:
    """Keeps this process, which hosts the job's store and saw a step fail, alive
    ``seconds`` more at exit: the other ranks read the failure's notice and gather
    their report through the store, and would otherwise find it gone and name this
    rank as the one that failed."""
    global _outliving
    if not _outliving:
        _outliving = True
        atexit.register(time.sleep, seconds)


def describe_host() -> str:
    """The store's host, in words."""
    rank = host()
    if rank is not None:
        return f"rank {rank}, whose process hosts the job's store,"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "the torchrun agent that hosts the job's store"
    return "the job's store"


class BoundedStore:
    """The default process group's store (None: it has none), every call bounded.

    Args:
        store: the store to call (by default the default process group's).
    """

    def __init__(self, store: Any = None) -> None:
        self.store = _default_store() if store is None else store
        self.silent: str | None = None  # why no call is made any more
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], _Result] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        _stores.append(self)

    @property
    def available(self) -> bool:
        return self.store is not None

    def set(self, key: str, value: str | bytes, seconds: float = SECONDS) -> None:
        self.call(lambda: self.store.set(key, value), "set", seconds)

    def add(self, key: str, amount: int, seconds: float = SECONDS) -> int:
        return int(self.call(lambda: self.store.add(key, amount), "add", seconds))

    def check(self, keys: list[str], seconds: float = SECONDS) -> bool:
        return bool(self.call(lambda: self.store.check(keys), "check", seconds))

    def get(self, key: str, seconds: float = SECONDS) -> bytes:
        value: bytes = self.call(lambda: self.store.get(key), "get", seconds)
        return value

    def call(self, function: Callable[[], Any], what: str, seconds: float) -> Any:
        """``function()`` (a call of the store) on the store's thread, waited for at most
        ``seconds``.

        Raises:
            StoreSilent: no answer in time (now or before: the store is given up).
            StoreGone: the host closed the connection, or there is no store.
        """
        if self.store is None:
            raise StoreGone("this job has no store (no default process group)")
        if self.silent is not None:
            raise StoreSilent(self.silent)
        result = _Result()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="conveyor-store")
                self._thread.start()
            self._calls.put((function, result))
        if not result.done.wait(max(seconds, 0.0)):
            self.silent = (f"{describe_host()} did not answer a call ({what}) within "
                           f"{seconds:g} s: frozen, overloaded or stuck")
            raise StoreSilent(self.silent)
        if result.error is not None:
            said = str(result.error).splitlines()[0] if str(result.error) else ""
            raise StoreGone(f"{describe_host()} is gone ({what}: "
                            f"{said or type(result.error).__name__}): the process died"
                            ) from result.error
        return result.value

    def pending(self) -> bool:
        """Whether a call is still inside the store (its host never answered)."""
        return self.silent is not None

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            function, result = item
            try:
                result.value = function()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result.error = exc
            result.done.set()

    def close(self) -> None:
        """Ends the store's thread once it is done with its call."""
        self._calls.put(None)


class _Result:
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


_stores: list[BoundedStore] = []


@atexit.register
def _exit_past_a_stuck_call() -> None:
    """A call still inside the store when the interpreter exits would come back (once
    the frozen host is killed) into a finalized interpreter and abort the process: end
    it now, with 1: the job lost its store's host, whatever this process did since."""
    if any(store.pending() for store in _stores):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    for store in _stores:
        store.close()


def _default_store() -> Any:
    """The store of the default process group (None if it has none)."""
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - a private helper of torch: do without it
        return None
