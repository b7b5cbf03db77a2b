"""What "never hang, always explain" costs a step: the ranks' positions and the watch.

Config P (8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), N=256, MSE loss) on 2
stages (CPU threads), 1F1B, 8 micro-batches. Two ways, in one run:

* **A/B**: the same pipeline's step with its bookkeeping and without it (the position
  moves of every action and receive, the ``Awaited`` of each receive, and the caller's
  watch that joins the rank threads every 0.25 s, all replaced by nothing or a plain
  join), timed in turn, round after round (``_common.round_robin``). On 2 shared cores
  the noise of a step is larger than 1%, so this bounds the cost rather than pins it.
* **Counted**: the bookkeeping of one action with one receive, timed alone over many
  repetitions, times the actions and receives of a step, divided by the step's time.

    python benchmarks/hang_bookkeeping.py [--rounds 30]

Writes ``benchmarks/results/hang_bookkeeping.json``. Under torchrun a rank also has an
answering thread that reads two counters from the store twice a second, and each
message's header carries its step in a field that was unused: neither is measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor.engine import executor as executor_module  # noqa: E402
from conveyor.engine.watchdog.position import Awaited, Position  # noqa: E402
from conveyor.engine.watchdog.threads import WatchedRanks  # noqa: E402
from conveyor.train.models import feed_forward_stack  # noqa: E402
from conveyor.schedules import Action, Kind  # noqa: E402

STAGES, CHUNKS, BATCH = 2, 8, 256
MOVES = ("begin", "awaiting", "arrived", "end")


@contextlib.contextmanager
def without_bookkeeping() -> Iterator[None]:
    """The executor as it ran before positions and the watch: every position move does
    nothing, a receive builds no ``Awaited``, and the caller joins its threads plainly."""
    saved: dict[str, Any] = {name: getattr(Position, name) for name in MOVES}
    watch, awaited = WatchedRanks._watch, executor_module.Awaited

    def join(self: WatchedRanks, threads: Any, step: int) -> None:
        for thread in threads.values():
            thread.join()

    for name in MOVES:
        setattr(Position, name, lambda self, *args: None)
    WatchedRanks._watch = join  # type: ignore[method-assign]
    executor_module.Awaited = lambda *args: None  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Position, name, method)
        WatchedRanks._watch = watch  # type: ignore[method-assign]
        executor_module.Awaited = awaited  # type: ignore[misc]


def per_action_seconds(repeats: int = 200_000) -> float:
    """The bookkeeping of one action that waits for one message, timed alone."""
    action = Action(1, Kind.FORWARD, 0)
    position = Position(1, [action] * repeats)
    start = time.perf_counter()
    for _ in range(repeats):
        position.begin(action)
        position.awaiting(Awaited("activation", 0, 0, 1, 0))
        position.arrived()
        position.end()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    pipe = conveyor.Pipeline(feed_forward_stack(8, 512, 2048), stages=STAGES, chunks=CHUNKS,
                             schedule="1f1b", loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(BATCH, 512), torch.randn(BATCH, 512)

    def with_it() -> None:
        pipe.step(x, y)

    def without_it() -> None:
        with without_bookkeeping():
            pipe.step(x, y)

    print(f"config P, {STAGES} stages, 1F1B, {CHUNKS} micro-batches, "
          f"{args.rounds} rounds", file=sys.stderr)
    times = _common.round_robin({"with": with_it, "without": without_it}, args.rounds)
    ms = _common.median_ms(times)
    paired = sorted(a / b for a, b in zip(times["with"], times["without"]))
    action = per_action_seconds()
    actions = 2 * STAGES * CHUNKS  # F and B of every micro-batch on every stage
    counted = actions * action / (ms["without"] / 1e3)
    result = {
        "config": {"model": "config P", "stages": STAGES, "chunks": CHUNKS, "batch": BATCH,
                   "schedule": "1f1b", "rounds": args.rounds},
        "load_average": os.getloadavg(),
        "step_ms": ms,
        "ratio_of_medians": ms["with"] / ms["without"],
        "median_of_paired_ratios": paired[len(paired) // 2],
        "per_action_us": action * 1e6,
        "actions_per_step": actions,
        "counted_fraction_of_step": counted,
    }
    path = _common.write("hang_bookkeeping", result)
    print(_common.markdown_table(
        ["", "with", "without", "ratio"],
        [["median step (ms)", f"{ms['with']:.1f}", f"{ms['without']:.1f}",
          f"{ms['with'] / ms['without']:.4f}"]]))
    print(f"median of paired ratios: {result['median_of_paired_ratios']:.4f}")
    print(f"counted: {action * 1e6:.2f} us per action x {actions} actions = "
          f"{counted:.5%} of a step")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
