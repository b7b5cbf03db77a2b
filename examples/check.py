"""Models for ``conveyor check`` (README, "When things go wrong").

A small byte language model whose output head reuses the embedding matrix. Written the
first way, the head keeps the embedding in a plain list ("so that it is not registered
twice"): the plain model trains fine, but no pipeline can see the tie, and in a torchrun
job the head's rank would train a copy of the matrix of its own. Written the second way,
the head holds the same ``nn.Parameter``, and the pipeline ties the two uses::

    conveyor check --model examples.check:hidden_tie --stages 2
    conveyor check --model examples.check:visible_tie --stages 2
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, WIDTH = 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.norm(x))


class HiddenHead(nn.Module):
    """Logits from the embedding matrix, held in a list: a tie nobody can see."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = [embedding]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.embedding[0].weight.T


class Head(nn.Module):
    """Logits from the embedding matrix, held as a parameter: a tie the pipeline sees."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def _language_model(head: type[nn.Module]) -> dict[str, Any]:
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    model = nn.Sequential(embedding, Block(), Block(), nn.LayerNorm(WIDTH), head(embedding))
    data = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(1))
    return {"model": model, "inputs": data[:, :-1], "targets": data[:, 1:]}


def hidden_tie() -> dict[str, Any]:
    return _language_model(HiddenHead)


def visible_tie() -> dict[str, Any]:
    return _language_model(Head)
