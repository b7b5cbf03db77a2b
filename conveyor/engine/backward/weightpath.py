"""Which way a stage's ``W`` reaches its weights, chosen by measuring both.

A split backward can start ``W`` at two places, and both give the same gradients:

* ``"groups"``: at the nodes where each group of parameters joins the input path
  (:func:`~conveyor.engine.backward.weightgrad.backward_input`): no backward work is
  done twice, but ``I`` walks the stage's graph to find those nodes, and ``W`` makes one
  autograd call per group, each of which walks the graph below its start;
* ``"outputs"``: at the stage's outputs, in one autograd call that repeats the input
  path's backward on the way to the weights; ``I`` is a plain call to the inputs.

A stage of large layers is bound by its arithmetic, where ``"groups"`` saves the input
path's second pass; a stage of many small layers (or any stage whose host issues work
faster than a GPU runs it, the other way round) is bound by the host, where one call
instead of one per layer is cheaper: on 16 layers of ``Linear(16, 16)`` on a CPU,
``I + W`` takes 1.3 ms by groups and 0.7 ms from the outputs, against 0.44 ms for the
whole ``B``. (A stage whose inputs take no gradient, a first stage, has no input path:
its ``W`` is its whole backward, and it chooses nothing.) So each stage measures: its
first split micro-batches alternate between the two (:data:`TRIALS` of each, the first
of each left out as a warm-up, timed around ``I`` and ``W`` with the device
synchronised), and from then on it takes the one whose
``I + W`` was cheaper. ``CONVEYOR_WEIGHT_PATH=groups`` (or ``outputs``) fixes the way,
to compare or to rule the choice out. A stage that runs compiled graphs keeps
``"groups"``: its compiled graph's weight half is kept apart by ``I``. So do the stages
of a pipeline with a vocabulary-parallel head, tensor parallelism or FSDP (their
backwards work with other ranks or the head), and a stage whose graph holds a Python
autograd function (its backward may communicate, count or add into ``.grad``): every
``I`` looks for one, by groups in its walk, from the outputs in a walk of its own
(about a microsecond a node), and splits such a graph by groups all the same.
A tensor hook on an activation inside the stage runs twice per micro-batch from the
outputs, once in ``I`` and once in ``W``: a hook that only changes the gradient gives the
same result, one that counts or logs sees each micro-batch twice.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

import torch

__all__: list[str] = []

_log = logging.getLogger("conveyor")

Path = Literal["groups", "outputs"]
PATHS: tuple[Path, ...] = ("groups", "outputs")
#: micro-batches timed by each way, the first of which is a warm-up
TRIALS = 4


def fixed_path() -> Path | None:
    """The way ``CONVEYOR_WEIGHT_PATH`` fixes, or None (chosen by measuring).

    Raises:
        ValueError: the variable names neither way.
    """
    value = os.environ.get("CONVEYOR_WEIGHT_PATH", "")
    if not value:
        return None
    if value not in PATHS:
        raise ValueError(f"CONVEYOR_WEIGHT_PATH={value!r}: give 'groups' or 'outputs' "
                         "(or leave it unset: each stage measures both)")
    return value  # type: ignore[return-value]


class WeightPath:
    """One stage's choice of where ``W`` starts.

    Args:
        stage: the stage's index (for the log).
        device: where its backward runs (synchronised around a timed action).
        fixed: the way to take always, or None to measure.
    """

    def __init__(self, stage: int, device: torch.device, fixed: Path | None) -> None:
        self.stage = stage
        self.device = device
        self.chosen: Path | None = fixed
        self._seconds: dict[Path, list[float]] = {path: [] for path in PATHS}
        self._timing: dict[int, tuple[Path, float]] = {}  # micro-batch -> (way, I + W)
        self._next = 0

    def keep_groups(self, why: str) -> None:
        """Starts ``W`` by groups from now on: the stage's backward must not run its
        input path twice, for the reason ``why`` (logged)."""
        if self.chosen is None:
            _log.debug("stage %d: W starts by parameter groups (%s)", self.stage, why)
        self.chosen = "groups"
        self._timing.clear()

    def take(self, microbatch: int) -> Path:
        """The way for ``microbatch``'s ``I`` (and its ``W``), called as ``I`` starts."""
        if self.chosen is not None:
            return self.chosen
        path = PATHS[self._next % len(PATHS)]
        self._next += 1
        self._timing[microbatch] = (path, 0.0)
        return path

    def start(self, microbatch: int) -> float | None:
        """A timer for ``microbatch``'s ``I`` or ``W`` while the ways are measured."""
        if microbatch not in self._timing:
            return None
        self._synchronize()
        return time.perf_counter()

    def stop(self, microbatch: int, started: float | None, *, weight: bool) -> None:
        """Adds the time since ``started`` to ``microbatch``'s ``I + W``; after ``W``
        (``weight``), records it, and chooses once each way has its trials."""
        if started is None or microbatch not in self._timing:
            return
        self._synchronize()
        path, seconds = self._timing[microbatch]
        seconds += time.perf_counter() - started
        if not weight:
            self._timing[microbatch] = (path, seconds)
            return
        del self._timing[microbatch]
        self._seconds[path].append(seconds)
        if all(len(times) >= TRIALS for times in self._seconds.values()):
            self.choose()

    def choose(self) -> Path:
        """The way whose fastest ``I + W`` after its warm-up was the faster (ties:
        ``"groups"``, which does no work twice); fixed from now on."""
        best = {path: min(times[1:] or times) for path, times in self._seconds.items()
                if times}
        chosen: Path = min(PATHS, key=lambda path: best.get(path, float("inf")))
        self.chosen = chosen
        self._timing.clear()
        _log.debug("stage %d: W starts %s (I + W: %s)", self.stage,
                   "by parameter groups" if chosen == "groups" else "at the outputs",
                   ", ".join(f"{path} {1e6 * s:.0f} us" for path, s in best.items()))
        return chosen

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
