"""Small float64 models of three architectures, and helpers to compare gradients."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.engine.microbatch import gather, split
from conveyor.engine.recompute.rng import derive_seed
from conveyor.graph.balance import solve_balance


def mlp(dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.GELU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)]
    return nn.Sequential(*layers).double()


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.Tanh(),
        nn.Conv2d(6, 6, 3, stride=2), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 5),
    ).double()


class Block(nn.Module):
    """A pre-norm Transformer block with causal self-attention."""

    def __init__(self, width: int = 16, heads: int = 2, hidden: int = 32,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.feed_forward = nn.Sequential(nn.Linear(width, hidden), nn.GELU(),
                                          nn.Linear(hidden, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        attended, _ = self.attention(h, h, h, attn_mask=mask, need_weights=False)
        x = x + self.dropout(attended)
        return x + self.dropout(self.feed_forward(self.norm2(x)))


VOCAB, WIDTH = 20, 16


def transformer(dropout: float = 0.0) -> nn.Sequential:
    vocab, width = VOCAB, WIDTH
    return nn.Sequential(
        nn.Embedding(vocab, width), Block(width, dropout=dropout), Block(width, dropout=dropout),
        Block(width, dropout=dropout), nn.LayerNorm(width), nn.Linear(width, vocab),
    ).double()


def sample(name: str, batch: int = 10, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(batch, 6, dtype=torch.float64, generator=generator)
    if name == "cnn":
        return torch.randn(batch, 3, 8, 8, dtype=torch.float64, generator=generator)
    return torch.randint(0, VOCAB, (batch, 7), generator=generator)


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def build(name: str, seed: int = 0, **kwargs: float) -> tuple[nn.Sequential, nn.Sequential]:
    """The same model twice: one for the pipeline, one as the plain reference."""
    torch.manual_seed(seed)
    model = MODELS[name](**kwargs)
    return model, copy.deepcopy(model)


class Repeated(nn.Module):
    """One Linear and tanh applied ``times`` times: ``times`` times the work of a layer
    with ``times=1``, with the same parameters."""

    def __init__(self, width: int, times: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.times = times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = torch.tanh(self.linear(x))
        return x


def one_costly_layer(layers: int, costly: int, *, times: int,
                     width: int = 128) -> nn.Sequential:
    """``layers`` layers with as many parameters and equal work each, but layer ``costly``,
    which does ``times`` as much work."""
    return nn.Sequential(*[Repeated(width, times if i == costly else 1)
                           for i in range(layers)])


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Times layers on one intra-op thread: on a busy machine, threads waiting for each
    other add noise far larger than a small layer's time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def even_balance(model: nn.Sequential, stages: int) -> list[int]:
    return solve_balance([1.0] * len(model), stages)


def weighted_loss(output: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per output element (fixed weights)."""
    weights = torch.randn(output.shape, dtype=output.dtype,
                          generator=torch.Generator().manual_seed(99)).to(output.device)
    return (output * weights).sum() + output.pow(2).sum() / 7


def paired(*sequences: Iterable[Any]) -> list[tuple[Any, ...]]:
    """``zip(*sequences)`` that fails unless they hold the same, non-zero number of items
    (a plain zip of two empty lists, or of lists cut short, would check nothing)."""
    lists = [list(s) for s in sequences]
    lengths = [len(s) for s in lists]
    assert lengths[0] > 0 and lengths == [lengths[0]] * len(lists), f"lengths {lengths}"
    return list(zip(*lists))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_same_grads(pipe_params: Iterable[tuple[str, nn.Parameter]],
                      ref_params: Iterable[tuple[str, nn.Parameter]],
                      *, rtol: float = 1e-10) -> None:
    pipe_params, ref_params = list(pipe_params), list(ref_params)
    assert [n for n, _ in pipe_params] == [n for n, _ in ref_params]
    assert any(r.grad is not None for _, r in ref_params), "the reference has no gradient"
    for (name, p), (_, r) in paired(pipe_params, ref_params):
        if r.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, f"{name} has no gradient"
        error = relative_error(p.grad.cpu(), r.grad.cpu())
        assert error <= rtol, f"{name}: relative error {error:.3g} > {rtol}"


def seeded_per_layer(model: nn.Sequential, inputs: Any, chunks: int, step_seed: int) -> Any:
    """The plain layers run micro-batch by micro-batch, each layer reseeded with the
    pipeline's stream for it (``derive_seed(step_seed, layer, microbatch)``): what a
    pipeline of an ``nn.Sequential`` with random layers promises to compute."""
    outputs = []
    for m, part in enumerate(split(inputs, chunks)):
        h = part
        for i, layer in enumerate(model):
            torch.manual_seed(derive_seed(step_seed, i, m))
            h = layer(h)
        outputs.append(h)
    return gather(outputs)
