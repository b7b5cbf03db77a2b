"""How long a rank may wait, by phase of the run: given, or fitted to the step time.

A fixed timeout has to cover the slowest phase, so a frozen rank then costs every
step its whole length before anyone is told. With ``timeout=None`` (the default) the
waits are fitted to what they cover:

=====================================  ==============================================
phase                                  a wait may take
=====================================  ==============================================
start-up (process group, agreement)    300 s (torch's process-group timeout)
the first two steps                    300 s (first allocations, lazy set-up: the
                                       first step is not a measure of the others)
a peer that has not reached the step   300 s (ranks may reach a step at different
                                       times: saving, evaluating, loading data; a
                                       rank asks a silent peer where it is)
within a later step                    10 x the slowest of the last 20 steps (the
                                       first left out), at least 30 s
=====================================  ==============================================

A given ``timeout=T`` bounds every wait by T seconds, whatever the phase.
"""

from __future__ import annotations

from collections import deque

__all__: list[str] = []

FACTOR = 10.0
WINDOW = 20


class Deadlines:
    """The seconds a wait may take, per phase.

    Args:
        timeout: seconds for every wait; None fits them to the phase (see the module).

    Attributes:
        first: fitted, the seconds of the start-up, the first two steps and a peer that
            has not reached the step (300).
        floor: fitted, the least a wait within a later step may take (30): lower it where
            steps take milliseconds and a frozen rank should be found sooner.

    Both can be set on one pipeline's (``pipe.timeouts.floor = 3``) or, before the
    pipelines are built, for every one in the process (``Deadlines.floor = 3``; the
    start-up of ``conveyor train`` and of the ranks' agreement waits ``Deadlines.first``).
    """

    first: float = 300.0
    floor: float = 30.0

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.fixed = timeout
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._longest = 0.0  # of _steps
        self._warmed_up = False

    @property
    def opening(self) -> float:
        """For a peer that has not reached the step yet, and for the start-up."""
        return self.fixed if self.fixed is not None else self.first

    @property
    def within(self) -> float:
        """For any other wait of a step, and for one action to run."""
        if self.fixed is not None:
            return self.fixed
        if not self._steps:
            return self.first
        return max(self.floor, FACTOR * self._longest)

    def measured(self, seconds: float) -> None:
        """Notes how long a run that went through took (the first one is warm-up)."""
        if self._warmed_up:
            self._steps.append(seconds)
            self._longest = max(self._steps)  # (asked at every wait: found once a step)
        self._warmed_up = True

    def __repr__(self) -> str:
        given = "given" if self.fixed is not None else "fitted"
        return f"Deadlines({given}: opening {self.opening:g} s, within {self.within:g} s)"
