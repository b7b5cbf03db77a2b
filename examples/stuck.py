"""A pipeline one of whose stages gets stuck in step 3, to see what conveyor says.

    python examples/stuck.py --timeout 5             # threads: a layer loops forever
    torchrun --nproc-per-node 2 examples/stuck.py --timeout 5 --freeze
                                                     # rank 1 stops (SIGSTOP) instead

The step ends with an error within the timeout and a few seconds, carrying the report of
where every rank stood (``error.where``, also printed with the traceback). Leave out
``--timeout`` to see the default: fitted to the step time, at least 30 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from torch import nn

import conveyor


class Stuck(nn.Module):
    """Passes its input on; on its 10th forward (step 3's second micro-batch, 1F1) it
    loops forever, or, with ``freeze``, stops its process."""

    def __init__(self, freeze: bool) -> None:
        super().__init__()
        self.freeze, self.calls = freeze, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if conveyor.is_recomputing():
            return x
        self.calls += 1
        if self.calls == 10:
            if self.freeze:
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:
                pass
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--freeze", action="store_true", help="stop rank 1's process")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), Stuck(args.freeze),
                          nn.Linear(16, 1))
    pipe = conveyor.Pipeline(model, stages=2, balance=[2, 3], chunks=4, schedule="1f1b",
                             loss_fn=nn.functional.mse_loss, timeout=args.timeout)
    for step in range(1, 4):
        try:
            loss = pipe.step(torch.randn(32, 16), torch.randn(32, 1))
        except conveyor.ConveyorError as error:
            print(f"step {step}: {type(error).__name__}: {error}\n"
                  f"{getattr(error, 'where', '')}", file=sys.stderr)
            raise SystemExit(1) from None
        print(f"step {step}: loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
