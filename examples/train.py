"""Train a small Transformer language model with a two-stage 1F1B pipeline.

The same script runs both ways:

    python examples/train.py                                      # 2 stages on threads
    torchrun --standalone --nproc-per-node 2 examples/train.py    # 1 stage per process

The text is the source of Python's own json package, read as bytes; the model learns to
predict the next byte. Both runs print the same losses.
"""

from __future__ import annotations

import argparse
import inspect
import json
import json.decoder
import json.encoder

import torch
from torch import nn

import conveyor
from conveyor.train.models import transformer_lm

LENGTH = 64


def corpus() -> torch.Tensor:
    text = "".join(inspect.getsource(m) for m in (json, json.decoder, json.encoder))
    return torch.tensor(list(text.encode()), dtype=torch.long)


def batch(data: torch.Tensor, size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    starts = torch.randint(0, len(data) - LENGTH - 1, (size,), generator=generator)
    windows = torch.stack([data[s:s + LENGTH + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = transformer_lm(layers=4, width=64, hidden=256, heads=4, vocab=256,
                           max_length=LENGTH)
    pipe = conveyor.Pipeline(model, stages=2, chunks=4, schedule="1f1b",
                             loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    data, generator = corpus(), torch.Generator().manual_seed(1)
    show = not pipe.topology.distributed or torch.distributed.get_rank() == 0
    for step in range(1, args.steps + 1):
        inputs, targets = batch(data, 32, generator)
        optimizer.zero_grad()
        loss = pipe.step(inputs, targets)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        if show and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
