"""``conveyor.where(pipe)`` and ``kill -USR1``: where each rank of a running step is.

Reads the ranks' positions (:mod:`conveyor.engine.watchdog.position`) without stopping them, and
prints the same report a failed step carries: for each rank of this process the last
action it finished, the one it is in, the message it waits for and for how long, and
the clock with its place marked. Under torchrun a process knows its own rank only;
``kill -USR1`` every process of the job (``pkill -USR1 -f train.py``) to see them all.
``conveyor train`` installs the signal handler; a script can too::

    conveyor.report_on_signal(pipe)          # then: kill -USR1 <pid>
"""

from __future__ import annotations

import signal
import sys
from typing import Any, TextIO

__all__ = ["report_on_signal", "where"]


def where(pipe: Any, *, file: TextIO | None = None) -> str:
    """Prints (to ``file``, by default stderr) and returns where every local rank of
    ``pipe`` (a :class:`~conveyor.Pipeline` or :class:`~conveyor.GPipe`) stands in its
    current step, or stood at the end of its last one.

    Raises:
        TypeError: ``pipe`` is not a conveyor pipeline.
    """
    executor = getattr(getattr(pipe, "runtime", None), "executor", None)
    if executor is None or not hasattr(executor, "report"):
        raise TypeError(f"conveyor.where() reads a Pipeline or a GPipe, not "
                        f"{type(pipe).__name__}")
    if not executor.positions:
        text = "no step has run yet"
    else:
        text = executor.report(absent="in another process")
    print(text, file=file if file is not None else sys.stderr, flush=True)
    return text


def report_on_signal(pipe: Any, signum: int = signal.SIGUSR1) -> Any:
    """Prints :func:`where` of ``pipe`` whenever the process receives ``signum``
    (``kill -USR1 <pid>``), without stopping it; returns the previous handler.

    Call it from the main thread (Python runs signal handlers there, between two
    bytecodes: a step stuck inside a C++ call reports once it comes back).
    """
    def handler(number: int, frame: Any) -> None:
        where(pipe)

    return signal.signal(signum, handler)
