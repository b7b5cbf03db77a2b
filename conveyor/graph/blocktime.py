"""What each of a model's blocks costs in time: its forward and backward, measured on a
sample with hooks at the blocks' boundaries (for :mod:`conveyor.graph.autosplit`).

A run marks the time each block begins its forward, and, in backward, the time the
gradient of each block's input arrives (a hook on that tensor)::

    forward    start | b0 ... | b1 ... | b2 ... | end        marks: b1 and b2 begin
    backward   end | ... b0 | ... b1 | ... b2 | start        marks: grads of b1's, b2's inputs

Between two marks runs one block and whatever the model does before the next: the cut
puts those operations on the same stage. What runs before the first block counts on
the first, what runs after the last on the last. Each block's time is the fastest of
at least five runs after a warm-up; buffers and random generators are left as they were.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from conveyor.graph.tracedstage import as_call
from conveyor.graph.balance import preserved_state
from conveyor.errors import BalanceError, ModelError

__all__: list[str] = []

# Runs go on past ``repeat`` until this many seconds are measured (at most _MAX_RUNS).
_MIN_SECONDS = 0.1
_MAX_RUNS = 50


class _Marks:
    """The times of one run's block boundaries."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entered: dict[int, float] = {}  # block -> its forward began
        self.gradient: dict[int, float] = {}  # block -> its input's gradient arrived

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def enter(self, block: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if block in self.entered:  # a block called twice: its first call marks it
            return
        self.entered[block] = self.now()
        first = next((t for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(partial(self.arrived, block))

    def arrived(self, block: int, grad: torch.Tensor) -> None:
        self.gradient.setdefault(block, self.now())


def block_times(model: nn.Module, names: Sequence[str], sample: Any, *,
                repeat: int = 5) -> tuple[list[str], list[float]]:
    """The blocks named ``names`` that the forward runs, and the seconds each takes
    (forward and backward, with what runs before the first and after the last block
    counted on them): per block, the fastest of at least ``repeat`` runs after one
    warm-up, and of more, up to a tenth of a second, when runs are fast (a busy machine
    slows some runs of a block; the fastest is the block's own time).

    Raises:
        BalanceError: the model is on the meta device (nothing to time).
        ModelError: the blocks do not run in their order.
    """
    device = next(model.parameters(), torch.empty(0)).device
    if device.type == "meta":
        raise BalanceError(f"balance='time' runs {type(model).__name__} on the sample, but "
                           "it is on the meta device; build it on a device, or balance by "
                           "parameters (balance=None)")
    modules = [model.get_submodule(name) for name in names]
    best: list[float] | None = None
    ran: list[int] = []
    runs, spent = 0, 0.0
    with preserved_state(model, device):
        _run(model, modules, sample, device)  # warm-up
        while runs < repeat or (spent < _MIN_SECONDS and runs < _MAX_RUNS):
            marks, forward, backward = _run(model, modules, sample, device)
            ran = sorted(marks.entered)
            _check_order(model, names, ran, marks.entered)
            costs = _costs(ran, marks, forward, backward)
            best = costs if best is None else [min(a, b) for a, b in zip(best, costs)]
            runs, spent = runs + 1, spent + backward[1] - forward[0]
    return [names[i] for i in ran], best or []


def _run(model: nn.Module, modules: list[nn.Module], sample: Any, device: torch.device
         ) -> tuple[_Marks, tuple[float, float], tuple[float, float]]:
    """One forward and backward with marks: the marks, forward's and backward's start
    and end."""
    params = [p for p in model.parameters() if p.requires_grad]
    args, kwargs = as_call(sample)
    marks = _Marks(device)
    handles = [m.register_forward_pre_hook(partial(marks.enter, i), with_kwargs=True)
               for i, m in enumerate(modules)]
    try:
        start = marks.now()
        with torch.enable_grad():
            out = model(*args, **kwargs)
        forward_end = marks.now()
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        backward_start = marks.now()
        if outs and params:
            torch.autograd.grad(outs, params, [torch.ones_like(t) for t in outs],
                                allow_unused=True)
        backward_end = marks.now()
    finally:
        for handle in handles:
            handle.remove()
    return marks, (start, forward_end), (backward_start, backward_end)


def _costs(ran: list[int], marks: _Marks, forward: tuple[float, float],
           backward: tuple[float, float]) -> list[float]:
    """Per block that ran, forward + backward seconds between its marks and the next's.
    A block whose input needs no gradient has no backward mark: what runs in backward
    before the next mark counts with it."""
    begins = [forward[0], *(marks.entered[b] for b in ran[1:]), forward[1]]
    ends: list[float] = [backward[1]]  # walking backward in time, from the first block
    for b in ran[1:]:
        ends.append(marks.gradient.get(b, ends[-1]))
    ends.append(backward[0])
    return [max(0.0, begins[i + 1] - begins[i]) + max(0.0, ends[i] - ends[i + 1])
            for i in range(len(ran))]


def _check_order(model: nn.Module, names: Sequence[str], ran: list[int],
                 entered: dict[int, float]) -> None:
    for a, b in itertools.pairwise(ran):
        if entered[b] < entered[a]:
            raise ModelError(
                f"{type(model).__name__}'s forward runs {names[b]!r} before {names[a]!r}: "
                "its blocks do not run in their order, so conveyor cannot choose the cut "
                "among them; give split_at=")
