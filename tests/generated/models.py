"""Random models from a menu of blocks, described by a :class:`Spec` that can shrink.

A generated model embeds its input (integer ids, or float features), runs a list of
blocks over a hidden state of shape (batch, length, width), and pools into a head:

    x ─ embed ─(+ positions)─ blocks[0] ─ blocks[1] ─ ... ─ blocks[n-1] ─ head ─ logits
                 │               │  memory ──────────┬────────┬─▶ cross blocks
                 └─ made once, read by every block ─┘  skip ───▶ one later block

Values that cross stages the way real models make them: a memory kept after one block
and read by every later cross-attention block (an encoder's output in a decoder; held
sequence-first, as torch's own attention takes it, at some odds), a position table and
an attention bias made once and reused by every block (as T5 makes its position bias in
the first block), a long skip, a weight shared by two distant blocks and a head tied to
the embedding. The output may be a tensor, a tuple or a dict that carries an earlier
value beside the logits and an integer side output.

Blocks with side effects and autograd of their own: buffers a forward changes and reads
(a counter, a running average updated in training, a cache of the last micro-batch), an
in-place activation writing into the block's input (at a cut, into the stage's input), a
module called twice, a custom autograd.Function, the user's own torch.utils.checkpoint,
``.detach()`` and ``torch.no_grad()`` inside forward.

And, in some cases (:data:`HAZARDS`, drawn apart so that every earlier seed's draws stay
as they were), what a pipeline makes exact or refuses by name: noise from a generator
the block holds, a list appended to and read, a weight clamped in forward (WGAN), and
one buffer written by one block and read by a later one (state that may cross a cut).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = ["BLOCKS", "CONTEXT_FREE", "HAZARDS", "ORDERED", "PARAMETERLESS", "STATEFUL",
           "Generated", "Spec", "draw_spec", "sequential_model", "share_state", "with_hazard"]

#: The menu. Context-free blocks map the hidden state alone; the rest also read what
#: the model made earlier (memory, positions, the attention bias, a skip).
CONTEXT_FREE = ("linear", "mlp", "inplace", "conv1d", "conv2d", "layernorm", "rmsnorm",
                "batchnorm", "dropout", "buffer", "counter", "ema", "cache", "relu_", "twice",
                "function", "checkpointed", "detach")
BLOCKS = CONTEXT_FREE + ("attention", "cross", "gate")
PARAMETERLESS = ("dropout", "buffer", "relu_")
#: Blocks whose forward changes their buffers: the plain model they are compared with
#: runs micro-batch by micro-batch, in order, as the pipeline does.
STATEFUL = ("counter", "ema", "cache")
CLASSES = 5
#: What a case may add (one each): the blocks that make it.
HAZARDS = {"noise": ("noise",), "log": ("log",), "clamp": ("clamp",),
           "shared": ("write", "read")}
#: Blocks whose forward depends on the order of micro-batches, as STATEFUL's.
ORDERED = STATEFUL + ("noise", "log", "write", "read")


@dataclass(frozen=True)
class Spec:
    """What to build; every field can be simplified by the shrinker."""

    blocks: tuple[str, ...]
    width: int = 8
    length: int = 4
    vocab: int = 0                      # > 0: integer ids embedded; 0: float features
    memory_from: int | None = None      # the block whose output cross blocks read
    skip: tuple[int, int] | None = None  # (from, to): a gate block reads from's output
    shared: tuple[int, int] | None = None  # two linear blocks holding one weight
    tie_head: bool = False              # head weight is the embedding's (needs vocab)
    positions: bool = False             # a position table added at every block
    output: str = "tensor"              # "tensor", "tuple" or "dict"
    extra: str | None = None            # an earlier value returned: "embedding", "memory"
    scale: bool = False                 # a non-tensor keyword argument
    dropout: float = 0.1
    seq_first: bool = False             # memory crosses stages as (length, batch, width)
    weights_seed: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        parts = [f"blocks={list(self.blocks)}"]
        for name in ("vocab", "memory_from", "skip", "shared", "tie_head", "positions",
                     "output", "extra", "scale", "seq_first"):
            value = getattr(self, name)
            if value not in (None, False, 0, "tensor"):
                parts.append(f"{name}={value}")
        return " ".join(parts)


def draw_spec(rng: random.Random) -> Spec:
    """A random :class:`Spec`: 2–8 blocks and each cross-stage value at some odds."""
    n = rng.randint(2, 8)
    blocks = [rng.choice(BLOCKS) for _ in range(n)]
    memory_from = rng.randrange(n - 1) if rng.random() < 0.5 else None
    if memory_from is None:
        blocks = ["attention" if kind == "cross" else kind for kind in blocks]
    else:  # cross blocks read memory, so they come after it
        blocks = [kind if kind != "cross" or i > memory_from else "mlp"
                  for i, kind in enumerate(blocks)]
    skip = None
    if n >= 3 and rng.random() < 0.4:
        source = rng.randrange(n - 2)
        target = rng.randrange(source + 2, n)
        blocks[target] = "gate"
        skip = (source, target)
    blocks = ["attention" if kind == "gate" and (skip is None or i != skip[1]) else kind
              for i, kind in enumerate(blocks)]
    linears = [i for i, kind in enumerate(blocks) if kind == "linear"]
    shared = (linears[0], linears[-1]) if len(linears) >= 2 and rng.random() < 0.6 else None
    vocab = rng.choice([0, CLASSES, 11])
    extra = rng.choice([None, "embedding", "memory" if memory_from is not None else None])
    return Spec(
        blocks=_unaliased(tuple(blocks), memory_from, skip, extra), width=rng.choice([4, 8]),
        length=rng.choice([3, 4, 6]), vocab=vocab, memory_from=memory_from, skip=skip,
        shared=shared, tie_head=vocab == CLASSES and rng.random() < 0.7,
        positions=rng.random() < 0.4,
        output=rng.choice(["tensor", "tuple", "dict"]), extra=extra,
        scale=rng.random() < 0.3, dropout=rng.choice([0.0, 0.1, 0.3]),
        seq_first=memory_from is not None and rng.random() < 0.4,
        weights_seed=rng.randrange(1 << 30))


def _unaliased(blocks: tuple[str, ...], memory_from: int | None,
               skip: tuple[int, int] | None, extra: str | None) -> tuple[str, ...]:
    """``blocks`` with each in-place activation made an "mlp" where it would write
    into a value the plain model needs as it was: one the model keeps (the memory, a
    skip's source, the embedding it returns; there the kept value would change with
    it, while in a pipeline cut between them it would not, as a stage works on what it
    received), or one the block before saved for its backward (a ReLU's or tanh's
    output: the plain model's backward would fail)."""
    kept = {memory_from, skip[0] if skip else None, -1 if extra == "embedding" else None}

    def writable(i: int) -> bool:
        before = i - 1
        while before >= 0 and blocks[before] == "dropout":  # may hand on its input
            before -= 1
        return before not in kept and (before < 0 or blocks[before] not in ("relu_", "ema"))

    return tuple("mlp" if kind == "relu_" and not writable(i) else kind
                 for i, kind in enumerate(blocks))


class Doubled(torch.autograd.Function):
    """2 tanh(x), with a hand-written backward (its forward's derivative)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x) * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 2 * (1 - torch.tanh(x) ** 2)


class Block(nn.Module):
    """One block of the menu; ``forward(h, *, memory, positions, bias, skip)``."""

    def __init__(self, kind: str, width: int, dropout: float) -> None:
        super().__init__()
        self.kind = kind
        d = width
        if kind in ("linear", "inplace"):
            self.f = nn.Linear(d, d)
        elif kind == "mlp":
            self.f = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(inplace=True), nn.Linear(2 * d, d))
        elif kind == "conv1d":
            self.f = nn.Conv1d(d, d, 3, padding=1)
        elif kind == "conv2d":
            self.f = nn.Conv2d(1, 2, 3, padding=1)
        elif kind == "layernorm":
            self.f = nn.LayerNorm(d)
        elif kind == "rmsnorm":
            self.f = nn.RMSNorm(d)
        elif kind == "batchnorm":
            self.f = nn.BatchNorm1d(d)
        elif kind == "dropout":
            self.f = nn.Dropout(dropout)
        elif kind == "buffer":
            self.register_buffer("gain", torch.linspace(0.5, 1.5, d))
        elif kind in ("counter", "ema", "cache", "twice", "function", "detach", "noise",
                      "log", "clamp", "write", "read"):
            self.f = nn.Linear(d, d)
            if kind == "noise":
                self.gen = torch.Generator().manual_seed(d)
            elif kind == "log":
                self.seen: list[int] = []
            elif kind in ("write", "read"):  # one buffer: see share_state
                self.register_buffer("state", torch.zeros(d))
            if kind == "counter":
                self.register_buffer("count", torch.zeros(()))
            elif kind in ("ema", "cache"):
                self.register_buffer("state", torch.zeros(d))
        elif kind == "checkpointed":
            self.f = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        elif kind == "relu_":
            pass
        elif kind in ("attention", "cross"):
            self.f = nn.MultiheadAttention(d, 2, batch_first=kind == "attention",
                                           dropout=dropout)
        elif kind == "gate":
            self.f = nn.Linear(d, d)
        else:
            raise ValueError(f"unknown block kind {kind!r}")

    def forward(self, h: torch.Tensor, *, memory: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                skip: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None:
            h = h + positions
        kind = self.kind
        if kind == "linear":
            return h + self.f(h)
        if kind == "inplace":
            y = self.f(h)
            return h + y.tanh_()
        if kind == "mlp":
            return h + self.f(h)
        if kind == "conv1d":
            return h + self.f(h.transpose(1, 2)).transpose(1, 2)
        if kind == "conv2d":
            return h + self.f(h.unsqueeze(1)).mean(1)
        if kind == "batchnorm":
            return self.f(h.transpose(1, 2)).transpose(1, 2)
        if kind == "buffer":
            return h * self.gain
        if kind in ORDERED or kind in ("relu_", "twice", "function", "checkpointed", "detach",
                                       "clamp"):
            return self._special(h) if kind not in HAZARD_BLOCKS else self._hazard(h)
        if kind == "attention":
            return h + self.f(h, h, h, attn_mask=bias, need_weights=False)[0]
        if kind == "cross":  # memory comes sequence-first, as this attention takes it
            assert memory is not None
            q = h.transpose(0, 1)
            return h + self.f(q, memory, memory, need_weights=False)[0].transpose(0, 1)
        if kind == "gate":
            assert skip is not None
            return h + self.f(h) * torch.sigmoid(skip)
        return self.f(h)  # layernorm, rmsnorm, dropout


    def _hazard(self, h: torch.Tensor) -> torch.Tensor:
        """The blocks a pipeline makes exact or refuses by name (:data:`HAZARDS`)."""
        kind = self.kind
        if kind == "noise":  # a generator of its own
            noise = torch.randn(h.shape, dtype=h.dtype, generator=self.gen)
            return h + self.f(h) * (1 + 0.1 * noise)
        if kind == "log":  # a list appended to, its length read
            self.seen.append(h.shape[0])
            return h + self.f(h) * (1 + 0.1 * len(self.seen))
        if kind == "clamp":  # WGAN's critic
            with torch.no_grad():
                self.f.weight.clamp_(-0.3, 0.3)
            return h + self.f(h)
        if kind == "write":
            with torch.no_grad():
                self.state.add_(h.mean((0, 1)))
            return h + self.f(h)
        assert kind == "read"
        return h + self.f(h) * torch.tanh(self.state)

    def _special(self, h: torch.Tensor) -> torch.Tensor:
        """The blocks with side effects or autograd of their own."""
        kind = self.kind
        if kind == "counter":  # every call, in training and eval
            self.count.add_(1)
            return h + self.f(h) * (1 + 0.1 * self.count.clone())
        if kind == "ema":  # a running average, updated in training
            if self.training:
                with torch.no_grad():
                    self.state.mul_(0.5).add_(h.mean((0, 1)), alpha=0.5)
            return torch.tanh(h + self.f(h) + self.state)
        if kind == "cache":  # reads what the previous call left
            out = h + self.f(h) * torch.tanh(self.state.clone())
            with torch.no_grad():
                self.state.copy_(h.mean((0, 1)))
            return out
        if kind == "relu_":
            return F.relu(h, inplace=True)
        if kind == "twice":
            return h + self.f(torch.tanh(self.f(h)))
        if kind == "function":
            return h + Doubled.apply(self.f(h))
        if kind == "checkpointed":
            return h + torch.utils.checkpoint.checkpoint(self.f, h, use_reentrant=False)
        assert kind == "detach"
        with torch.no_grad():
            scale = h.abs().mean(-1, keepdim=True) + 1  # per sample and position
        return (h + self.f(h) * torch.tanh(h.detach())) / scale


class Generated(nn.Module):
    """The model a :class:`Spec` describes."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.width
        self.embed: nn.Module = nn.Embedding(spec.vocab, d) if spec.vocab else nn.Linear(3, d)
        if spec.positions:
            self.positions = nn.Parameter(torch.randn(spec.length, d) * 0.1)
        self.blocks = nn.ModuleList(Block(kind, d, spec.dropout) for kind in spec.blocks)
        if spec.shared is not None:
            first, second = spec.shared
            self.blocks[second].f.weight = self.blocks[first].f.weight
        self.head = nn.Linear(d, spec.vocab if spec.tie_head else CLASSES)
        if spec.tie_head:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> Any:
        spec = self.spec
        h = self.embed(x)
        embedded = h
        positions = self.positions if spec.positions else None
        # An additive attention bias made once and read by every attention block.
        steps = torch.arange(spec.length, dtype=h.dtype, device=h.device)
        bias = -(steps[:, None] - steps[None, :]).abs() * 0.5
        memory = kept = None
        for i, block in enumerate(self.blocks):
            h = block(h, memory=memory if spec.seq_first or memory is None
                      else memory.transpose(0, 1), positions=positions, bias=bias,
                      skip=kept if spec.skip is not None and i == spec.skip[1] else None)
            if i == spec.memory_from:  # crosses stages sequence-first, or batch-first
                memory = h.transpose(0, 1) if spec.seq_first else h
            if spec.skip is not None and i == spec.skip[0]:
                kept = h
        logits = self.head(h).mean(1) * scale
        extra = embedded if spec.extra == "embedding" else memory
        if spec.extra == "memory" and spec.seq_first and memory is not None:
            extra = memory.transpose(0, 1)  # batch-first, as outputs are concatenated
        if spec.output == "tuple":
            return (logits, extra) if spec.extra else (logits,)
        if spec.output == "dict":
            out = {"logits": logits, "predicted": logits.argmax(-1)}
            if spec.extra:
                out["extra"] = extra
            return out
        return logits


HAZARD_BLOCKS = frozenset(kind for kinds in HAZARDS.values() for kind in kinds)


def share_state(model: nn.Module) -> None:
    """Gives each "read" block the buffer of the "write" block before it, if any (after
    ``model.double()``, which would give each its own copy)."""
    writer = None
    for layer in model.modules():
        if isinstance(layer, Block) and layer.kind == "write":
            writer = layer
        elif isinstance(layer, Block) and layer.kind == "read" and writer is not None:
            layer.state = writer.state


def with_hazard(spec: Spec, hazard: str, rng: random.Random) -> Spec:
    """``spec`` with the blocks of ``hazard`` in place of context-free blocks (or
    appended where there are too few)."""
    kinds = HAZARDS[hazard]
    blocks = list(spec.blocks)
    free = [i for i, kind in enumerate(blocks) if kind in CONTEXT_FREE and kind != "relu_"]
    while len(free) < len(kinds):
        blocks.append("linear")
        free.append(len(blocks) - 1)
    for i, kind in zip(sorted(rng.sample(free, len(kinds))), kinds):
        blocks[i] = kind
    return replace(spec, blocks=_unaliased(tuple(blocks), spec.memory_from, spec.skip,
                                           spec.extra))


class _Pool(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(1)


def sequential_model(spec: Spec) -> nn.Sequential:
    """The context-free form of ``spec`` as an ``nn.Sequential`` of layers."""
    d = spec.width
    layers: list[nn.Module] = [nn.Embedding(spec.vocab, d) if spec.vocab else nn.Linear(3, d)]
    layers += [Block(kind, d, spec.dropout) for kind in spec.blocks]
    layers += [_Pool(), nn.Linear(d, CLASSES)]
    return nn.Sequential(*layers)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of any generated model's output."""
    if isinstance(output, dict):
        return output["logits"]
    if isinstance(output, tuple):
        return output[0]
    return output


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the samples, averaged: the pipeline weights each micro-batch."""
    return F.cross_entropy(logits_of(output), targets)
