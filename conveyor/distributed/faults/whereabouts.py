"""Where every rank of a pipeline stands, gathered when a step fails under torchrun.

A failed rank cannot count on its peers' connections (one may be dead, or frozen), so
positions travel through the job's key-value store (torchrun's, or the one the process
group was started with), which outlives any rank but the one that hosts it::

    failing rank   publish own position ── ask "step 7?" ── read the others' keys ── report
    other ranks    (failing too: the same) ──────────────── ...
    a rank stuck   its answering thread sees "step 7?" within 0.5 s: publishes its position
    in a layer
    frozen / dead  nothing: named as such in the report

A rank that waits for a peer's first message of a step asks the same way whether the
peer has reached the step (:meth:`Whereabouts.locate`): a peer still busy between steps
(saving, evaluating) gets the opening timeout, one in the step the shorter one.

A failing rank also posts its failure (rank, stage, action, micro-batch, error) as the
step's *notice* before anything else (:meth:`Whereabouts.announce`): a rank waiting in
a collective reads it (:meth:`Whereabouts.notice`) and names the origin, even when the
failed rank was the store's host and is gone a moment later.

Every store call is bounded (:mod:`conveyor.distributed.faults.store`): a frozen host (rank 0
under env://) costs a gather its few seconds, not the group's 30 minutes, and the
report then names the host as the rank that did not answer.

Every surviving rank prints the merged report in its error; rank 0's is the one to read.
A rank's answering thread wakes twice a second and reads two counters from the store.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from conveyor.distributed.faults.store import BoundedStore, StoreGone, StoreSilent, host

__all__: list[str] = []

_POLL = 0.5  # seconds between two looks of the answering thread
_ANSWER = 2 * _POLL + 0.5  # seconds an answer may take
_created = 0  # pipelines made in this process: every rank makes them in the same order


class Whereabouts:
    """One pipeline's corner of the store: its ranks' positions per step.

    Args:
        rank: this process's pipeline rank.
        ranks: the pipeline's size.
        replica: this pipeline's data-parallel index (each replica has its own keys).
        snapshot: this rank's position now (plain data), or None outside a step.
    """

    def __init__(self, rank: int, ranks: int, replica: int,
                 snapshot: Callable[[], dict[str, Any] | None]) -> None:
        global _created
        _created += 1
        _open.add(self)
        self.rank, self.ranks = rank, ranks
        self.prefix = f"conveyor/where/{_created}/{replica}"
        # Weakly: the answering thread must not keep the pipeline (its stages) alive.
        self._snapshot = weakref.WeakMethod(snapshot)  # type: ignore[arg-type]
        self.store = BoundedStore()
        self.store_trouble: str | None = None  # why the store could not be used
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        """Starts the thread that answers when the others ask (once)."""
        if self._thread is None and self.store.available:
            self._thread = threading.Thread(target=self._answer, daemon=True,
                                            name="conveyor-whereabouts")
            self._thread.start()

    def close(self) -> None:
        """Ends the answering thread (within a look at the store)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(_POLL + 1.0)

    def snapshot(self) -> dict[str, Any] | None:
        """This rank's position now (None outside a step, or once the pipeline is gone)."""
        method = self._snapshot()
        return None if method is None else method()

    def gather(self, step: int, seconds: float, known_silent: set[int]) -> dict[int, Any]:
        """Every rank's position in ``step``: publishes this rank's, asks the others,
        and waits at most ``seconds`` for them (for those ``known_silent`` as long as
        their answering thread takes: a rank stuck in a Python loop still answers).

        Returns:
            Per pipeline rank, its snapshot; None for a rank that did not answer (and
            for every other rank if the store cannot be reached).
        """
        found: dict[int, Any] = dict.fromkeys(range(self.ranks))
        found[self.rank] = self.snapshot()
        if not self.store.available:
            return found
        try:
            self.store.set(f"{self.prefix}/{step}/{self.rank}", json.dumps(found[self.rank]))
            others = [r for r in range(self.ranks) if r != self.rank]
            found.update(self._ask(step, others, seconds, known_silent))
        except (StoreSilent, StoreGone) as exc:  # its host froze or died: what is known
            self.store_trouble = str(exc)
        return found

    def announce(self, step: int, report: dict[str, Any]) -> None:
        """Posts ``report``, this rank's failure in ``step`` (or the one it passes on: a
        peer's, or a peer's closed connection), as the step's notice, where ranks waiting
        in a collective look (bounded: a silent store is given up)."""
        key = f"{self.prefix}/{step}/notice"
        if not self.store.available or report.get("silent") == "timeout":
            return  # a timeout may be this rank's own slowness: not the step's cause
        try:  # a closed connection (a dead rank), unless a rank already said more
            if not report.get("silent") or not self.store.check([key]):
                self.store.set(key, json.dumps(report))
        except (StoreSilent, StoreGone) as exc:
            self.store_trouble = str(exc)

    def notice(self, step: int) -> dict[str, Any] | None:
        """The failure a rank announced in ``step``, if any (None also when the store
        cannot be reached)."""
        key = f"{self.prefix}/{step}/notice"
        try:
            if self.store.available and self.store.check([key]):
                report: dict[str, Any] = json.loads(self.store.get(key))
                return report
        except (StoreSilent, StoreGone) as exc:
            self.store_trouble = str(exc)
        return None

    def store_host(self) -> int | None:
        """The global rank whose process hosts the store, if one does (env://)."""
        return host()

    def locate(self, step: int) -> dict[int, dict[str, Any] | None]:
        """Where every other rank of the pipeline is, asked while this rank waits in
        ``step``; None for one that does not answer within its answering thread's time
        (frozen, dead, or stuck outside Python), for all if the store cannot be reached."""
        others = [rank for rank in range(self.ranks) if rank != self.rank]
        if not self.store.available:
            return dict.fromkeys(others)
        try:
            return self._ask(step, others, _ANSWER, set())
        except (StoreSilent, StoreGone) as exc:  # no store: nobody can tell
            self.store_trouble = str(exc)
            return dict.fromkeys(others)

    def _ask(self, step: int, ranks: list[int], seconds: float,
             known_silent: set[int]) -> dict[int, Any]:
        """Asks ``ranks`` where they are in ``step`` and waits for their answers, or for
        the place they published on failing (at most ``seconds``; ``_ANSWER`` for those
        ``known_silent``)."""
        asked = self.store.add(f"{self.prefix}/{step}/asks", 1)
        found: dict[int, Any] = dict.fromkeys(ranks)
        start = time.monotonic()
        while True:
            for rank in ranks:
                for key in (f"{self.prefix}/{step}/{rank}", f"{self.prefix}/{step}/{rank}/{asked}"):
                    if found[rank] is None and self.store.check([key]):
                        found[rank] = json.loads(self.store.get(key))
            waited = time.monotonic() - start
            waiting = [r for r, s in found.items() if s is None and (
                waited < min(seconds, _ANSWER) or r not in known_silent)]
            if not waiting or waited > seconds:
                return found
            time.sleep(0.05)

    def _answer(self) -> None:
        """The answering thread: twice a second, reads how often this rank's current
        step and the next were asked about, and answers each new ask with its place."""
        answered: dict[int, int] = {}
        while not self._closed.wait(_POLL):
            if self._snapshot() is None:
                return  # the pipeline is gone
            snapshot = self.snapshot()
            if snapshot is None:
                continue
            try:
                for step in (snapshot["step"], snapshot["step"] + 1):  # the next: between steps
                    asks = self.store.add(f"{self.prefix}/{step}/asks", 0)
                    for ask in range(answered.get(step, 0) + 1, asks + 1):
                        self.store.set(f"{self.prefix}/{step}/{self.rank}/{ask}",
                                       json.dumps(snapshot))
                    answered[step] = asks
            except (StoreSilent, StoreGone):  # no store any more: nobody to answer
                return


_open: weakref.WeakSet[Whereabouts] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Ends the answering threads before the interpreter does: a thread that comes
    back from a store call while the interpreter shuts down aborts the process
    ("terminate called without an active exception")."""
    for whereabouts in list(_open):
        whereabouts.close()
