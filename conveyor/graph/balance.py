"""Cutting a sequence of layers into contiguous stages: validation, profiling, balancing.

``balance`` lists how many consecutive layers each stage holds: ``[3, 5]`` puts layers
0-2 on stage 0 and 3-7 on stage 1. The ``balance_by_*`` functions find the balance that
minimises the largest stage cost exactly (dynamic programming over all contiguous
partitions, not a greedy cut), then, among the partitions that reach that optimum,
the one whose stage costs are most even (least sum of squares).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from conveyor.graph import skip
from conveyor.graph.source import sequential_layers
from conveyor.errors import BalanceError

__all__ = [
    "LayerProfile",
    "balance_by_memory",
    "balance_by_params",
    "balance_by_time",
    "profile_layers",
    "solve_balance",
]


# A layer is timed at least ``repeat`` times and for at least this long (up to _MAX_RUNS):
# a fast layer's time is otherwise mostly noise.
_MIN_SECONDS = 0.02
_MAX_RUNS = 200
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


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs, measured on a sample batch.

    Attributes:
        name: the layer's name in the ``nn.Sequential``.
        parameters: the number of parameter elements.
        parameter_bytes: bytes of parameters (gradients and optimizer state come on top).
        forward_seconds: forward time (the fastest of the timed runs).
        backward_seconds: backward time (input and weight gradients; the fastest run).
        saved_bytes: bytes of tensors autograd saves for backward, parameters excluded,
            each storage counted once.
        output_bytes: bytes of the layer's output tensors.
    """

    name: str
    parameters: int
    parameter_bytes: int
    forward_seconds: float
    backward_seconds: float
    saved_bytes: int
    output_bytes: int


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


def profile_layers(module: nn.Sequential, sample: Any, *, repeat: int = 3) -> list[LayerProfile]:
    """Measures each layer's time and memory on ``sample``, layer after layer.

    Runs on the device of the model's first parameter (CPU if it has none). The model
    is left as it was: random number generators and buffers (batch-norm statistics)
    are restored afterwards, and no gradient is accumulated.

    Args:
        module: the model as an ``nn.Sequential``.
        sample: an input batch for the first layer (tensor or nested structure).
        repeat: timed runs per layer after one warm-up (at least; a fast layer runs until
            20 ms are measured); 0 measures memory only. Times are the fastest run's.
    """
    layers = sequential_layers(module)
    device = next(module.parameters(), torch.empty(0)).device
    x = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), sample)
    profiles = []
    with preserved_state(module, device), skip.profiling():
        for name, layer in layers:
            profile, x = _profile_layer(name, layer, x, device, repeat)
            profiles.append(profile)
    return profiles


def _profile_layer(
    name: str, layer: nn.Module, x: Any, device: torch.device, repeat: int
) -> tuple[LayerProfile, Any]:
    params = [p for p in layer.parameters() if p.requires_grad]
    param_ids = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ids and t.device.type != "meta":
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def run(measure_memory: bool) -> tuple[float, float, Any]:
        leaves = pytree.tree_map_only(
            torch.Tensor,
            lambda t: t.detach().requires_grad_(t.is_floating_point() or t.is_complex()),
            x,
        )
        # The layer gets a copy, not the leaf itself: a layer that starts with an in-place
        # op (ReLU(inplace=True)) may modify it, as it may inside a stage.
        inputs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.clone() if t.requires_grad else t, leaves)
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                 if measure_memory else contextlib.nullcontext())
        _sync(device)
        start = time.perf_counter()
        with torch.enable_grad(), hooks:
            out = layer(inputs)
        _sync(device)
        forward = time.perf_counter() - start
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = [t for t in pytree.tree_leaves(leaves)
               if isinstance(t, torch.Tensor) and t.requires_grad] + params
        start = time.perf_counter()
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs],
                                allow_unused=True)
        _sync(device)
        return forward, time.perf_counter() - start, out

    _, _, out = run(measure_memory=True)
    times: list[tuple[float, float]] = []
    while repeat and (len(times) < repeat or (sum(f + b for f, b in times) < _MIN_SECONDS
                                               and len(times) < _MAX_RUNS)):
        times.append(run(measure_memory=False)[:2])
    out = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
    profile = LayerProfile(
        name=name,
        parameters=sum(p.numel() for p in layer.parameters()),
        parameter_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
        forward_seconds=min(t[0] for t in times) if times else 0.0,
        backward_seconds=min(t[1] for t in times) if times else 0.0,
        saved_bytes=sum(saved.values()),
        output_bytes=sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor)),
    )
    return profile, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def preserved_state(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Restores buffers and random generators after profiling runs the model."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
