"""The runtime's host seconds per action and per step (``Cluster.action_s``,
``Cluster.step_s``), calibrated in one process against plain steps of the same model.

One 1F1B stage steps over 4 and over 8 micro-batches of 8 samples, each paired with the
plain model's forward and backward over the same ones (timed one after the other in each
round). What the runtime adds to its pair, the median of the rounds' differences, grows
by two actions a micro-batch from what it adds to a step of its own. Every step starts
from gradients set to None, as a training step's ``optimizer.zero_grad()`` leaves them.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import conveyor

__all__ = ["calibration_steps", "plain_step", "runtime_costs", "training_step"]

#: The calibration's micro-batch counts, and their samples each.
CALIBRATION = (4, 8)
CALIBRATION_MICRO = 8

Step = Callable[[torch.Tensor, torch.Tensor], None]


def training_step(pipe: Any) -> Step:
    """``pipe``'s step from gradients set to None, as after ``optimizer.zero_grad()``."""
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, y)
    return step


def plain_step(net: nn.Module, micro: int) -> Step:
    """The model's forward and backward on the batch, ``micro`` samples at a time,
    without a pipeline, from gradients set to None."""
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        net.zero_grad(set_to_none=True)
        for inputs, targets in zip(x.split(micro), y.split(micro)):
            nn.functional.mse_loss(net(inputs), targets).backward()
    return step


def calibration_steps(net: nn.Module, x: torch.Tensor, y: torch.Tensor
                      ) -> dict[str, Callable[[], None]]:
    """The calibration's pairs, runtime then plain, as steps of a round robin (on the
    first rows of ``x`` and ``y``); :func:`runtime_costs` reads their times."""
    steps: dict[str, Callable[[], None]] = {}
    for chunks in CALIBRATION:
        rows = chunks * CALIBRATION_MICRO
        pipe = training_step(conveyor.Pipeline(copy.deepcopy(net),
                                               loss_fn=nn.functional.mse_loss,
                                               devices=["cpu"], recompute="never",
                                               stages=1, chunks=chunks, schedule="1f1b"))
        plain = plain_step(copy.deepcopy(net), CALIBRATION_MICRO)
        steps[f"runtime {chunks}"] = lambda pipe=pipe, rows=rows: pipe(x[:rows], y[:rows])
        steps[f"plain {chunks}"] = lambda plain=plain, rows=rows: plain(x[:rows], y[:rows])
    return steps


def runtime_costs(times: dict[str, list[float]]) -> tuple[float, float]:
    """The runtime's host seconds (per action, per step) from the calibration's pairs in
    ``times`` (popped from it)."""
    added = {}
    for chunks in CALIBRATION:
        runtime, plain = times.pop(f"runtime {chunks}"), times.pop(f"plain {chunks}")
        added[chunks] = statistics.median([r - p for r, p in zip(runtime, plain)])
    few, many = CALIBRATION
    action = max(0.0, (added[many] - added[few]) / (2 * (many - few)))
    return action, max(0.0, added[few] - 2 * few * action)
