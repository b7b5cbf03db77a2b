"""Classify scikit-learn's bundled 8x8 digits with a convolutional network in 2 stages.

    pip install 'conveyor[images]'      # scikit-learn, whose wheel ships the digits
    python examples/digits.py           # GPipe schedule, 2 stages on CPU threads

The network is conveyor.train.models.convnet (a stem, cells with two reductions, a head), cut
into 2 stages; batch norm is deferred, so its running statistics follow whole
mini-batches as in the plain model. Prints the held-out accuracy after each epoch.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import conveyor
from conveyor.train.data import digits
from conveyor.train.models import convnet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()

    (train_x, train_y), (test_x, test_y) = digits()
    torch.manual_seed(0)
    model = convnet(cells=6, channels=16, classes=10, in_channels=1)
    pipe = conveyor.Pipeline(model, stages=2, chunks=args.chunks, schedule="gpipe",
                             loss_fn=nn.functional.cross_entropy, deferred_batch_norm=True)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    print(f"{len(train_x)} training and {len(test_x)} held-out digits; balance "
          f"{pipe.balance}, {args.chunks} micro-batches", flush=True)
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train_x), generator=generator)
        total = 0.0
        for batch in order.split(args.batch):
            if len(batch) < args.chunks:
                continue  # too small to split into micro-batches
            loss = pipe.step(train_x[batch], train_y[batch])
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item() * len(batch)
        pipe.eval()
        with torch.no_grad():
            predicted = torch.cat([pipe.eval_step(part).argmax(1)
                                   for part in test_x.split(args.batch)])
        pipe.train()
        accuracy = (predicted == test_y).float().mean().item()
        print(f"epoch {epoch}  loss {total / len(train_x):.4f}  held-out accuracy "
              f"{100 * accuracy:.1f}%", flush=True)


if __name__ == "__main__":
    main()
