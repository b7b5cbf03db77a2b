"""Reference models, built as layer sequences a pipeline can cut anywhere."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Residual", "feed_forward_stack"]


class Residual(nn.Module):
    """``x + body(x)``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def feed_forward_stack(
    blocks: int = 8, width: int = 512, hidden: int = 2048, *, residual: bool = False
) -> nn.Sequential:
    """``blocks`` feed-forward blocks Linear(width, hidden)-GELU-Linear(hidden, width).

    With the defaults this is the benchmarks' config P (8 blocks, 512 -> 2048 -> 512,
    16.8M parameters): uniform stages, so the pipeline's own overhead is easy to see.
    ``residual=True`` adds a skip connection around each block, which a deep stack
    needs to train well.
    """
    def block() -> nn.Module:
        body = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        return Residual(body) if residual else body

    return nn.Sequential(*[block() for _ in range(blocks)])
