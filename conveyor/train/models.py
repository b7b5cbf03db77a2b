"""Reference models, built as layer sequences a pipeline can cut anywhere, and their
per-layer figures for the planner."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from conveyor.observe.plan import LayerFigures, measure

__all__ = [
    "Cell",
    "Embedding",
    "Residual",
    "TRANSFORMER_TP_PLAN",
    "TransformerBlock",
    "convnet",
    "convnet_figures",
    "feed_forward_stack",
    "transformer_figures",
    "transformer_lm",
]


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


class TransformerBlock(nn.Module):
    """A pre-norm Transformer block: causal self-attention, then a feed-forward layer.

    Args:
        width: the model width H_model.
        hidden: the feed-forward width (the paper's H).
        heads: the number of attention heads A.
        dropout: dropout after attention and feed-forward.
    """

    def __init__(self, width: int, hidden: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.feed_forward = nn.Sequential(nn.Linear(width, hidden), nn.GELU(),
                                          nn.Linear(hidden, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        attended = attended.transpose(1, 2).reshape(batch, length, width)
        x = x + self.dropout(self.proj(attended))
        return x + self.dropout(self.feed_forward(self.norm2(x)))


class Embedding(nn.Module):
    """Token and learned position embeddings: (batch, length) ids to (batch, length, width)."""

    def __init__(self, vocab: int, width: int, max_length: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_length, width)
        # Small, as GPT-2: a tied output head then starts near uniform predictions.
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


def transformer_lm(
    layers: int,
    width: int,
    hidden: int,
    heads: int,
    *,
    vocab: int = 256,
    max_length: int = 512,
    dropout: float = 0.0,
    tie: bool = False,
) -> nn.Sequential:
    """A Transformer language model T(L, H, A) as a layer sequence.

    embedding, ``layers`` blocks, final norm, output head: L + 3 layers that a pipeline
    can cut anywhere. With ``tie`` the head (no bias) is the token embedding, one
    Parameter used by the first and the last layer.
    """
    embedding = Embedding(vocab, width, max_length)
    head = nn.Linear(width, vocab, bias=not tie)
    if tie:
        head.weight = embedding.tokens.weight
    return nn.Sequential(
        embedding,
        *[TransformerBlock(width, hidden, heads, dropout) for _ in range(layers)],
        nn.LayerNorm(width),
        head,
    )


#: The tensor-parallel plan of :func:`transformer_lm` (``Pipeline(tp_plan=...)``): each
#: block's feed-forward pair split Megatron's way (the first Linear by its outputs, the
#: second by its inputs, one sum per block), attention, embedding, norms and head whole
#: on every rank. Exact: the fused ``qkv`` Linear is never split by its outputs, which
#: would give each rank a mix of q, k and v rather than its heads.
TRANSFORMER_TP_PLAN = {"*.feed_forward.0": "colwise", "*.feed_forward.2": "rowwise"}


class Cell(nn.Module):
    """A residual convolution cell; a reduction cell halves the resolution and doubles
    the channels (AmoebaNet stacks normal cells between reduction cells)."""

    def __init__(self, channels: int, *, reduction: bool = False) -> None:
        super().__init__()
        out = channels * 2 if reduction else channels
        stride = 2 if reduction else 1
        self.body = nn.Sequential(
            nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out), nn.ReLU(),
            nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out),
        )
        self.skip = (nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False),
                                   nn.BatchNorm2d(out)) if reduction else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def convnet(cells: int = 6, channels: int = 32, classes: int = 10, *,
            in_channels: int = 3) -> nn.Sequential:
    """An image classifier in the AmoebaNet/ResNet spirit, as a layer sequence.

    stem, ``cells`` cells (reduction cells at one and two thirds of the depth), and a
    head (pooling and a linear classifier): cells + 2 layers. Images have
    ``in_channels`` channels (3: colour, 1: grey).
    """
    layers: list[nn.Module] = [nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
        nn.ReLU())]
    width = channels
    reductions = {cells // 3, 2 * cells // 3} if cells >= 3 else set()
    for index in range(cells):
        reduction = index in reductions  # never 0: cells // 3 >= 1
        layers.append(Cell(width, reduction=reduction))
        width = width * 2 if reduction else width
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)))
    return nn.Sequential(*layers)


def transformer_figures(layers: int, width: int, hidden: int, heads: int, *,
                        vocab: int = 32000, length: int = 512) -> list[LayerFigures]:
    """Figures of the Transformer LM T(L, H, A) (``conveyor.train.models.transformer_lm``).

    One block is measured on the meta device and repeated: the blocks are identical.
    """
    with torch.device("meta"):
        small = transformer_lm(1, width, hidden, heads, vocab=vocab, max_length=length)
        sample = torch.zeros(1, length, dtype=torch.long)
    embedding, block, norm, head = measure(small, sample)
    blocks = [replace(block, name=str(1 + i)) for i in range(layers)]
    return [embedding, *blocks, replace(norm, name=str(layers + 1)),
            replace(head, name=str(layers + 2))]


def convnet_figures(cells: int, channels: int, *, image: int = 224,
                    classes: int = 1000) -> list[LayerFigures]:
    """Figures of the AmoebaNet-like classifier ``conveyor.train.models.convnet`` on meta."""
    with torch.device("meta"):
        model = convnet(cells, channels, classes)
        sample = torch.zeros(1, 3, image, image)
    return measure(model, sample)
