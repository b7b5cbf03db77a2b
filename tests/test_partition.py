"""Balancing layers over stages: exact min-max partitions and profiled costs."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import BalanceError
from conveyor.graph.balance import solve_balance, stage_costs, validate_balance
from conveyor.graph.profile import profile_layers
from tests.support.models import one_costly_layer, one_cpu_thread


def compositions(total: int, parts: int) -> list[list[int]]:
    """Every way to cut ``total`` layers into ``parts`` non-empty contiguous stages."""
    return [
        [b - a for a, b in zip((0, *cuts), (*cuts, total))]
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


@pytest.mark.parametrize("seed", range(40))
def test_solve_balance_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers = rng.randint(1, 10)
    stages = rng.randint(1, layers)
    costs = [float(rng.choice([0, 1, 2, 3, 5, 8, 13, 40])) for _ in range(layers)]
    balance = solve_balance(costs, stages)

    candidates = compositions(layers, stages)
    best_max = min(max(stage_costs(costs, c)) for c in candidates)
    best_even = min(sum(x * x for x in stage_costs(costs, c)) for c in candidates
                    if max(stage_costs(costs, c)) == best_max)
    assert len(balance) == stages and sum(balance) == layers and min(balance) >= 1
    assert max(stage_costs(costs, balance)) == best_max
    assert sum(x * x for x in stage_costs(costs, balance)) == best_even


def test_solve_balance_is_not_greedy() -> None:
    # A greedy left-to-right cut at the average (11/2) would give [2, 2] (cost 6 vs 5).
    assert solve_balance([5, 1, 2, 3], 2) == [1, 3]
    # Among the optimal partitions, the most even one; ties go to the earlier cut.
    assert solve_balance([1, 1, 1, 1, 1, 100], 3) == [2, 3, 1]


def test_solve_balance_scales_to_long_models() -> None:
    costs = [float(i % 7 + 1) for i in range(600)]
    balance = solve_balance(costs, 16)
    assert sum(balance) == 600 and len(balance) == 16


@pytest.mark.parametrize("bad", [[-1.0, 2.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_costs_must_be_finite_and_non_negative(bad: list[float]) -> None:
    with pytest.raises(BalanceError, match=r"layer 0 has cost .*; costs must be finite and "
                                           r"non-negative"):
        solve_balance(bad, 1)


def test_validate_balance_returns_a_list() -> None:
    assert validate_balance((2, 3), 5) == [2, 3]
    with pytest.raises(BalanceError, match=r"balance is empty"):
        validate_balance([], 5)


def test_balance_by_params_evens_out_parameters() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10),
                          nn.Linear(10, 100), nn.Linear(100, 100))
    # parameters: 10100, 0, 1010, 110, 1100, 10100
    assert conveyor.balance.balance_by_params(model, 2) == [4, 2]  # 11220 | 11200
    assert conveyor.balance.balance_by_params(model, 3) == [1, 4, 1]


def test_profile_layers_counts_parameters_and_saved_activations() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    x = torch.randn(5, 8, dtype=torch.float64)
    profiles = profile_layers(model, x, repeat=2)
    assert [p.name for p in profiles] == ["0", "1", "2"]
    assert [p.parameters for p in profiles] == [8 * 16 + 16, 0, 16 * 4 + 4]
    assert profiles[0].parameter_bytes == (8 * 16 + 16) * 8
    # Linear saves its input; tanh saves its output.
    assert profiles[0].saved_bytes == 5 * 8 * 8
    assert profiles[1].saved_bytes == 5 * 16 * 8
    assert [p.output_bytes for p in profiles] == [5 * 16 * 8, 5 * 16 * 8, 5 * 4 * 8]
    # Every layer here has work to time both ways (tanh's backward too).
    assert all(p.forward_seconds > 0 and p.backward_seconds > 0 for p in profiles)


def test_profiled_time_follows_the_work() -> None:
    model = one_costly_layer(6, 2, times=20)  # layer 2 does 20x the work of the others
    with one_cpu_thread():
        profiles = profile_layers(model, torch.randn(64, 128), repeat=3)
    seconds = [p.forward_seconds + p.backward_seconds for p in profiles]
    # Against the others' median: one of them timed while the machine was busy (seen in
    # CI: 1.0 ms among 0.31s) says nothing of the work.
    others = seconds[:2] + seconds[3:]
    assert seconds[2] > 5 * statistics.median(others), seconds
    rest = [p for p in profiles if p.name != "2"]
    assert profiles[2].forward_seconds > statistics.median(p.forward_seconds for p in rest)
    assert profiles[2].backward_seconds > statistics.median(p.backward_seconds for p in rest)


def test_profiling_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(6, 4)
    torch.manual_seed(0)
    expected_draw = torch.rand(2)
    torch.manual_seed(0)
    profile_layers(model, x, repeat=2)
    assert torch.equal(torch.rand(2), expected_draw)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("layers", "costly", "stages", "expected"), [
    (8, 3, 3, [3, 1, 4]), (5, 0, 2, [1, 4]), (5, 4, 2, [4, 1])])
def test_balance_by_time_gives_a_costly_layer_a_stage_of_its_own(
        layers: int, costly: int, stages: int, expected: list[int]) -> None:
    # Every layer has the same parameters, but one does 8x the work: alone in a stage it
    # sets the pace (8), with any neighbour it would be at least 1/8 slower (far outside the
    # 5% within which the most even layer counts win); the other stages hold at most 4
    # layers (4 < 8), so this is the only balance with the least maximum.
    model = one_costly_layer(layers, costly, times=8)
    with one_cpu_thread():
        assert conveyor.balance.balance_by_time(model, torch.randn(64, 128), stages) == expected
    assert conveyor.balance.balance_by_params(model, stages) != expected  # parameters cannot see it


def test_balance_by_memory_weighs_activations_and_parameters() -> None:
    # Layer 0 saves a large input; layers 1-3 are small.
    model = nn.Sequential(nn.Linear(256, 4, bias=False), nn.Linear(4, 4), nn.Linear(4, 4),
                          nn.Linear(4, 4))
    x = torch.randn(64, 256)
    assert conveyor.balance.balance_by_memory(model, x, 2) == [1, 3]
