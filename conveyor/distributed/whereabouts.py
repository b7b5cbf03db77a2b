"""Where every rank of a pipeline stands, gathered when a step fails under torchrun.

A failed rank cannot count on its peers' connections (one may be dead, or frozen), so
positions travel through the job's key-value store (torchrun's, or the one the process
group was started with), which outlives any rank but the one that hosts it::

    failing rank   publish own position ── ask "step 7?" ── read the others' keys ── report
    other ranks    (failing too: the same) ──────────────── ...
    a rank stuck   its answering thread sees "step 7?" within 0.5 s: publishes its position
    in a layer
    frozen / dead  nothing: named as such in the report

Every surviving rank prints the merged report in its error; rank 0's is the one to read.
A rank's answering thread wakes twice a second during its steps and reads one key.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__: list[str] = []

_POLL = 0.5  # seconds between two looks of the answering thread
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
        self.rank, self.ranks = rank, ranks
        self.prefix = f"conveyor/where/{_created}/{replica}"
        # Weakly: the answering thread must not keep the pipeline (its stages) alive.
        self._snapshot = weakref.WeakMethod(snapshot)  # type: ignore[arg-type]
        self.store = _default_store()
        self._answered: set[int] = set()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        """Starts the thread that answers when the others ask (once)."""
        if self._thread is None and self.store is not None:
            self._thread = threading.Thread(target=self._answer, daemon=True,
                                            name="conveyor-whereabouts")
            self._thread.start()

    def close(self) -> None:
        self._closed.set()

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
        if self.store is None:
            return found
        try:
            self._publish(step)
            self.store.set(f"{self.prefix}/{step}/asked", "1")
            start = time.monotonic()
            deadline, silent_deadline = start + seconds, start + min(seconds, 2 * _POLL + 0.5)
            while True:
                for rank in range(self.ranks):
                    key = f"{self.prefix}/{step}/{rank}"
                    if found[rank] is None and self.store.check([key]):
                        found[rank] = json.loads(self.store.get(key))
                now = time.monotonic()
                waiting = [r for r, s in found.items() if s is None and (
                    now < silent_deadline or r not in known_silent)]
                if not waiting or now > deadline:
                    return found
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host died: report what is known
            return found

    def _publish(self, step: int) -> None:
        snapshot = self.snapshot()
        if snapshot is not None and step not in self._answered:
            assert self.store is not None
            self._answered.add(step)
            self.store.set(f"{self.prefix}/{step}/{self.rank}", json.dumps(snapshot))

    def _answer(self) -> None:
        while not self._closed.wait(_POLL):
            if self._snapshot() is None:
                return  # the pipeline is gone
            snapshot = self.snapshot()
            if snapshot is None or snapshot["step"] in self._answered:
                continue
            step = snapshot["step"]
            try:
                assert self.store is not None
                if self.store.check([f"{self.prefix}/{step}/asked"]):
                    self._publish(step)
            except Exception:  # noqa: BLE001 - no store any more: nobody to answer
                return


def _default_store() -> Any:
    """The store of the default process group (None if it has none)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private helper of torch: do without it
        return None
