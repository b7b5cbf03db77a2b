"""Cutting a sequence of layers into contiguous stages: validation and balancing.

``balance`` lists how many consecutive layers each stage holds: ``[3, 5]`` puts layers
0-2 on stage 0 and 3-7 on stage 1. The ``balance_by_*`` functions find the balance that
minimises the largest stage cost exactly (dynamic programming over all contiguous
partitions, not a greedy cut), then, among the partitions that reach that optimum,
the one whose stage costs are most even (least sum of squares).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.errors import BalanceError
from conveyor.graph.profile import profile_layers
from conveyor.graph.source import sequential_layers

__all__: list[str] = []


# Stages whose measured times differ by less than this (relative) count as equal.
_TIME_SLACK = 0.05


def validate_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """Checks that ``balance`` cuts ``num_layers`` layers into non-empty stages.

    Returns:
        ``balance`` as a list of ints.

    Raises:
        BalanceError: an entry is not a positive integer, there are more stages than
            layers, or the entries do not sum to the number of layers.
    """
    balance = list(balance)
    if not balance:
        raise BalanceError("balance is empty; give at least one stage, e.g. "
                           f"[{num_layers}] for the whole model on one device")
    for stage, count in enumerate(balance):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise BalanceError(
                f"balance {balance}: stage {stage} has {count!r} layers; every stage "
                "needs a positive integer number of layers"
            )
    if len(balance) > num_layers:
        raise BalanceError(
            f"balance {balance} asks for {len(balance)} stages but the model has only "
            f"{num_layers} layers; use at most {num_layers} stages"
        )
    if sum(balance) != num_layers:
        raise BalanceError(
            f"balance {balance} covers {sum(balance)} layers but the model has "
            f"{num_layers}; the entries must sum to {num_layers}"
        )
    return balance


def solve_balance(costs: Sequence[float], stages: int) -> list[int]:
    """The contiguous partition of ``costs`` into ``stages`` parts with least max cost.

    Exact: a dynamic programme over every contiguous partition, O(stages * L^2) on
    vectorised tensors. Ties are broken towards the most even partition (least sum of
    squared stage costs), then towards earlier cuts. With every cost zero, the number
    of layers is evened out.

    Raises:
        BalanceError: a cost is negative or not finite, or there are more stages than
            layers.
    """
    return _balance(costs, stages, slack=0.0)


def solve_measured_balance(costs: Sequence[float], stages: int) -> list[int]:
    """:func:`solve_balance` for measured times: partitions whose largest stage is within
    5% of the least count as equal, and the most even in numbers of layers wins.

    Raises:
        BalanceError: as :func:`solve_balance`.
    """
    return _balance(costs, stages, slack=_TIME_SLACK)


def _balance(costs: Sequence[float], stages: int, *, slack: float) -> list[int]:
    """:func:`solve_balance`; with ``slack`` > 0, any partition whose largest stage is
    within ``slack`` (relative) of the least counts as optimal, and among those the one
    with the most even numbers of layers wins: measured costs then cannot flip the
    answer by noise."""
    num_layers = len(costs)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise BalanceError(f"the number of stages must be a positive integer, got {stages!r}")
    if stages > num_layers:
        raise BalanceError(
            f"cannot cut {num_layers} layers into {stages} stages; use at most "
            f"{num_layers} stages"
        )
    cost = torch.tensor([float(c) for c in costs], dtype=torch.float64)
    bad = ~torch.isfinite(cost) | (cost < 0)
    if bool(bad.any()):
        layer = int(bad.nonzero()[0])
        raise BalanceError(f"layer {layer} has cost {float(cost[layer])}; costs must be "
                           "finite and non-negative")
    if not bool(cost.any()):  # nothing to weigh: even out the number of layers
        cost = torch.ones_like(cost)
    segment = _segments(cost)
    valid = torch.ones_like(segment, dtype=torch.bool).triu(diagonal=1)
    worst = _solve(segment, valid, stages, combine=torch.maximum)[0]
    within = valid & (segment <= worst * (1 + slack))
    if slack:
        # Integer squares of layer counts, plus a nudge below 1 in all towards earlier
        # cuts (segment ends), so that no two partitions tie.
        ends = torch.arange(num_layers + 1, dtype=torch.float64)[None, :]
        evenness = _segments(torch.ones_like(cost)).square() + ends / (stages * num_layers + 1)
    else:
        evenness = segment.square()
    _, cuts = _solve(evenness, within, stages, combine=torch.add)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _segments(cost: torch.Tensor) -> torch.Tensor:
    """``segment[i, j]``: the cost of layers i..j-1 (meaningful for i < j)."""
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), cost.cumsum(0)])
    return prefix[None, :] - prefix[:, None]


def _solve(
    segment: torch.Tensor, valid: torch.Tensor, stages: int, combine: Any
) -> tuple[float, list[int]]:
    """min over partitions of combine-folded segment values, and its cut points."""
    size = segment.shape[0]
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    best = torch.full((size,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    choices = []
    for _ in range(stages):
        candidate = torch.where(valid, combine(best[:, None], segment), inf)
        best, argbest = candidate.min(dim=0)
        choices.append(argbest)
    cuts = [size - 1]
    for argbest in reversed(choices):
        cuts.append(int(argbest[cuts[-1]]))
    return float(best[size - 1]), cuts[::-1]


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The summed cost of each stage of ``balance``."""
    out, start = [], 0
    for count in balance:
        out.append(float(sum(costs[start:start + count])))
        start += count
    return out


def balance_by_params(module: nn.Sequential, stages: int) -> list[int]:
    """Balance that evens out the number of parameter elements per stage.

    Raises:
        BalanceError: more stages than layers.
    """
    layers = sequential_layers(module)
    costs = [sum(p.numel() for p in layer.parameters()) for _, layer in layers]
    return solve_balance(costs, stages)


def balance_by_time(
    module: nn.Sequential, sample: Any, stages: int, *, repeat: int = 3
) -> list[int]:
    """Balance that evens out forward plus backward time per stage.

    Each layer is timed on ``sample``, one micro-batch (a batch of the size the stages
    will see), on the device the model is on, as the fastest of at least ``repeat`` runs
    (more for fast layers, to 20 ms in all) after a warm-up. Times are rounded to a tenth of the median layer's time before solving, so
    that layers whose times differ only by measurement noise count as equal and the
    answer does not flip between runs.

    Raises:
        BalanceError: more stages than layers.
    """
    profiles = profile_layers(module, sample, repeat=repeat)
    return solve_measured_balance([p.forward_seconds + p.backward_seconds for p in profiles],
                                  stages)


def balance_by_memory(
    module: nn.Sequential, sample: Any, stages: int, *, param_scale: float = 2.0
) -> list[int]:
    """Balance that evens out memory per stage: saved activations plus parameters.

    A layer costs the bytes autograd saves for its backward on ``sample`` plus
    ``param_scale`` times its parameter bytes. The default 2 counts a parameter and its
    gradient; use 4 for Adam (two more states), 3 for RMSProp or momentum SGD.

    Raises:
        BalanceError: more stages than layers.
    """
    profiles = profile_layers(module, sample, repeat=0)
    costs = [p.saved_bytes + param_scale * p.parameter_bytes for p in profiles]
    return solve_balance(costs, stages)
