"""The planner's activation memory per rank against what a real step holds: within 10%,
for the schedules with one stage per rank and the V shapes (two), with and without
recomputation.

Measured by :class:`tests.support.saved_bytes.HeldBytes` on K=4 CPU threads, each
treated as a device of its own. On 8 feed-forward blocks (64 -> 256 -> 64), batch 64
in 8 micro-batches, the measured peaks come out at 0.95-1.00 of the predictions without
recomputation and 0.95-1.08 with it. Below 1: at a V's turn one rank's output is its
other stage's input, counted on both, and a recomputed forward's values are counted as
if all lived at once; above: the output that a recomputation makes again.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor
from conveyor.observe.plan import measure, plan
from conveyor.schedules import V_SHAPES
from conveyor.train.models import feed_forward_stack
from tests.support.saved_bytes import HeldBytes

BLOCKS, WIDTH, BATCH, RANKS, CHUNKS = 8, 64, 64, 4, 8
SCHEDULES = ["gpipe", "1f1b", "zero-bubble", "zb-v", "v-half", "v-min"]


def measured_and_predicted(schedule: str, recompute: str) -> tuple[list[int], list[float]]:
    """Per rank, the peak bytes held for backward in one step, and the plan's activation
    bytes (its rank bytes less the parameters' and optimizer's)."""
    torch.manual_seed(0)
    layers = feed_forward_stack(BLOCKS, WIDTH, 4 * WIDTH)
    figures = measure(layers, torch.randn(BATCH // CHUNKS, WIDTH))
    planned = plan(figures, devices=RANKS, memory=float("inf"), batch=BATCH, chunks=CHUNKS,
                   schedule=schedule, virtual_stages=2 if schedule in V_SHAPES else 1,
                   rematerialize=recompute == "always")
    pipe = conveyor.Pipeline(layers, balance=planned.balance, chunks=CHUNKS,
                             schedule=schedule, devices=["cpu"] * RANKS, recompute=recompute,
                             loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    meter = HeldBytes(pipe, x, y)
    with meter.on_devices(pipe):
        pipe.step(x, y)
    meter.remove_hooks()
    activations = [planned.rank_bytes[r] - sum(planned.stages[s].parameter_bytes
                                               for s in pipe.schedule.stages_of(r))
                   for r in range(RANKS)]
    return meter.peak, activations


@pytest.mark.parametrize("recompute", ["never", "always"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_ranks_predicted_activations_are_within_ten_percent_of_a_step(
        schedule: str, recompute: str) -> None:
    measured, predicted = measured_and_predicted(schedule, recompute)
    ratios = [m / p for m, p in zip(measured, predicted, strict=True)]
    assert len(ratios) == RANKS and all(0.9 <= r <= 1.1 for r in ratios), \
        f"{schedule}, recompute {recompute!r}: measured / predicted per rank " + \
        ", ".join(f"{r:.3f}" for r in ratios)

