"""Layers of an nn.Sequential that stash and pop a skip connection (conveyor.skip.skippable),
and the model whose skip crosses two stages, with its plain copy and a float64 batch."""

from __future__ import annotations

import copy

import torch
from torch import nn

import conveyor


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


@conveyor.skip.skippable(stash=["skip"])
class Stash(Dense):
    """Stashes its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        conveyor.skip.stash("skip", y)
        return y


@conveyor.skip.skippable(pop=["skip"])
class Pop(Dense):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + conveyor.skip.pop("skip")


class Mode(Dense):
    """Computes another function in eval mode: the eval trace is a program of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) if self.training else torch.sin(self.linear(x))


def build(*layers: nn.Module) -> tuple[nn.Sequential, nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model, its plain copy, a batch (requiring grad) and targets, in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(*layers).double()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, 6, dtype=torch.float64, generator=generator)
    targets = torch.randn(8, 6, dtype=torch.float64, generator=generator)
    return model, copy.deepcopy(model), inputs.requires_grad_(), targets


def long_skip() -> tuple[nn.Sequential, nn.Sequential, torch.Tensor, torch.Tensor]:
    """Layer 0 stashes, layer 4 pops: with balance [2, 2, 1] the skip crosses two stages."""
    return build(Stash(), Dense(), Mode(), Dense(), Pop())
