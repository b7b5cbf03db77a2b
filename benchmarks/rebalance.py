"""Re-balancing while training: a badly balanced start reaches the balanced step time.

Config P (8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), N=256, MSE loss) on
K=2 CPU threads, 1F1B over M=8 micro-batches, without recomputation. Two pipelines
train side by side, their steps interleaved round-robin (so that both see the same
moments of the machine):

* ``balanced``: balance [4, 4] from the start;
* ``rebalanced``: balance [2, 6] with ``rebalance=conveyor.Rebalance(window=8)``.
  After one warm-up step and a window of measured steps it moves layers between the
  stages (the log says why), and its step time is measured again.

Reported: the median step time of the imbalanced pipeline before the move and after
it, each over the rounds it shared with the balanced pipeline, divided by the balanced
pipeline's median over the same rounds; the claim is after / balanced <= 1.05. One recorded
step of each (before, after, balanced) is drawn to ``results/rebalance_timeline.png``.

    python benchmarks/rebalance.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor.train.models import feed_forward_stack  # noqa: E402

STAGES, CHUNKS, BATCH = 2, 8, 256
START, BALANCED = [2, 6], [4, 4]
TARGET = 1.05
RECORDED = 3  # recorded steps per pipeline, before and after the move


def pipeline(balance: list[int], rebalance: Any) -> tuple[conveyor.Pipeline, Any]:
    torch.manual_seed(0)
    pipe = conveyor.Pipeline(feed_forward_stack(8, 512, 2048), stages=STAGES,
                             devices=["cpu"] * STAGES, chunks=CHUNKS, schedule="1f1b",
                             recompute="never", loss_fn=nn.functional.mse_loss,
                             balance=balance, rebalance=rebalance)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3, momentum=0.9)
    pipe.attach_optimizer(optimizer)
    return pipe, optimizer


def stepper(pipe: conveyor.Pipeline, optimizer: Any, x: torch.Tensor,
            y: torch.Tensor) -> Any:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipe.step(x, y)
        optimizer.step()
    return step


def recorded(pipes: dict[str, tuple[conveyor.Pipeline, Any]]) -> dict[str, conveyor.Timeline]:
    """Per pipeline, the step of median length among RECORDED recorded steps (steps
    interleaved): one step alone may fall on a moment the machine is busy elsewhere."""
    found: dict[str, list[conveyor.Timeline]] = {name: [] for name in pipes}
    for _ in range(RECORDED):
        for name, (pipe, step) in pipes.items():
            with conveyor.record(pipe) as timeline:
                step()
            found[name].append(timeline)
    return {name: sorted(timelines, key=lambda t: t.makespan)[RECORDED // 2]
            for name, timelines in found.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("conveyor").addHandler(handler)
    logging.getLogger("conveyor").setLevel(logging.INFO)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 512, generator=generator)
    y = torch.randn(BATCH, 512, generator=generator)
    policy = conveyor.Rebalance(window=args.window, warmup=1, threshold=0.1)
    moving, moving_optimizer = pipeline(START, policy)
    balanced, balanced_optimizer = pipeline(BALANCED, None)
    move = stepper(moving, moving_optimizer, x, y)
    even = stepper(balanced, balanced_optimizer, x, y)

    # Its warm-up step, then window - RECORDED measured steps, then RECORDED recorded
    # ones (the end of the window); the next step starts with the move.
    if args.window <= RECORDED:
        parser.error(f"--window must be more than {RECORDED}")
    print("before the move:", file=sys.stderr)
    before = _common.round_robin({"balanced": even, "before": move}, args.window - RECORDED)
    timelines = recorded({"before": (moving, move)})
    assert moving.balance == START, moving.balance
    print("after the move:", file=sys.stderr)
    after = _common.round_robin({"balanced": even, "after": move}, args.rounds)
    moved_to = list(moving.balance)
    timelines.update(recorded({"after": (moving, move), "balanced": (balanced, even)}))
    # Each phase against the balanced pipeline's steps of the same rounds.
    measured = _common.median_ms({"before": before["before"], "after": after["after"],
                                  "balanced (before)": before["balanced"],
                                  "balanced (after)": after["balanced"]})
    ratios = {"before / balanced": measured["before"] / measured["balanced (before)"],
              "after / balanced": measured["after"] / measured["balanced (after)"]}
    rows = [[f"imbalanced {START}, before the move", f"{measured['before']:.0f}",
             f"{measured['balanced (before)']:.0f}", f"{ratios['before / balanced']:.3f}"],
            [f"after the move, {moved_to}", f"{measured['after']:.0f}",
             f"{measured['balanced (after)']:.0f}", f"{ratios['after / balanced']:.3f}"]]
    table = _common.markdown_table(
        ["pipeline", "step (ms)", f"balanced {BALANCED}, same rounds (ms)", "ratio"], rows)
    lines = [line for line in log.getvalue().splitlines() if line.startswith("rebalanced")]
    reached = ratios["after / balanced"] <= TARGET
    print(table)
    print("\n".join(lines))
    print(f"after / balanced = {ratios['after / balanced']:.3f} "
          f"({'within' if reached else 'NOT within'} {TARGET - 1:.0%})")
    png = _common.RESULTS / "rebalance_timeline.png"
    conveyor.plot_timelines(list(timelines.values()), png, titles=[
        f"before the move: balance {START}", f"after the move: balance {moved_to}",
        f"balanced from the start: {BALANCED}"])
    path = _common.write("rebalance", {
        "config": {"model": "config P", "stages": STAGES, "chunks": CHUNKS, "batch": BATCH,
                   "schedule": "1f1b", "checkpoint": "never", "start": START,
                   "window": args.window, "rounds": args.rounds, "threshold": 0.1},
        "moved_to": moved_to, "log": lines, "measured_ms": measured, "ratios": ratios,
        "target": TARGET, "reached": reached, "table": table,
        # On a machine busy elsewhere (load above its cores) the idle stage's core goes to
        # others: balance then hardly matters, and the ratios say little.
        "load_average_1min": os.getloadavg()[0],
        "timeline": str(png.relative_to(_common.ROOT))})
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
