"""The language-modelling task of ``conveyor train``: its loss, held-out bits per byte
(or per token, with a tokenizer), and text sampled with pipelined inference."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from conveyor.pipeline import Pipeline
from conveyor.train.data import TextCorpus
from conveyor.train.options import TrainConfig

__all__: list[str] = []


def logits_of(output: Any) -> Any:
    """The logits of a model's output: the tensor itself, or a ``ModelOutput``'s, a
    dict's (``"logits"``) or a tuple's first."""
    if output is None or isinstance(output, torch.Tensor):
        return output
    return output["logits"] if hasattr(output, "keys") else output[0]


def next_token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each next token, in nats."""
    logits = logits_of(output)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def summed_next_token_loss(output: Any, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cross-entropy summed over the predicted tokens, and their number: the loss a
    ``Pipeline`` divides by the whole step's count, so that every token weighs the same
    whatever micro-batch it falls in."""
    logits = logits_of(output)
    total = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                        reduction="sum")
    return total, targets.numel()


@torch.no_grad()
def evaluate(pipe: Pipeline, corpus: TextCorpus, config: TrainConfig) -> float:
    """Held-out bits per byte (per token), over ``eval_batches`` fixed batches."""
    pipe.eval()
    total = torch.zeros((), dtype=torch.float64)
    for index in range(config.eval_batches):
        inputs, targets = corpus.batch(index, config.batch, config.length, seed=config.seed,
                                       heldout=True)
        output = pipe.eval_step(inputs)
        if output is not None:
            logits = logits_of(output).float()
            total += next_token_loss(logits, targets.to(logits.device)).double().cpu()
    pipe.train()
    total = pipe.from_last_stage(total)
    return float(total) / config.eval_batches / math.log(2)


@torch.no_grad()
def generate(pipe: Pipeline, corpus: TextCorpus, config: TrainConfig) -> str:
    """Continues a held-out prompt by sampling (temperature 0.8) with pipelined inference:
    ``chunks`` samples at once, one per micro-batch; returns the first."""
    pipe.eval()
    generator = torch.Generator().manual_seed(config.seed)
    context = corpus.prompt(min(48, config.length)).repeat(config.chunks, 1)
    for _ in range(config.sample_bytes):
        output = pipe.eval_step(context[:, -config.length:])
        chosen = torch.zeros(config.chunks, 1, dtype=torch.long)
        if output is not None:
            probabilities = torch.softmax(logits_of(output)[:, -1].float().cpu() / 0.8, dim=-1)
            chosen = torch.multinomial(probabilities, 1, generator=generator)
        context = torch.cat([context, pipe.from_last_stage(chosen)], dim=1)
    pipe.train()
    return corpus.decode(context[0].tolist())
