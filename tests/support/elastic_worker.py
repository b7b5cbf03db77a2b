"""``conveyor train`` behind a gate, for tests/test_elastic.py: step n waits until the file
named by ``CONVEYOR_TEST_GATE`` holds a number of at least n, or until a stop signal
came (torchrun's SIGTERM when a node joins: the step in flight then finishes and saves,
as in any run). The test thus decides where the run stands when it kills or adds a
node, however fast or slow this machine is.

Run as ``python -m tests.support.elastic_worker <conveyor train flags>`` (torchrun
``-m``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from conveyor.cli import main
from conveyor.train import loop, stopping

__all__: list[str] = []

_stopping = threading.Event()


def _allowed(step: int, gate: Path) -> bool:
    try:
        return int(gate.read_text().strip() or 0) >= step
    except (OSError, ValueError):  # being rewritten: ask again
        return False


def _install(gate: Path) -> None:
    take_step = loop._Training._step
    handle = stopping.StopSignals._handle

    def gated_step(self: Any, *, record_it: bool) -> float:
        while not _stopping.is_set() and not _allowed(self.step + 1, gate):
            time.sleep(0.05)
        return float(take_step(self, record_it=record_it))

    def noted_handle(self: Any, number: int, frame: Any) -> None:
        _stopping.set()
        handle(self, number, frame)

    loop._Training._step = gated_step  # type: ignore[method-assign]
    stopping.StopSignals._handle = noted_handle  # type: ignore[method-assign]


if __name__ == "__main__":
    _install(Path(os.environ["CONVEYOR_TEST_GATE"]))
    sys.exit(main(["train", *sys.argv[1:]]))
