"""Models as a user hands them to conveyor: no nn.Sequential, no split_at; and functions
for ``conveyor plan --model tests.support.user_models:NAME``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class LadderUNet(nn.Module):
    """A U-Net whose six blocks are one ModuleList: three down (each output skips to the
    matching block up, so block 0's crosses every stage), three up. The stem is heavy."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, width, 3, padding=1),
                                  nn.Conv2d(width, width, 5, padding=2))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Tanh()) for _ in range(6))
        self.head = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for block in self.blocks[:3]:
            skips.append(block(x))
            x = F.avg_pool2d(skips[-1], 2)
        for block in self.blocks[3:]:
            x = block(F.interpolate(x, scale_factor=2.0) + skips.pop())
        return self.head(x)


class TiedLM(nn.Module):
    """Token embedding, two bias-free linear blocks, and a head tied to the embedding."""

    def __init__(self, vocab: int = 10, width: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def ladder() -> tuple[nn.Module, Any]:
    """The U-Net on the CPU, and a sample of two images."""
    return LadderUNet(), torch.zeros(2, 2, 8, 8)


def llama_on_meta() -> nn.Module:
    """A small Hugging Face Llama (untied head) on the meta device, without a sample."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32,
                                      intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def tied_on_meta() -> nn.Module:
    with torch.device("meta"):
        return TiedLM()


NOT_A_FUNCTION = 3


def returns_a_number() -> int:
    return 3


def small_byte_lm() -> nn.Module:
    """A byte-level language model that is no ``nn.Sequential`` of conveyor's own: for
    ``conveyor train --model tests.support.user_models:small_byte_lm``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=2,
                                      n_head=2, n_inner=32, use_cache=False))
