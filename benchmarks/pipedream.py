"""PipeDream's planner against a balance by compute alone, over an emulated slow link.

    python benchmarks/pipedream.py            # about half a minute on 2 cores
    python benchmarks/pipedream.py --quick    # narrower blocks, fewer steps

The model has one wide activation boundary: eight equal blocks (Linear(d, 4d)-GELU-
Linear(4d, d)), the fourth of which widens its output R times (an upsampling block) and
the fifth narrows it back. Balancing by time alone cuts two stages 4|4, exactly at the
wide boundary. The planner (``conveyor.planner.solve``) sees the link: between two CPU
threads, an emulated link (``conveyor.engine.transport.emulated_links``) whose
bandwidth is set so that moving one wide micro-batch takes about twice a stage's
compute. Both cuts run as pipelines of two CPU threads (one intra-op thread each, M=8,
the schedule the planner chose, no recomputation), timed in turn, in the same run.

Reported (``benchmarks/results/pipedream.json``): each plan's measured and predicted
step, ``prediction_error`` = |predicted - measured| / measured per plan, and
``speedup_vs_compute_only`` = the compute-only cut's measured step over the planner's.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor.engine.transport import emulated_links  # noqa: E402
from conveyor.graph.balance import solve_balance  # noqa: E402
from conveyor.planner import Cluster, Level, evaluate, profile_model, solve  # noqa: E402

CHUNKS = 8


class Block(nn.Module):
    """A feed-forward block; ``widen`` repeats its output R times along features,
    ``narrow`` averages R repeats back before it runs."""

    def __init__(self, width: int, widen: int = 1, narrow: int = 1) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.widen, self.narrow = widen, narrow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.narrow > 1:
            x = x.unflatten(-1, (self.narrow, -1)).mean(-2)
        x = x + self.mlp(x)
        return x.repeat(1, self.widen) if self.widen > 1 else x


def model(width: int, wide: int) -> nn.Sequential:
    return nn.Sequential(*[Block(width) for _ in range(3)], Block(width, widen=wide),
                         Block(width, narrow=wide), *[Block(width) for _ in range(3)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller steps")
    parser.add_argument("--rounds", type=int, help="timed steps per plan")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per stage thread; the profile is taken so too
    torch.manual_seed(0)
    width, wide = (512, 16) if args.quick else (768, 16)
    micro = 16
    batch = micro * CHUNKS
    rounds = args.rounds or (5 if args.quick else 10)
    net = model(width, wide)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    print("profiling ...", file=sys.stderr, flush=True)
    profile = profile_model(net, x[:micro], name="widening", repeat=10)
    compute = [layer.forward + layer.backward for layer in profile.layers]
    half = micro * sum(compute) / 2
    wide_bytes = micro * profile.layers[3].output_bytes
    bandwidth = wide_bytes / (2 * half)  # one wide micro-batch: two stages' compute
    cluster = Cluster((Level("threads", 2, bandwidth, 1e-4),), memory=16e9, flops=1e10)

    planned = solve(profile, cluster, batch=batch, chunk_options=[CHUNKS], replicate=False,
                    schedules=("gpipe", "1f1b"))[0]
    compute_only = evaluate(profile, cluster, batch=batch, schedule=planned.schedule,
                            chunks=CHUNKS, balance=solve_balance(compute, 2))
    print(planned.describe(), file=sys.stderr)
    print(compute_only.describe(), file=sys.stderr)

    pipes: dict[str, Any] = {}
    for name, plan in (("planner", planned), ("compute only", compute_only)):
        options = plan.pipeline_options()
        options["recompute"] = "never"
        del options["data_parallel"]
        pipes[name] = conveyor.Pipeline(copy.deepcopy(net), loss_fn=nn.functional.mse_loss,
                                        devices=["cpu"] * len(plan.stages), **options)

    def step(pipe: Any) -> Any:
        return lambda: pipe.step(x, y)

    with emulated_links(bandwidth=bandwidth, latency=1e-4):
        times = _common.round_robin({name: step(pipe) for name, pipe in pipes.items()},
                                    rounds)
    results: dict[str, Any] = {}
    for name, plan in (("planner", planned), ("compute only", compute_only)):
        measured = _common.median(times[name])
        results[name] = {
            "balance": plan.balance, "schedule": plan.schedule, "chunks": plan.chunks,
            "measured_step_s": measured, "predicted_step_s": plan.step_time,
            "prediction_error": abs(plan.step_time - measured) / measured,
            "bottleneck": plan.bottleneck, "steps_s": times[name]}
    speedup = results["compute only"]["measured_step_s"] / results["planner"]["measured_step_s"]
    payload = {
        "model": f"8 blocks of width {width}, block 3 widens its output x{wide}",
        "micro_batch": micro, "chunks": CHUNKS, "link_bandwidth_bytes_s": bandwidth,
        "link_latency_s": 1e-4, "profile_source": profile.source,
        "speedup_vs_compute_only": speedup,
        "prediction_error": {name: r["prediction_error"] for name, r in results.items()},
        "plans": results, "quick": args.quick, "date": time.strftime("%Y-%m-%d")}
    path = _common.write("pipedream", payload)
    rows = [[name, r["balance"], f"{1e3 * r['measured_step_s']:.1f}",
             f"{1e3 * r['predicted_step_s']:.1f}", f"{100 * r['prediction_error']:.1f}%"]
            for name, r in results.items()]
    print(_common.markdown_table(["cut", "balance", "measured ms", "predicted ms", "error"],
                                 rows))
    print(f"speedup_vs_compute_only: {speedup:.2f}   ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
