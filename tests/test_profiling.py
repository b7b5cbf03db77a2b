"""Profiling for balance: layers that start in place, one meaning of ``sample``, ties."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.graph import balance as partition
from conveyor.graph.balance import _balance
from tests.support.models import one_costly_layer, one_cpu_thread


def test_a_layer_starting_in_place_is_profiled() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                          nn.ReLU(inplace=True))
    profiles = conveyor.balance.profile_layers(model, torch.randn(4, 8), repeat=1)
    assert [p.name for p in profiles] == ["0", "1", "2", "3"]
    assert conveyor.balance.balance_by_memory(model, torch.randn(4, 8), 2) == [2, 2]
    assert sum(conveyor.balance.balance_by_time(model, torch.randn(4, 8), 2)) == 4


def test_all_zero_costs_balance_the_number_of_layers() -> None:
    assert conveyor.balance.solve_balance([0.0] * 6, 2) == [3, 3]
    assert conveyor.balance.solve_balance([0.0] * 7, 3) == [2, 2, 3]  # earlier cuts break ties


@pytest.mark.parametrize("noise", [(1.0, 1.02, 0.99, 1.01, 1.0), (1.03, 0.98, 1.0, 1.0, 0.97),
                                   (0.97, 1.0, 1.0, 0.98, 1.03)])
def test_layers_equal_but_for_timing_noise_split_the_same_way(
        noise: tuple[float, ...]) -> None:
    assert _balance(list(noise), 2, slack=0.05) == [2, 3]  # most even, then earlier cuts
    assert _balance([*noise, 1.0], 3, slack=0.05) == [2, 2, 2]
    assert _balance([1.0, 1.0, 1.0, 1.0, 10.0], 2, slack=0.05) == [4, 1]  # real costs count


@pytest.mark.parametrize("chunks", [1, 4])
def test_sample_is_one_micro_batch_for_pipeline_as_for_balance_by_time(
        chunks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipeline(balance="time") profiles ``sample`` as it is, whatever ``chunks``, as
    balance_by_time does. The layers' times are made exact (the last costs 8, the others
    1: [5, 1] is 8, [4, 2] 9) so that timing noise cannot decide the answer."""
    torch.manual_seed(0)
    model = one_costly_layer(6, 5, times=8)
    microbatch = torch.randn(64, 128)
    profiled: list[tuple[int, ...]] = []
    measure = partition.profile_layers

    def exact(module: nn.Sequential, sample: torch.Tensor, **options: Any) -> list[Any]:
        profiled.append(tuple(sample.shape))
        return [dataclasses.replace(p, forward_seconds=8.0 if i == 5 else 1.0,
                                    backward_seconds=0.0)
                for i, p in enumerate(measure(module, sample, repeat=1))]

    monkeypatch.setattr(partition, "profile_layers", exact)
    with one_cpu_thread():
        pipe = conveyor.Pipeline(model, loss_fn=nn.MSELoss(), chunks=chunks, balance="time",
                                 sample=microbatch, devices=["cpu"] * 2)
        assert pipe.balance == conveyor.balance.balance_by_time(model, microbatch, 2) == [5, 1]
    assert profiled == [(64, 128), (64, 128)]


class SeesMode(nn.Module):
    """Notes the mode and whether gradients are on each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, torch.is_grad_enabled()))
        return torch.tanh(self.linear(x))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SeesMode() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_profiling_trains_and_puts_every_module_s_mode_back() -> None:
    """As torchgpipe: profiled in training mode with gradients (as the pipeline trains),
    an eval model stays eval after, and a submodule's own mode is kept."""
    from conveyor.graph.autosplit import choose_split_at

    model = nn.Sequential(SeesMode(), nn.BatchNorm1d(4), SeesMode())
    model.eval()
    model[2].train()  # a mixed model: its modes come back one by one
    statistics = model[1].running_mean.clone()
    with torch.no_grad():  # the caller's grad mode does not matter
        conveyor.balance.balance_by_time(model, torch.randn(8, 4), 2, repeat=1)
    conveyor.balance.balance_by_memory(model, torch.randn(8, 4), 2)
    assert [m.training for m in model] == [False, False, True] and not model.training
    assert torch.equal(model[1].running_mean, statistics)
    assert model[0].seen and set(model[0].seen) == {(True, True)}
    blocks = Blocks().eval()
    choose_split_at(blocks, 2, torch.randn(8, 4), by="time")
    assert not any(m.training for m in blocks.modules())
    assert set(blocks.blocks[0].seen) == {(True, True)}


def test_profiling_leaves_existing_gradients_as_they_were() -> None:
    from conveyor.graph.autosplit import choose_split_at

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model(torch.randn(3, 4)).sum().backward()
    model[2].bias.grad = None  # one parameter without a gradient
    before = {name: p.grad for name, p in model.named_parameters()}
    values = {name: g.clone() for name, g in before.items() if g is not None}
    conveyor.balance.balance_by_time(model, torch.randn(8, 4), 2, repeat=1)
    conveyor.balance.balance_by_memory(model, torch.randn(8, 4), 2)
    conveyor.balance.profile_layers(model, torch.randn(8, 4), repeat=1)
    blocks = Blocks()
    blocks(torch.randn(2, 4)).sum().backward()
    block_grads = [p.grad.clone() for p in blocks.parameters()]  # type: ignore[union-attr]
    choose_split_at(blocks, 2, torch.randn(8, 4), by="time")
    for name, param in model.named_parameters():
        assert param.grad is before[name], name  # the same tensor, or still None
        if param.grad is not None:
            assert torch.equal(param.grad, values[name]), name
    assert model[2].bias.grad is None
    for param, grad in zip(blocks.parameters(), block_grads, strict=True):
        assert torch.equal(param.grad, grad)  # type: ignore[arg-type]
