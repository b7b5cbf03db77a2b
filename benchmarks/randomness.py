"""What reproducible randomness costs: seeded layer calls against unseeded ones.

Config P with Dropout(0.1) after each GELU, so every layer draws random numbers, N=256,
M=8, checkpoint except_last (so recomputation replays the masks). Two paths:

* K=1: the stage owns the CPU generator; each layer call reseeds it (~1 us).
* K=2 on CPU threads: the stages share the CPU generator, so random ops are routed to
  a private generator by a dispatch mode around the submodules that draw (here the
  Dropout of each block).

Each is timed against the same pipeline with seeding switched off (layer calls draw
from the global generator, as torchgpipe did; not reproducible, and not safe with
threads), interleaved in one run. Whole steps vary by a few percent on a shared
machine, more than seeding costs, so the cost per layer call is also measured
directly: one block (4 ops, one of them random) on one micro-batch, called many times.

    python benchmarks/randomness.py           # about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from conveyor import GPipe  # noqa: E402
from conveyor.engine.recompute.rng import LayerRandomness  # noqa: E402

BATCH, WIDTH, CHUNKS = 256, 512, 8


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(8)
    ])


_seeded_layer_call = LayerRandomness.layer_call


@contextlib.contextmanager
def _unseeded_layer_call(self: LayerRandomness, step_seed: int, index: int,
                         microbatch: int, layer: nn.Module) -> Iterator[None]:
    yield


def per_call_microseconds(blocks: int = 7, calls_per_block: int = 200) -> dict[str, float]:
    """Microseconds of one block's forward: plain, and under each seeding path.

    Each variant runs ``calls_per_block`` calls in a row, variants take turns for
    ``blocks`` rounds, and the result is the median of the per-block medians. (Turns
    call by call made whichever variant followed the reseeding one look 100-200 us
    slower, a cost none of them shows on its own.)
    """
    block = model()[0]
    x = torch.randn(BATCH // CHUNKS, WIDTH)
    exclusive = LayerRandomness(torch.device("cpu"), shared=False)
    shared = LayerRandomness(torch.device("cpu"), shared=True)

    def plain() -> None:
        block(x)

    def reseeded() -> None:
        with exclusive.layer_call(1, 0, 0, block):
            block(x)

    def routed() -> None:
        with shared.layer_call(1, 0, 0, block):
            block(x)

    calls = {"plain": plain, "reseed": reseeded, "dispatch mode": routed}
    block_medians: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad(), exclusive.preserved():
        for block_index in range(blocks + 1):  # the first round is warm-up
            for name, call in calls.items():
                samples = []
                for _ in range(calls_per_block):
                    start = time.perf_counter()
                    call()
                    samples.append(time.perf_counter() - start)
                if block_index:
                    block_medians[name].append(statistics.median(samples))
    return {name: statistics.median(values) * 1e6 for name, values in block_medians.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step(pipe: GPipe, seeded: bool):  # type: ignore[no-untyped-def]
        def run() -> None:
            LayerRandomness.layer_call = _seeded_layer_call if seeded else _unseeded_layer_call
            try:
                pipe.zero_grad(set_to_none=True)
                nn.functional.mse_loss(pipe(x), y).backward()
            finally:
                LayerRandomness.layer_call = _seeded_layer_call
        return run

    configs = {}
    for stages in (1, 2):
        pipe = GPipe(model(), [8 // stages] * stages, devices=["cpu"] * stages, chunks=CHUNKS)
        configs[f"K={stages} seeded"] = step(pipe, True)
        configs[f"K={stages} unseeded"] = step(pipe, False)
    times = _common.round_robin(configs, args.rounds)
    ms = _common.median_ms(times)
    rows, results = [], []
    for stages in (1, 2):
        seeded, unseeded = ms[f"K={stages} seeded"], ms[f"K={stages} unseeded"]
        path = "reseed the device generator" if stages == 1 else "dispatch mode on Dropout"
        results.append({"stages": stages, "path": path, "seeded_ms": seeded,
                         "unseeded_ms": unseeded, "overhead": seeded / unseeded - 1})
        rows.append([stages, path, f"{unseeded:.0f}", f"{seeded:.0f}",
                     f"{100 * (seeded / unseeded - 1):+.1f}%"])
    table = _common.markdown_table(
        ["K", "seeding path", "unseeded step (ms)", "seeded step (ms)", "difference"], rows)
    calls = per_call_microseconds()
    call_rows = [[name, f"{us:.1f}", f"{us - calls['plain']:+.1f}",
                  f"{100 * (us / calls['plain'] - 1):+.1f}%"] for name, us in calls.items()]
    call_table = _common.markdown_table(
        ["one block on one micro-batch", "us", "cost (us)", "cost"], call_rows)
    print(table + "\n\n" + call_table)
    out = _common.write("randomness", {"config": {"batch": BATCH, "chunks": CHUNKS,
                                                  "rounds": args.rounds},
                                       "median_ms": ms, "results": results,
                                       "per_call_us": calls, "table": table,
                                       "per_call_table": call_table})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
