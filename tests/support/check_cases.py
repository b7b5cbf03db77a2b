"""Small models with one cause of divergence each, planted in a known layer, for
``conveyor.check``; the functions at the end are what ``conveyor check --model
tests.support.check_cases:NAME`` loads."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PAD = -100


class Counter(nn.Module):
    """Multiplies by the number of times it has been called: state outside its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.calls


class BufferCounter(nn.Module):
    """Multiplies by a buffer that counts its calls: a buffer mutated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x * self.count.clone()


class Noise(nn.Module):
    """Adds noise drawn from a generator of its own, which conveyor cannot route."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.rand(x.shape, generator=self.generator, dtype=x.dtype)


class HalveInPlace(nn.Module):
    """Halves its input in place: through ``.data`` (unseen by autograd), or ``mul_``."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.through_data = through_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (x.data if self.through_data else x).mul_(0.5)
        return x


class TiedHead(nn.Module):
    """An output layer that reads another layer's weight held in a plain list."""

    def __init__(self, embedding: nn.Linear) -> None:
        super().__init__()
        self.sources = [embedding]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.sources[0].weight


def mlp(middle: nn.Module | None = None, *, dropout: float = 0.0) -> nn.Sequential:
    """Linear, Tanh, ``middle`` (layer 2), Linear, Tanh, Linear; 4 features in, 2 out."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), middle or nn.Dropout(dropout),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(rows: int = 10, outputs: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(rows, 4, generator=generator),
            torch.randn(rows, outputs, generator=generator))


def tied_by_a_list() -> nn.Sequential:
    """Layer 3 reads layer 0's weight through a list: a tie no pipeline can see."""
    torch.manual_seed(0)
    embedding = nn.Linear(4, 8, bias=False)
    return nn.Sequential(embedding, nn.Tanh(), nn.Linear(8, 8), TiedHead(embedding))


class SharedHead(nn.Module):
    """The same output layer holding the weight as a parameter of its own: one
    nn.Parameter in two layers, a tie the pipeline sees."""

    def __init__(self, embedding: nn.Linear) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def tied_as_parameters() -> nn.Sequential:
    torch.manual_seed(0)
    embedding = nn.Linear(4, 8, bias=False)
    return nn.Sequential(embedding, nn.Tanh(), nn.Linear(8, 8), SharedHead(embedding))


def padded_tokens() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """A token model and targets padded to very different lengths per row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 8), nn.Tanh(), nn.Linear(8, 5))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5, (10, 6), generator=generator)
    targets = torch.randint(0, 5, (10, 6), generator=generator)
    for row in range(10):
        targets[row, max(1, 6 - row):] = PAD
    return model, ids, targets


def mean_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the micro-batch's real tokens: its count varies per micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)


def summed_token_loss(logits: torch.Tensor,
                      targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD,
                            reduction="sum")
    return total, (targets != PAD).sum()


class Convolutions(nn.Module):
    """Not an nn.Sequential: cut with split_at, its batch norm inside "body.norm"."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.body = nn.Sequential()
        self.body.add_module("conv", nn.Conv2d(4, 4, 3, padding=1))
        self.body.add_module("norm", nn.BatchNorm2d(4))
        self.head = nn.Conv2d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(torch.tanh(self.stem(x)))))


# ------------------------------------------------- for conveyor check --model

def matching() -> dict[str, Any]:
    inputs, targets = batch()
    return {"model": mlp(dropout=0.2), "inputs": inputs, "targets": targets,
            "loss_fn": F.mse_loss, "balance": [3, 3]}


def batch_norm() -> tuple[nn.Module, Any, Any]:
    inputs, targets = batch()
    return mlp(nn.BatchNorm1d(8)), inputs, targets


def returns_a_model() -> nn.Module:
    return mlp()
