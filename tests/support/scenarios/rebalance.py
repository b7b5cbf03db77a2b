"""Re-balancing under torchrun (see tests/support/launch.py): what each process does.

The parent test (tests/test_rebalance.py) trains the plain model with the same
functions and compares, step by step, every parameter and optimizer state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import conveyor
from conveyor.graph.source import sequential
from tests.support.scenarios import scenario

STEPS = 6
SLEEP = 0.004  # seconds per forward of a Slow layer: makes stage 1 the slow one


class Slow(nn.Module):
    """The identity, slowly: an artificially slow layer (no parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP)
        return x


def layer(i: int) -> nn.Module:
    """Layer i of the test model: two slow layers, both in stage 1 of balance [1, 5]."""
    return [nn.Linear(6, 12), nn.Linear(12, 12), Slow(), nn.Tanh(), Slow(),
            nn.Linear(12, 3)][i].double()


LAYERS = 6


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[layer(i) for i in range(LAYERS)])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 6, dtype=torch.float64, generator=generator),
            torch.randn(8, 3, dtype=torch.float64, generator=generator))


def adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """AdamW with two groups: weights decay, biases do not."""
    return torch.optim.AdamW([
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ], lr=0.01)


def sgd(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)


OPTIMIZERS: dict[str, Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]] = {
    "adamw": adamw, "sgd": sgd}


def by_name(named: list[tuple[str, nn.Parameter]],
            optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Each parameter's value, its optimizer state and its group's weight decay."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return {name: {"value": p.detach().clone(),
                   "state": {k: v.clone() if isinstance(v, torch.Tensor) else v
                             for k, v in optimizer.state.get(p, {}).items()},
                   "decay": groups[id(p)]["weight_decay"] if id(p) in groups else None}
            for name, p in named}


def train(pipe: conveyor.Pipeline, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """STEPS steps; after each, this rank's parameters and state, and the balance."""
    pipe.attach_optimizer(optimizer)
    steps = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step)
        pipe.step(x, y)
        optimizer.step()
        held = sum(len(g["params"]) for g in optimizer.param_groups)
        steps.append({"balance": list(pipe.balance), "held": held,
                      "params": by_name(list(pipe.named_parameters()), optimizer)})
    return steps


@scenario("rebalance_moves")
def rebalance_moves(rank: int, world: int, out_dir: Path) -> None:
    """AdamW (two groups) on an nn.Sequential given whole to every rank, and SGD with
    momentum on a model built by a layer builder, each moved from balance [1, 5]."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    policy = conveyor.Rebalance(window=2, warmup=1, threshold=0.05)
    results = {}
    for name in ("adamw", "sgd"):
        torch.manual_seed(7)
        source: Any = model() if name == "adamw" else layer
        pipe = conveyor.Pipeline(source, layers=None if name == "adamw" else LAYERS,
                                 balance=[1, 5], chunks=4, schedule="1f1b",
                                 loss_fn=nn.functional.mse_loss, rebalance=policy,
                                 timeout=60)
        results[name] = train(pipe, OPTIMIZERS[name](list(pipe.named_parameters())))
    torch.save(results, out_dir / f"rank{rank}.pt")


def plain_model(name: str) -> nn.Sequential:
    """The model each case of the scenario starts from, whole."""
    torch.manual_seed(7)
    return model() if name == "adamw" else sequential(layer, LAYERS)
