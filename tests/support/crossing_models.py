"""Models whose values cross stages past the next one (edges of the schedule), for the
tests of direct sends in threads (tests/test_direct.py, tests/test_any_model.py) and in
processes (tests/support/scenarios/pipeline.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, PAD_ID = 12, 8, 0


class Up(nn.Module):
    """A convolution of its input and a skip connection, side by side."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, out, 3, padding=1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    """Two levels down and up; each level's output skips to the matching level up, so
    with split_at=["up2", "up1"] the first skip goes from stage 0 to stage 2 (an edge)."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh())
        self.down2 = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.Tanh())
        self.middle = nn.Conv2d(8, 8, 3, padding=1)
        self.up2 = nn.Sequential(nn.Conv2d(16, 4, 3, padding=1), nn.Tanh())
        self.up1 = Up(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.down1(x)
        second = self.down2(first)
        x = torch.cat([self.middle(second), second], dim=1)
        x = nn.functional.interpolate(self.up2(x), scale_factor=2.0)
        return self.up1(x, first)


class Mix(nn.Module):
    """``h + tanh(W h)``, times a context and with padding zeroed where they are given."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, context: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.linear(h))
        if context is not None:
            y = y * context
        if keep is not None:
            y = y * keep
        return h + y


class Crossing(nn.Module):
    """Token ids, an embedding, blocks and a head. Before the first block, the model makes
    a context (floating, from the embedding: it carries gradients) and a padding mask
    (bool: it cannot); block i uses the context if i is in ``context_at``, the mask if
    in ``mask_at``. Cut before blocks 1..n-1, stage 0 makes both, and sends each
    straight to the stages that use it, e.g. with 4 blocks, context at (1, 2) and mask
    at (2, 3)::

        0 -> 1   h, context
        0 -> 2   context, mask      edge 0->2 (gradients of the context come back)
        0 ~> 3   mask               edge 0~>3 (no gradient)
    """

    def __init__(self, blocks: int, *, context_at: Sequence[int] = (),
                 mask_at: Sequence[int] = ()) -> None:
        super().__init__()
        self.context_at, self.mask_at = tuple(context_at), tuple(mask_at)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.context = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Mix(WIDTH) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        context = torch.tanh(self.context(h))
        keep = (ids != PAD_ID).unsqueeze(-1)
        for i, block in enumerate(self.blocks):
            h = block(h, context if i in self.context_at else None,
                      keep if i in self.mask_at else None)
        return self.head(h)

    def split_at(self) -> list[str]:
        """One stage per block."""
        return [f"blocks.{i}" for i in range(1, len(self.blocks))]


def crossing(blocks: int = 4, *, context_at: Sequence[int] = (1, 2),
             mask_at: Sequence[int] = (2, 3)) -> Crossing:
    torch.manual_seed(0)
    return Crossing(blocks, context_at=context_at, mask_at=mask_at).double()


def token_batch(batch: int = 10, length: int = 5, seed: int = 1) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """Ids with padding (a third of them), and targets."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    ids[torch.rand(batch, length, generator=generator) < 0.33] = PAD_ID
    return ids, torch.randint(0, VOCAB, (batch, length), generator=generator)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
