"""PipeDream's planner against a balance by compute alone, over an emulated slow link.

    python benchmarks/pipedream.py            # about a minute on 2 cores
    python benchmarks/pipedream.py --quick    # threads, the headline link only (15 s)

The model has one wide activation boundary: eight equal blocks (Linear(d, 4d)-GELU-
Linear(4d, d)), the fourth of which widens its output R times (an upsampling block) and
the fifth narrows it back. Balancing by time alone cuts two stages 4|4, exactly at the
wide boundary. The planner (``conveyor.planner.solve``) sees the link: an emulated link
(``conveyor.engine.transport.emulated_links``) whose bandwidth makes one wide
micro-batch take a quarter of, as long as, or twice (the headline) a stage's compute.
Both cuts run as two CPU threads for each link, then as two processes under torchrun
(gloo) for the headline link: one intra-op thread each, M=8, the schedule the planner
chose, no recomputation, the two plans' steps timed in turn (between barriers, under
torchrun). The profile is taken while another thread computes, as the other stage will.

Reported (``benchmarks/results/pipedream.json``): each plan's measured and predicted
step, ``prediction_error`` = |predicted - measured| / measured per plan, and
``speedup_vs_compute_only`` = the compute-only cut's measured step over the planner's;
the top-level figures are the headline link's between processes (threads, with
``--quick``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
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
WIDE = 16  # how many times the fourth block widens its output
LATENCY = 1e-4
HEADLINE = 2.0  # the link of the headline figure: a wide micro-batch, two stages' compute


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


def plans_for(profile: Any, slowness: float, batch: int, processes: bool
              ) -> tuple[float, dict[str, Any]]:
    """The link's bandwidth, on which one wide micro-batch takes ``slowness`` times a
    stage's compute (half the model's), and the planner's and the compute-only cuts."""
    micro = batch // CHUNKS
    compute = [layer.forward + layer.backward for layer in profile.layers]
    wide_bytes = micro * profile.layers[3].output_bytes
    bandwidth = wide_bytes / (slowness * micro * sum(compute) / 2)
    cluster = Cluster((Level("link", 2, bandwidth, LATENCY),), memory=16e9, flops=1e10)
    found = solve(profile, cluster, batch=batch, chunk_options=[CHUNKS], replicate=False,
                  schedules=("gpipe", "1f1b"))
    # Two processes run two stages: a plan of one would leave one idle.
    planned = next(p for p in found if len(p.stages) == 2) if processes else found[0]
    compute_only = evaluate(profile, cluster, batch=batch, schedule=planned.schedule,
                            chunks=CHUNKS, balance=solve_balance(compute, 2))
    return bandwidth, {"planner": planned, "compute only": compute_only}


def _options(plan: Any) -> dict[str, Any]:
    options = plan.pipeline_options()
    options["recompute"] = "never"
    del options["data_parallel"]
    return options


def time_threads(net: nn.Sequential, plans: dict[str, Any], bandwidth: float,
                 x: torch.Tensor, y: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    steps = {}
    for name, plan in plans.items():
        pipe = conveyor.Pipeline(copy.deepcopy(net), loss_fn=nn.functional.mse_loss,
                                 devices=["cpu"] * len(plan.stages), **_options(plan))
        steps[name] = lambda pipe=pipe: pipe.step(x, y)
    with emulated_links(bandwidth=bandwidth, latency=LATENCY):
        return _common.round_robin(steps, rounds)


def time_processes(plans: dict[str, Any], bandwidth: float, width: int, wide: int,
                   rounds: int) -> dict[str, list[float]]:
    """Runs this script under torchrun, two processes, each timing every plan's step
    between barriers (so, by the slower process); rank 0's times."""
    with tempfile.TemporaryDirectory() as folder:
        spec = Path(folder) / "spec.json"
        spec.write_text(json.dumps({
            "width": width, "wide": wide, "bandwidth": bandwidth, "rounds": rounds,
            "options": {name: _options(plan) for name, plan in plans.items()},
            "out": str(Path(folder) / "times.json")}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", __file__, "--worker", str(spec)],
                       env=env, check=True)
        return dict(json.loads((Path(folder) / "times.json").read_text()))


def worker(spec_path: str) -> int:
    """One process of :func:`time_processes`."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = model(spec["width"], spec["wide"])
    x, y = (torch.randn(16 * CHUNKS, spec["width"]), torch.randn(16 * CHUNKS, spec["width"]))
    pipes = {name: conveyor.Pipeline(copy.deepcopy(net), loss_fn=nn.functional.mse_loss,
                                     timeout=120, **options)
             for name, options in spec["options"].items()}

    def between_barriers(pipe: Any) -> Callable[[], None]:
        def step() -> None:
            dist.barrier()
            pipe.step(x, y)
            dist.barrier()
        return step

    with emulated_links(bandwidth=spec["bandwidth"], latency=LATENCY):
        times = _common.round_robin({name: between_barriers(pipe)
                                     for name, pipe in pipes.items()}, spec["rounds"],
                                    progress=dist.get_rank() == 0)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(times))
    dist.destroy_process_group()
    return 0


def compare(net: nn.Sequential, profile: Any, slowness: float, x: torch.Tensor,
            y: torch.Tensor, rounds: int, processes: bool) -> dict[str, Any]:
    """The planner's cut and the compute-only one, measured over a link on which one
    wide micro-batch takes ``slowness`` times a stage's compute."""
    bandwidth, plans = plans_for(profile, slowness, x.shape[0], processes)
    print(f"link: a wide micro-batch takes {slowness:g}x a stage's compute"
          f"{' (processes)' if processes else ''}", file=sys.stderr)
    times = (time_processes(plans, bandwidth, x.shape[1], WIDE, rounds) if processes
             else time_threads(net, plans, bandwidth, x, y, rounds))
    results: dict[str, Any] = {}
    for name, plan in plans.items():
        measured = _common.median(times[name])
        results[name] = {
            "balance": plan.balance, "schedule": plan.schedule, "chunks": plan.chunks,
            "measured_step_s": measured, "predicted_step_s": plan.step_time,
            "prediction_error": abs(plan.step_time - measured) / measured,
            "bottleneck": plan.bottleneck, "steps_s": times[name]}
    speedup = results["compute only"]["measured_step_s"] / results["planner"]["measured_step_s"]
    return {"slowness": slowness, "link_bandwidth_bytes_s": bandwidth,
            "speedup_vs_compute_only": speedup, "plans": results,
            "ranks": "processes" if processes else "threads"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one link")
    parser.add_argument("--rounds", type=int, help="timed steps per plan")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    torch.set_num_threads(1)  # one core per stage thread; the profile is taken so too
    torch.manual_seed(0)
    width, wide = 768, WIDE
    micro = 16
    rounds = args.rounds or (5 if args.quick else 10)
    net = model(width, wide)
    x, y = torch.randn(micro * CHUNKS, width), torch.randn(micro * CHUNKS, width)
    print("profiling ...", file=sys.stderr, flush=True)
    with _common.neighbour_working(256, width):
        profile = profile_model(net, x[:micro], name="widening", repeat=10)
    runs = [compare(net, profile, slowness, x, y, rounds, processes=False)
            for slowness in ((HEADLINE,) if args.quick else (0.25, 1.0, HEADLINE))]
    if not args.quick:  # the headline link again, between two processes
        runs.append(compare(net, profile, HEADLINE, x, y, rounds, processes=True))
    headline = runs[-1]  # between processes (threads, with --quick)
    payload = {
        "model": f"8 blocks of width {width}, block 3 widens its output x{wide}",
        "micro_batch": micro, "chunks": CHUNKS, "link_latency_s": LATENCY,
        "profile_source": profile.source + ", another thread computing",
        "headline_slowness": HEADLINE, "headline_ranks": headline["ranks"],
        "speedup_vs_compute_only": headline["speedup_vs_compute_only"],
        "prediction_error": {name: r["prediction_error"]
                             for name, r in headline["plans"].items()},
        "max_prediction_error": max(r["prediction_error"] for run in runs
                                    for r in run["plans"].values()),
        "runs": runs, "quick": args.quick, "date": time.strftime("%Y-%m-%d")}
    path = _common.write("pipedream", payload)
    rows = [[f"{run['slowness']:g}x", run["ranks"], name, r["balance"],
             f"{1e3 * r['measured_step_s']:.1f}",
             f"{1e3 * r['predicted_step_s']:.1f}", f"{100 * r['prediction_error']:.1f}%",
             f"{run['speedup_vs_compute_only']:.2f}x" if name == "planner" else ""]
            for run in runs for name, r in run["plans"].items()]
    print(_common.markdown_table(["wide message / stage compute", "ranks", "cut", "balance",
                                  "measured ms", "predicted ms", "error",
                                  "speedup vs compute only"], rows))
    print(f"speedup_vs_compute_only: {payload['speedup_vs_compute_only']:.2f} at the "
          f"{HEADLINE:g}x link between {headline['ranks']}  ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
