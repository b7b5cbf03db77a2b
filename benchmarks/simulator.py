"""Predicted against measured: the simulator fed with a profiled cost model.

For each schedule, on config P (8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512),
N=256) with K=2 stages on CPU threads and M=8: one recorded step gives each stage's
mean compute per kind of action (the cost model); the simulator predicts the step; the
median of measured steps (recording off) is compared with it. The same run measures
what recording costs (steps with and without it, interleaved) and draws the predicted
step above the measured one for 1F1B.

    python benchmarks/simulator.py            # about 2 minutes
"""

from __future__ import annotations

import argparse
import sys

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor.train.models import feed_forward_stack  # noqa: E402
from conveyor.schedules.simulate import CostModel, simulate  # noqa: E402
from conveyor.schedules.timeline import plot_timelines  # noqa: E402

BATCH, WIDTH, CHUNKS, STAGES = 256, 512, 8, 2
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    pipes = {}
    for name, virtual in SCHEDULES:
        torch.manual_seed(0)
        pipes[name] = conveyor.Pipeline(
            feed_forward_stack(8, WIDTH, 4 * WIDTH), stages=STAGES, devices=["cpu"] * STAGES,
            chunks=CHUNKS, schedule=name, virtual_stages=virtual, recompute="never",
            loss_fn=nn.functional.mse_loss)

    def step(pipe: conveyor.Pipeline):  # type: ignore[no-untyped-def]
        def run() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.step(x, y)
        return run

    def recorded(pipe: conveyor.Pipeline):  # type: ignore[no-untyped-def]
        def run() -> None:
            with conveyor.record(pipe):
                step(pipe)()
        return run

    predicted, profiles, cost_models = {}, {}, {}
    for name, pipe in pipes.items():
        step(pipe)()  # warm-up
        with conveyor.record(pipe) as timeline:
            step(pipe)()
        profiles[name] = timeline
        cost_models[name] = CostModel.from_timeline(timeline, pipe.schedule.num_stages)
        predicted[name] = simulate(pipe.schedule, cost_models[name])

    configs = {f"{name} measured": step(pipe) for name, pipe in pipes.items()}
    configs["1f1b recorded"] = recorded(pipes["1f1b"])
    times = _common.round_robin(configs, args.rounds)
    ms = _common.median_ms(times)

    rows, results = [], []
    for name, _ in SCHEDULES:
        guess, seen = predicted[name].makespan * 1e3, ms[f"{name} measured"]
        results.append({"schedule": name, "predicted_ms": guess, "measured_ms": seen,
                        "predicted_over_measured": guess / seen,
                        "predicted_bubble": predicted[name].bubble,
                        "cost_model": cost_models[name].to_dict()})
        rows.append([name, f"{guess:.0f}", f"{seen:.0f}", f"{guess / seen:.3f}",
                     f"{100 * predicted[name].bubble:.1f}%"])
    overhead = ms["1f1b recorded"] / ms["1f1b measured"] - 1
    table = _common.markdown_table(
        ["schedule", "predicted (ms)", "measured (ms)", "predicted / measured",
         "predicted bubble"], rows)
    table += (f"\n\nrecording every action costs {100 * overhead:+.1f}% of a 1F1B step "
              f"({ms['1f1b recorded']:.0f} ms recorded, {ms['1f1b measured']:.0f} ms not)")
    print(table)
    picture = _common.RESULTS / "timeline_1f1b.png"
    plot_timelines([predicted["1f1b"].timeline, profiles["1f1b"]], picture,
                   titles=["predicted 1f1b", "measured 1f1b"])
    profiles["1f1b"].save_chrome_trace(_common.RESULTS / "timeline_1f1b.trace.json")
    path = _common.write("simulator", {
        "config": {"batch": BATCH, "width": WIDTH, "chunks": CHUNKS, "stages": STAGES,
                   "rounds": args.rounds},
        "median_ms": ms, "results": results, "recording_overhead": overhead,
        "table": table,
    })
    print(f"\nwrote {path}, {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
