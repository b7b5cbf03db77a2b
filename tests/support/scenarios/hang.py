"""Multi-process scenarios of a step that fails and of the steps after it
(tests/test_hang_ranks.py; faults of every kind are generated: tests/faults).

Each rank writes ``rank{r}.json``: per step, the loss and the plain model's, or the
error with its report (``where``) and the seconds the step took. A ``Trap`` layer ends
each stage and does what the scenario plants, on one rank, in one step.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import conveyor
from conveyor.engine.watchdog.deadline import Deadlines
from tests.support.scenarios import scenario

FLOOR = 3.0  # the fitted timeout of a step after the first two, at least
STEP = 0  # the step the scenario runs, read by the traps


class Trap(nn.Module):
    """Passes its input on, except where ``plan[(step, n)]`` says what to do in the
    n-th forward (from 1, recomputations left out) of a step on this stage's rank:
    "raise", "shape" (drops two features), "kill" (SIGKILL), "freeze" (SIGSTOP) or
    "loop" (an endless loop until the file ``release`` exists, or 60 s)."""

    def __init__(self, plan: dict[tuple[int, int], str], release: Path) -> None:
        super().__init__()
        self.plan, self.release = plan, release
        self.step, self.calls = 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if conveyor.is_recomputing():
            return x
        if self.step != STEP:
            self.step, self.calls = STEP, 0
        self.calls += 1
        how = self.plan.get((STEP, self.calls))
        if how == "raise":
            raise ValueError("planted failure")
        if how == "shape":
            return x[:, :4]
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "freeze":
            (self.release.parent / "frozen.pid").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if how == "loop":
            deadline = time.monotonic() + 60
            while not self.release.exists() and time.monotonic() < deadline:
                sum(range(1000))
        return x


def _run(rank: int, world: int, out_dir: Path, plans: dict[int, dict[tuple[int, int], str]],
         steps: int) -> None:
    """Stages of Linear, Linear, Trap (planned by ``plans[stage]``) under 1F1B with 4
    micro-batches, in float64; runs ``steps`` steps, noting each one's loss or error,
    and raises the last error (the process exits non-zero, as a user's would)."""
    global STEP
    torch.manual_seed(0)
    release = out_dir / "release"
    layers: list[nn.Module] = []
    for stage in range(world):
        layers += [nn.Linear(6, 6), nn.Linear(6, 6), Trap(plans.get(stage, {}), release)]
    model = nn.Sequential(*layers).double()
    plain = copy.deepcopy(nn.Sequential(*[nn.Identity() if isinstance(layer, Trap) else layer
                                          for layer in model]))
    Deadlines.floor = FLOOR  # fitted timeouts, as by default, with a lower floor than 30 s
    pipe = conveyor.Pipeline(model, chunks=4, schedule="1f1b", balance=[3] * world,
                             loss_fn=nn.functional.mse_loss)
    found: list[dict[str, Any]] = []
    error: BaseException | None = None
    for STEP in range(1, steps + 1):
        generator = torch.Generator().manual_seed(STEP)
        inputs = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        targets = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        start = time.monotonic()
        try:
            loss = pipe.step(inputs, targets)
        except conveyor.ConveyorError as exc:
            error = exc
            found.append({"error": str(exc), "type": type(exc).__name__,
                          "where": getattr(exc, "where", None),
                          "seconds": time.monotonic() - start})
        else:
            plain.zero_grad()
            expected = nn.functional.mse_loss(plain(inputs), targets)
            expected.backward()
            wanted = dict(plain.named_parameters())
            errors = [float((p.grad - wanted[name].grad).norm() / wanted[name].grad.norm())
                      for name, p in pipe.named_parameters()]
            found.append({"loss": float(loss), "plain": float(expected),
                          "gradient_error": max(errors)})
        pipe.zero_grad()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))
    if rank == 0:
        release.touch()
        frozen = out_dir / "frozen.pid"
        if frozen.exists():  # a stopped process outlives everything but SIGKILL
            os.kill(int(frozen.read_text()), signal.SIGKILL)
    if error is not None:
        raise error


@scenario("hang_recover")
def hang_recover(rank: int, world: int, out_dir: Path) -> None:
    """Step 2: the last stage raises in its third forward (micro-batch 2). Step 4: stage
    0's output loses two features, so stage 1 fails. Steps 3 and 5 run as if nothing
    happened (the failed steps' messages are drained)."""
    _run(rank, world, out_dir, {world - 1: {(2, 3): "raise"}, 0: {(4, 1): "shape"}}, 5)


class _Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


@scenario("slow_rank")
def slow_rank(rank: int, world: int, out_dir: Path) -> None:
    """GPipe with a 2 s timeout, the last rank 0.8 s per forward: rank 0 waits some 4 s
    for its first gradient, while the last rank computes. Each rank writes its losses."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(world):
        layers += [nn.Linear(4, 4), _Slow(0.8 if k == world - 1 else 0.0)]
    pipe = conveyor.Pipeline(nn.Sequential(*layers), chunks=4, balance=[2] * world,
                             schedule="gpipe", recompute="never", timeout=2,
                             loss_fn=nn.functional.mse_loss)
    losses = [float(pipe.step(torch.randn(8, 4), torch.randn(8, 4))) for _ in range(2)]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(losses))
