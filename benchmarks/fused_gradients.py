"""What fused weight gradients save: one stage's column, fused against autograd's.

A stage of 4 blocks of Linear(W, 4W)-GELU-Linear(4W, W) runs M=8 micro-batches of R rows
on one thread as GPipe runs a stage: M forwards, then M backwards into ``.grad`` (set to
None first). Once with autograd's accumulation (each micro-batch's weight gradient made,
then added into ``.grad``), once with conveyor's fused accumulation
(``conveyor.engine.backward.accumulation``: the product adds itself into ``.grad``), timed in
turn round after round. The wider the layers and the fewer the rows, the larger the
share of the separate additions.

    python benchmarks/fused_gradients.py [--rounds 15]

Writes ``benchmarks/results/fused_gradients.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from conveyor.engine.backward.accumulation import FusedAccumulation  # noqa: E402

SHAPES = [(160, 16), (160, 128), (512, 32), (1024, 32), (2048, 8)]  # (width W, rows R)
MICROBATCHES, BLOCKS = 8, 4


def column(width: int, rows: int, *, fused: bool) -> Callable[[], None]:
    """One stage's forwards and backwards over the micro-batches."""
    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                          nn.Linear(4 * width, width))
                            for _ in range(BLOCKS)])
    fusion = FusedAccumulation(stage.modules()) if fused else None
    inputs = [torch.randn(rows, width) for _ in range(MICROBATCHES)]

    def run() -> None:
        stage.zero_grad(set_to_none=True)
        with fusion.layers() if fusion else contextlib.nullcontext():
            outputs = [stage(x) for x in inputs]
        with fusion.backward() if fusion else contextlib.nullcontext():
            for output in reversed(outputs):
                output.backward(torch.ones_like(output))
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = {f"{kind} W={width} R={rows}": column(width, rows, fused=kind == "fused")
               for width, rows in SHAPES for kind in ("autograd", "fused")}
    ms = _common.median_ms(_common.round_robin(configs, args.rounds))
    rows, results = [], []
    for width, rows_per in SHAPES:
        plain, fused = ms[f"autograd W={width} R={rows_per}"], ms[f"fused W={width} R={rows_per}"]
        weights = BLOCKS * 2 * 4 * width * width * 4 / 2**20
        results.append({"width": width, "rows": rows_per, "weights_mib": weights,
                        "autograd_ms": plain, "fused_ms": fused})
        rows.append([width, rows_per, f"{weights:.1f}", f"{plain:.1f}", f"{fused:.1f}",
                     f"{plain / fused:.2f}x"])
    table = _common.markdown_table(
        ["width W", "rows per micro-batch", "stage's weights (MiB)",
         "autograd's accumulation (ms)", "fused (ms)", "fused faster by"], rows)
    print(table)
    path = _common.write("fused_gradients", {
        "config": {"blocks": BLOCKS, "microbatches": MICROBATCHES, "threads": 1,
                   "rounds": args.rounds},
        "results": results, "table": table})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
