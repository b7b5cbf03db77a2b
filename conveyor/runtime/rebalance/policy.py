"""When to re-balance a pipeline while it trains, and to what balance.

::

    pipe = conveyor.Pipeline(model, balance=[2, 6], chunks=8, loss_fn=loss,
                             rebalance=conveyor.Rebalance(window=10, threshold=0.1))
    optimizer = torch.optim.AdamW(pipe.parameters())
    pipe.attach_optimizer(optimizer)     # its state moves with the layers

After each window of steps the pipeline hands :meth:`Rebalance.propose` what it
measured (see :mod:`conveyor.runtime.rebalance.rebalancing`). The proposal divides each stage's
measured forward, backward and weight-gradient time among its layers in proportion to
the layers' measured forward times, solves the balance that minimises the slowest
stage over those per-layer costs, and asks the simulator for the step time of the
schedule under the current and the proposed balance. Layers move only when the
current step is predicted more than ``threshold`` slower than the proposed one, so
noise does not make them go back and forth.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.runtime.rebalance.rebalancing import Proposal, StageTimes
from conveyor.errors import ConfigError
from conveyor.graph.balance import solve_measured_balance, stage_costs
from conveyor.schedules.simulate import CostModel, simulate
from conveyor.schedules import Schedule

__all__ = ["Rebalance"]

logger = logging.getLogger("conveyor")

LayerCosts = list[tuple[float, float, float]]  # per layer: forward, backward, weight


@dataclass(frozen=True)
class Rebalance:
    """Re-balancing while training: measure ``window`` steps, then move layers if that
    makes the predicted step more than ``threshold`` faster.

    Attributes:
        window: the steps measured before each decision.
        threshold: the least predicted gain (0.1: the current step is predicted 10%
            slower than the proposed one) for which layers move.
        warmup: the steps left unmeasured at the start and after each move (their
            stages warm up: allocations, caches).

    Raises:
        ConfigError: ``window`` < 1, ``warmup`` < 0, or ``threshold`` < 0.
    """

    window: int = 10
    threshold: float = 0.1
    warmup: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"Rebalance(window={self.window!r}): the window is a number "
                              "of steps, at least 1 (e.g. 10)")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"Rebalance(warmup={self.warmup!r}): give a number of steps, "
                              "at least 0")
        if not self.threshold >= 0:
            raise ConfigError(f"Rebalance(threshold={self.threshold!r}): give the least gain "
                              "worth a move as a fraction, at least 0 (0.1 for 10%)")

    def propose(self, times: StageTimes, balance: Sequence[int],
                schedule: Schedule) -> Proposal:
        """The balance to run next, from one window's measurements.

        Returns:
            A proposal that moves layers if the simulator predicts a gain above the
            threshold, else the current balance; with the figures either way.
        """
        balance = list(balance)
        layers = layer_costs(times, balance)
        totals = [sum(cost) for cost in layers]
        proposed = solve_measured_balance(totals, len(balance))
        now = predict(schedule, layers, balance, times.communication)
        then = predict(schedule, layers, proposed, times.communication)
        per_step = schedule.num_microbatches * 1e3  # ms per step, from s per micro-batch
        current = [t * per_step for t in stage_costs(totals, balance)]
        best = max(stage_costs(totals, proposed)) * per_step
        slowest = max(current) / best if best > 0 else 1.0
        gain = now / then - 1 if then > 0 else 0.0
        move = proposed != balance and gain > self.threshold
        reason = (f"stage times [{', '.join(f'{t:.0f}' for t in current)}] ms, slowest "
                  f"{slowest:.2f}x the balanced optimum; balance {balance} -> {proposed}, "
                  f"predicted step {now * 1e3:.0f} ms -> {then * 1e3:.0f} ms")
        if not move:
            reason += (f" ({gain:.1%} faster, not above the threshold of "
                       f"{self.threshold:.0%})" if proposed != balance else " (already there)")
        return Proposal(proposed if move else balance, move, reason)


def layer_costs(times: StageTimes, balance: Sequence[int]) -> LayerCosts:
    """Each layer's share of its stage's forward, backward and weight time, in
    proportion to its measured forward time (evenly where none was measured)."""
    costs: LayerCosts = []
    start = 0
    for s, count in enumerate(balance):
        weights = list(times.layer_forward[start:start + count])
        total = sum(weights)
        shares = [w / total for w in weights] if total > 0 else [1 / count] * count
        costs += [(times.forward[s] * share, times.backward[s] * share,
                   times.weight[s] * share) for share in shares]
        start += count
    return costs


def predict(schedule: Schedule, layers: LayerCosts, balance: Sequence[int],
            communication: float) -> float:
    """The simulated step time of ``schedule`` with ``layers`` cut by ``balance``."""
    sums = [stage_costs([cost[k] for cost in layers], balance) for k in range(3)]
    stages = len(balance)
    model = CostModel(tuple(sums[0]), tuple(sums[1]), tuple(sums[2]), (0.0,) * stages,
                      (communication,) * (stages - 1))
    return simulate(schedule, model).makespan
