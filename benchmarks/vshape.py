"""V-shape schedules: ZB-V and DualPipeV measured against 1F1B and ZB-H1.

For the two models of ``benchmarks/schedules.py``, each on K=2 ranks (CPU threads) with
M=8 micro-batches and no recomputation:

* config P (8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), N=256, MSE loss);
* ``conveyor.train.models.transformer_lm(4, 256, 1024, 4)`` on 32 sequences of 128 bytes;

it times ``Pipeline.step`` for 1f1b, zero-bubble (ZB-H1), zb-v and dualpipe-v,
round-robin in one run, each with the planner's balance (the V shapes cut the model
into 2K = 4 stages, two per rank). Next to each measured step, as a ratio to 1F1B's:

* the planner's prediction (``conveyor.observe.plan.plan``: the simulator under a cost model
  of FLOPs measured on the meta device, I = F, W = F);
* the textbook simulation: every rank's layers cost F = I = W = 1 (``CostModel.per_rank``).

DualPipeV's overlap of a forward with a backward is not modelled and not run: here it
is its order of actions only, one after the other.

    python benchmarks/vshape.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
from schedules import models  # noqa: E402

import conveyor  # noqa: E402
from conveyor.schedules.simulate import CostModel, simulate  # noqa: E402
from conveyor.observe.plan import measure, plan  # noqa: E402
from conveyor.schedules import build  # noqa: E402

STAGES, CHUNKS = 2, 8
SCHEDULES = ["1f1b", "zero-bubble", "zb-v", "dualpipe-v"]
CHECKPOINT = "never"


def predictions(build_model: Any, x: torch.Tensor) -> dict[str, Any]:
    """The planner's plan per schedule (rate 1: only ratios matter here)."""
    with torch.device("meta"):
        figures = measure(build_model(), x.to("meta"))
    return {name: plan(figures, devices=STAGES, memory=float("inf"), batch=x.shape[0],
                       chunks=CHUNKS, schedule=name, rematerialize=False,
                       flops_per_second=1.0)
            for name in SCHEDULES}


def textbook() -> dict[str, float]:
    """Each schedule's simulated step with F = I = W = 1 per rank's layers."""
    steps = {}
    for name in SCHEDULES:
        table = build(name, STAGES, CHUNKS)
        steps[name] = simulate(table, CostModel.per_rank(table)).makespan
    return steps


def run_model(build_model: Any, x: Any, y: Any, loss_fn: Any, rounds: int) -> dict[str, Any]:
    plans = predictions(build_model, x)
    steps = {}
    for name in SCHEDULES:
        torch.manual_seed(0)
        pipe = conveyor.Pipeline(build_model(), stages=STAGES, devices=["cpu"] * STAGES,
                                 chunks=CHUNKS, schedule=name, recompute=CHECKPOINT,
                                 loss_fn=loss_fn, balance=plans[name].balance)

        def step(pipe: conveyor.Pipeline = pipe) -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.step(x, y)

        steps[name] = step
    measured = _common.median_ms(_common.round_robin(steps, rounds))
    simple = textbook()
    return {
        "measured_ms": measured,
        "measured_ratio": {n: measured[n] / measured["1f1b"] for n in SCHEDULES},
        "planner_ratio": {n: plans[n].step_time / plans["1f1b"].step_time for n in SCHEDULES},
        "textbook_ratio": {n: simple[n] / simple["1f1b"] for n in SCHEDULES},
        "balance": {n: plans[n].balance for n in SCHEDULES},
    }


def table(model_name: str, result: dict[str, Any]) -> str:
    rows = [[name, f"{result['measured_ms'][name]:.0f}",
             f"{result['measured_ratio'][name]:.3f}", f"{result['planner_ratio'][name]:.3f}",
             f"{result['textbook_ratio'][name]:.3f}"] for name in SCHEDULES]
    return f"### {model_name}\n\n" + _common.markdown_table(
        ["schedule", "measured (ms)", "measured / 1f1b", "planner / 1f1b",
         "textbook / 1f1b"], rows)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Bars per schedule: measured, planner and textbook step time over 1F1B's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), sharey=True)
    for axis, (model_name, result) in zip(axes, results.items(), strict=True):
        for offset, (key, label) in enumerate([("measured_ratio", "measured"),
                                               ("planner_ratio", "planner"),
                                               ("textbook_ratio", "textbook F=I=W")]):
            axis.bar([i + 0.27 * (offset - 1) for i in range(len(SCHEDULES))],
                     [result[key][n] for n in SCHEDULES], width=0.27, label=label)
        axis.set_xticks(range(len(SCHEDULES)), SCHEDULES)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"{model_name} (K={STAGES}, M={CHUNKS})")
    axes[0].set_ylabel("step time / 1F1B's")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    tables = []
    for model_name, (build_model, x, y, loss_fn) in models().items():
        print(f"{model_name}:", file=sys.stderr)
        results[model_name] = run_model(build_model, x, y, loss_fn, args.rounds)
        tables.append(table(model_name, results[model_name]))
        print(tables[-1] + "\n")
    picture = _common.RESULTS / "vshape.png"
    try:
        plot(results, picture)
    except ImportError:  # matplotlib is optional
        picture = None
    path = _common.write("vshape", {
        "config": {"stages": STAGES, "chunks": CHUNKS, "rounds": args.rounds,
                   "checkpoint": CHECKPOINT},
        "results": results, "table": "\n\n".join(tables),
        "plot": None if picture is None else str(picture.relative_to(_common.ROOT))})
    print(f"wrote {path}" + (f" and {picture}" if picture else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
