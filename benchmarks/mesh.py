"""The mesh planner's predictions against measured steps, for every mesh that fits here.

    python benchmarks/mesh.py --quick --json FILE   # 1 and 2 processes (about 5 min)
    python benchmarks/mesh.py                       # PP=2 x DP=2 too (4 processes)
    python benchmarks/mesh.py --quick --tensor-parallel   # also TP=2, TP=4, PP=4,
                                                          # PP=2 x TP=2 (about 9 min)

The model: eight feed-forward blocks (Linear(d, 4d)-GELU-Linear(4d, d)), a batch of 64
in micro-batches of 16. Each configuration runs as CPU processes over gloo, one
intra-op thread each: no pipeline (one process), DP=2 replicated, DP=2 FSDP, PP=2
(1F1B), and without ``--quick`` PP=2 x DP=2; with ``--tensor-parallel`` TP=2, and on 4
processes TP=4, PP=4 and PP=2 x TP=2 (its boundary whole, then as 1/2 pieces per
tensor rank). The meshes of one size run in one torchrun launch, their steps timed in
turn between barriers. On 2 cores, 4 processes share them: the plain model's step,
timed by every process at once, carries that sharing into the prediction; a pipeline's
ranks take turns as it fills and drains, and its simulated step is replayed with each
rank computing at its share of the cores (see benchmarks/_sharing.py;
``planner_step_s`` is the planner's own step, every rank on a device of its own). The
plain step timed with 1, 2, ... of the processes computing (``slowdown_computing``)
shows a process needing less CPU for the same work when fewer compute (alone 27 ms for
the batch, 36 with all 4 computing); a pipeline's ranks do not, as they compute after
waiting: each of PP=4's spends 12-13 ms of CPU a step, about 9.5 on its quarter of the
model beside the runtime's own 3, where all 4 computing spend 9 a quarter. So that
curve is reported, and only its figure with every process computing (which slows the
runtime's host seconds) goes into the prediction.

The prediction is :func:`conveyor.planner.evaluate_shape` (what ``conveyor plan``
weighs) on this machine's figures, each timed as a step issues it:

- the profile (:func:`conveyor.planner.profile_model`, micro-batches of 16), taken alone
  for the one process and beside a computing thread for the meshes of two (on 2 cores a
  neighbour slows a stage, as in benchmarks/pipedream.py), its times scaled to the plain
  model's step timed in the launch: after another plain step, or for the data-parallel
  meshes right after the replicas' sum of the model's gradients, as their steps compute
  after their last step's (``plain_model_step_after_sum_s``);
- the link, calibrated in each launch after every timed round (see
  benchmarks/_gloo.py): TP's all-reduce through a block split by its plan, the
  replicas' gradient sum with its bucket copies, fitted to the ring's 2(n-1)(latency +
  bytes / n / bandwidth) from the rounds' lower quartiles (the steps' statistic); the
  messages between stages held to a calibration of the same before the rounds, with
  ``conveyor.engine.transport.emulated_links``, less what gloo's own message takes;
- FSDP's shares: FSDP2's all-gather and reduce-scatter of a block against the
  replicas' sum of the same block, and the seconds its hooks add to a block's forward
  and backward, after every timed round (the rounds' median);
- the runtime's host seconds per action and per step, in the one-process run (see
  benchmarks/_host.py; a calibration of its own: no configuration below is fitted),
  slowed as the plain step is with every process of the launch computing.

Every step timed starts from gradients set to None (as after ``zero_grad()``), right
after an untimed step of its own: as in a training loop, the caches hold its model, not
another configuration's copy (``_common.round_robin(warm_each=True)``).

Reported (``--json FILE``, default benchmarks/results/mesh.json): each configuration's
``predicted_step_s`` with its parts (``predicted_parts_s``: the busiest rank's compute,
of which TP's all-reduces, the replicas' or FSDP's collectives, a boundary's message, the
runtime's own step, the idle rest; a pipeline's before its replay on shared cores),
``planner_step_s`` (the planner's step itself), ``measured_step_s`` (the rounds' lower
quartile, see ``_common.lower_quartile``), ``prediction_error`` = |predicted -
measured| / measured, the steps, ``max_prediction_error`` and ``slowdown_computing``
per launch size; for a pipeline, ``boundary_bytes``: per
boundary, the bytes every rank sent across it in one step (activations and gradients),
beside ``predicted_boundary_bytes``, the planner's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import _gloo
import _host
import _sharing

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
import conveyor.tensor  # noqa: E402
from conveyor.engine.transport import emulated_links  # noqa: E402
from conveyor.planner import (Cluster, Level, MeshCandidate, Shape, evaluate_shape,  # noqa: E402
                              profile_model)

WIDTH, BLOCKS, BATCH, MICRO = 256, 8, 64, 16
#: Untimed rounds first: with the gradients set to None before each step, the process's
#: heap grows over the first rounds (pages faulted in: tens of ms a step on a VM).
WARMUP = 3
REFERENCE = "plain model"
#: The plain step again, right after the replicas' sum of the model's gradients (untimed):
#: a replicated or sharded step computes after its last step's sum, and on this 2-core
#: VM a step computing after a collective of the model's size runs slower than one
#: after another step (its half batch: 17.6 against 14.2 ms; after a 200 ms pause, 21.1)
AFTER_SUM = f"{REFERENCE}, after the gradient sum"
#: A launch's processes as the levels of a cluster, innermost first: 4 as two "nodes" of
#: two, in which the planner keeps TP=2 and PP=4's boundaries 0|1 and 2|3.
LEVELS = {1: (1,), 2: (2,), 4: (2, 2)}
CALIBRATIONS = 3

#: name -> (shape, schedule, the Pipeline's options beside the model and loss)
CONFIGS: dict[str, tuple[Shape, str, dict[str, Any]]] = {
    "no pipeline": (Shape(1, 1, 1), "1f1b", {"stages": 1, "chunks": 4, "schedule": "1f1b"}),
    "DP=2 replicate": (Shape(1, 1, 2, "replicate"), "1f1b",
                       {"stages": 1, "chunks": 2, "data_parallel": 2, "schedule": "1f1b"}),
    "DP=2 fsdp": (Shape(1, 1, 2, "fsdp"), "1f1b",
                  {"stages": 1, "chunks": 2, "data_parallel": 2, "sharding": "fsdp",
                   "schedule": "1f1b"}),
    "PP=2": (Shape(2, 1, 1), "1f1b", {"stages": 2, "chunks": 4, "schedule": "1f1b"}),
    "PP=2 x DP=2": (Shape(2, 1, 2, "replicate"), "1f1b",
                    {"stages": 2, "chunks": 2, "schedule": "1f1b", "data_parallel": 2}),
}
#: Tensor-parallel meshes (--tensor-parallel), and PP=4 beside them: the same 4
#: processes as pipeline stages, tensor ranks, or both. "pieces" sends each boundary's
#: activation 1/T per tensor rank (conveyor.tensor.SLICED_FROM lowered to 0: this
#: model's 16 KiB activations go whole by default).
TP_PLAN = {"*.0": "colwise", "*.2": "rowwise"}  # each block: Linear(d, 4d), GELU, Linear(4d, d)
TP_CONFIGS: dict[str, tuple[Shape, str, dict[str, Any]]] = {
    "TP=2": (Shape(1, 2, 1), "1f1b", {"stages": 1, "chunks": 4, "tensor_parallel": 2,
                                      "tp_plan": TP_PLAN}),
    "TP=4": (Shape(1, 4, 1), "1f1b", {"stages": 1, "chunks": 4, "tensor_parallel": 4,
                                      "tp_plan": TP_PLAN}),
    "PP=4": (Shape(4, 1, 1), "1f1b", {"stages": 4, "chunks": 4, "schedule": "1f1b"}),
    "PP=2 x TP=2": (Shape(2, 2, 1), "1f1b", {"stages": 2, "chunks": 4, "schedule": "1f1b",
                                             "tensor_parallel": 2, "tp_plan": TP_PLAN}),
    "PP=2 x TP=2, pieces": (Shape(2, 2, 1), "1f1b", {
        "stages": 2, "chunks": 4, "schedule": "1f1b", "tensor_parallel": 2,
        "tp_plan": TP_PLAN, "sliced_from": 0}),
}


class Block(nn.Sequential):
    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x + super().forward(x)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(WIDTH) for _ in range(BLOCKS)])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def worker(spec_path: str) -> int:
    """One process of a torchrun launch: calibrates the link, then times every mesh."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    net, (x, y) = model(), batch()
    steps: dict[str, Callable[[], Any]] = {}
    pipes: dict[str, Any] = {}
    for name, options in spec["options"].items():
        options = dict(options)
        sliced_from = options.pop("sliced_from", conveyor.tensor.SLICED_FROM)
        pipe = pipes[name] = conveyor.Pipeline(copy.deepcopy(net),
                                               loss_fn=nn.functional.mse_loss, timeout=300,
                                               recompute="never", **options)
        share = options.get("data_parallel", 1)  # each replica steps on its share
        rank = pipe.topology.data_rank if share > 1 else 0
        steps[name] = (lambda pipe=pipe, xs=x[rank::share], ys=y[rank::share],
                       sliced_from=sliced_from: sliced(sliced_from, _host.training_step(pipe),
                                                       xs, ys))
    whole = _host.plain_step(copy.deepcopy(net), MICRO)
    steps[REFERENCE] = steps[AFTER_SUM] = lambda: whole(x, y)
    for busy in range(1, size):  # the plain step while fewer processes compute at once
        steps[computing(busy)] = (lambda: whole(x, y)) if dist.get_rank() < busy else \
            (lambda: None)

    def between_barriers(step: Callable[[], Any]) -> Callable[[], None]:
        def timed() -> None:
            dist.barrier()
            step()
            dist.barrier()
        return timed

    # The links the messages between stages are held to are calibrated once every
    # configuration has run (untimed): in a launch's first seconds its collectives take
    # longer (TP's among 4 processes: 6.6 ms, then 4.7 ms, which a step's take); and
    # CALIBRATIONS times, an untimed round before each (one calibration in a slow moment
    # doubled a latency).
    timed = {name: between_barriers(step) for name, step in steps.items()}
    sizes, groups = LEVELS[size], level_groups(LEVELS[size])
    parameters = sum(p.numel() for p in net.parameters())  # what the replicas sum
    shapes = [p.shape for p in net.parameters()]
    before = {AFTER_SUM: _gloo.gradient_sum(shapes)}

    def calibration() -> list[float]:
        """TP's all-reduce and the replicas' gradient sum over each level's groups."""
        return ([tp_all_reduce_seconds(group) for group in groups]
                + [_gloo.gradient_sum_seconds(shapes, group) for group in groups])

    def fitted(passes: list[list[float]]) -> list[tuple[float, float]]:
        """Each level's (latency, bandwidth) from the passes' lower quartiles (rank 0's,
        on every rank), the statistic of the steps they predict."""
        timings = torch.tensor([_common.lower_quartile(list(column))
                                for column in zip(*passes)], dtype=torch.float64)
        dist.broadcast(timings, 0)
        return _gloo.fit_levels(sizes, MICRO * WIDTH, timings[:len(sizes)].tolist(),
                                parameters, timings[len(sizes):].tolist())

    passes = []
    for _ in range(CALIBRATIONS):
        _common.round_robin(timed, 0, progress=False)
        passes.append(calibration())

    def rank_0s(*figures: float) -> list[float]:
        """Rank 0's ``figures`` on every rank (every rank emulates the same links)."""
        found = torch.tensor(figures, dtype=torch.float64)
        dist.broadcast(found, 0)
        return found.tolist()

    def shares() -> list[float]:
        """FSDP's all-gather and reduce-scatter shares, and its hooks' seconds a unit."""
        return rank_0s(*_gloo.collective_shares(lambda: Block(WIDTH),
                                                torch.randn(MICRO, WIDTH), BLOCKS))

    # what a real message already takes
    message, = rank_0s(_gloo.message_seconds(MICRO * WIDTH))
    # FSDP's shares, ratios of collectives timed a moment apart, taken once before the
    # rounds were 0.72 and 1.15 in one run, 1.26 and 1.83 in the next: where a launch
    # runs FSDP they are taken after every round, and the rounds' median kept.
    fsdp = any(o.get("sharding") == "fsdp" for o in spec["options"].values())
    shares_in_rounds = [] if fsdp else [shares()]
    links = cluster(sizes, fitted(passes))

    def between(source: int, destination: int) -> tuple[float, float]:
        """The link from one rank to another: its level's, less gloo's own message."""
        level = links.levels[links.level_of(min(source, destination),
                                            max(source, destination))]
        return level.bandwidth, max(0.0, level.latency - message)

    # The emulation adds to each message what gloo's own does not already take. The
    # prediction's links are calibrated again after every timed round, in the moments
    # the steps are timed in (on a shared machine the passes before them may catch
    # another load: TP's all-reduce 2.8 ms there, 1.6 in the steps).
    in_rounds: list[list[float]] = []

    def calibrate_in_round() -> None:
        in_rounds.append(calibration())
        if fsdp:
            shares_in_rounds.append(shares())

    with emulated_links(between=between):
        times = _common.round_robin(timed, spec["rounds"], progress=dist.get_rank() == 0,
                                    warmup=WARMUP, warm_each=True,
                                    after_round=calibrate_in_round, before=before)
        crossed = {name: crossing(pipe, steps[name]) for name, pipe in pipes.items()}
    levels = fitted(in_rounds)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, crossed)
    if dist.get_rank() == 0:
        boundaries = {name: boundary_bytes([rank[name] for rank in everyone])
                      for name in pipes}
        gather, scatter, hooks = (statistics.median(column)
                                  for column in zip(*shares_in_rounds))
        Path(spec["out"]).write_text(json.dumps({"times": times, "levels": levels,
                                                 "message": message,
                                                 "shares": (gather, scatter, hooks),
                                                 "boundary_bytes": boundaries}))
    dist.destroy_process_group()
    return 0


def computing(busy: int) -> str:
    """The name of the plain step timed with ``busy`` of a launch's processes computing
    (the others waiting at the barrier after it)."""
    return f"{REFERENCE}, {busy} computing"


def slowdowns(times: dict[str, list[float]], processes: int) -> dict[int, float]:
    """How much longer the plain step takes with n of the launch's processes computing
    than with one, for n = 1 ... processes (popped from ``times``; the step with every
    process computing is the reference, kept)."""
    steps = {busy: _common.lower_quartile(times.pop(computing(busy)))
             for busy in range(1, processes)}
    steps[processes] = _common.lower_quartile(times[REFERENCE])
    return {busy: step / steps[1] for busy, step in steps.items()}


def level_groups(sizes: tuple[int, ...]) -> list[Any]:
    """This rank's process group at each level of ``sizes`` (:data:`LEVELS`), innermost
    first; None for the level that holds every rank."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    groups, span = [], 1
    for size in sizes:
        span *= size
        mine = None
        if span < world:  # every rank makes every group, in the same order
            for first in range(0, world, span):
                group = dist.new_group(list(range(first, first + span)))
                mine = group if first <= rank < first + span else mine
        groups.append(mine)
    return groups


def tp_all_reduce_seconds(group: Any) -> float:
    """One of TP's all-reduces over ``group`` (None: every rank) as a step issues it: a
    block split by TP_PLAN (conveyor's own ops) against its shard alone (see
    :func:`_gloo.split_all_reduce_seconds`); a block's forward and backward run two.
    Every group of a level runs it at once, as the stages of PP x TP do."""
    import torch.distributed as dist
    from conveyor.tensor.apply import Group, apply_plan

    ranks = dist.get_world_size(group)
    split = nn.Sequential(Block(WIDTH))
    apply_plan(split, TP_PLAN, group=Group((group or dist.group.WORLD).group_name, ranks,
                                           dist.get_rank(group), 300.0))
    hidden = 4 * WIDTH // ranks
    shard = nn.Sequential(nn.Linear(WIDTH, hidden), nn.GELU(), nn.Linear(hidden, WIDTH))
    x = torch.randn(MICRO, WIDTH, requires_grad=True)  # (colwise sums its input's grad)
    return _gloo.split_all_reduce_seconds(lambda: split(x), lambda: x + shard(x), 2)


def sliced(sliced_from: int, step: Callable[..., Any], *args: Any) -> Any:
    """``step(*args)`` with tensors from ``sliced_from`` bytes crossing as pieces."""
    kept, conveyor.tensor.SLICED_FROM = conveyor.tensor.SLICED_FROM, sliced_from
    try:
        return step(*args)
    finally:
        conveyor.tensor.SLICED_FROM = kept


def crossing(pipe: Any, step: Callable[[], Any]) -> dict[str, int]:
    """The bytes this rank sends to another stage in one step, by "kind k->j"."""
    traffic = pipe.runtime.transport.traffic
    traffic.clear()
    step()
    return {f"{kind} {source}->{stage}": flow.bytes
            for (kind, source, stage), flow in traffic.flows.items() if source != stage}


def boundary_bytes(ranks: list[dict[str, int]]) -> dict[str, int]:
    """Per boundary "k|k+1": the bytes every rank sent across it in one step, each way."""
    total: dict[str, int] = {}
    for sent in ranks:
        for what, count in sent.items():
            low, high = sorted(int(s) for s in what.split()[1].split("->"))
            total[f"{low}|{high}"] = total.get(f"{low}|{high}", 0) + count
    return total


def launch(options: dict[str, dict[str, Any]], processes: int, rounds: int) -> dict[str, Any]:
    """Runs this script under torchrun with ``processes`` processes; rank 0's findings."""
    with tempfile.TemporaryDirectory() as folder:
        spec = Path(folder) / "spec.json"
        out = Path(folder) / "times.json"
        spec.write_text(json.dumps({"options": options, "rounds": rounds, "out": str(out)}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(processes), __file__, "--worker", str(spec)],
                       env=env, check=True)
        return dict(json.loads(out.read_text()))


#: The one-process run (cheap: a second a round) times this many times the rounds: the
#: calibration's few milliseconds are differences of steps that vary by as much. What it
#: adds to a step of 4 micro-batches, most of a 4-micro-batch configuration's runtime
#: share: 9.7, 13.5 and 15.0 ms in three runs of 16 rounds, 12.3 and 11.6 in two of 48.
ONE_PROCESS_ROUNDS = 6


def one_process(options: dict[str, dict[str, Any]], rounds: int) -> dict[str, list[float]]:
    net, (x, y) = model(), batch()
    steps: dict[str, Callable[[], None]] = {}
    for name, opts in options.items():
        steps[name] = lambda pipe=_host.training_step(conveyor.Pipeline(
            copy.deepcopy(net), loss_fn=nn.functional.mse_loss, devices=["cpu"],
            recompute="never", **opts)): pipe(x, y)
    steps.update(_host.calibration_steps(net, x, y))
    whole = _host.plain_step(copy.deepcopy(net), MICRO)  # after the calibration's pairs
    steps[REFERENCE] = lambda: whole(x, y)
    return _common.round_robin(steps, rounds, warmup=WARMUP, warm_each=True)


def scaled(profile: Any, reference: float) -> Any:
    """``profile`` with its times scaled so that the whole model's forward and backward
    on the batch takes ``reference`` seconds, as the plain step measured beside the
    configurations did: on a shared machine (loads of 10 on 2 cores) the per-layer
    timings of a profile catch the quiet moments and whole steps do not."""
    total = BATCH * sum(layer.forward + layer.backward for layer in profile.layers)
    factor = reference / total
    layers = tuple(dataclasses.replace(layer, forward=layer.forward * factor,
                                       backward=layer.backward * factor)
                   for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers,
                               source=f"{profile.source}, times x{factor:.2f}")


def cluster(sizes: tuple[int, ...], levels: list[tuple[float, float]],
            host: tuple[float, float] = (0.0, 0.0),
            shares: tuple[float, float, float] = (0.5, 0.5, 0.0)) -> Cluster:
    """This machine as the planner sees it: the launch's ``levels`` ((latency,
    bandwidth), innermost first, of ``sizes``), the runtime's host seconds per action and
    per step, FSDP's shares and its hooks' seconds per unit."""
    return Cluster(tuple(Level(f"level {i}", size, bandwidth, latency)
                         for i, (size, (latency, bandwidth)) in enumerate(zip(sizes, levels))),
                   memory=1e12, action_s=host[0], step_s=host[1],
                   all_gather_share=shares[0], reduce_scatter_share=shares[1],
                   fsdp_unit_s=shares[2])


#: The parts of a prediction reported beside it (MeshCandidate's, seconds per step).
PARTS = ("compute_s", "tp_comm_s", "dp_comm_s", "p2p_s", "runtime_s", "idle_s")


def predict(profile: Any, shape: Shape, schedule: str, chunks: int, machine: Cluster
            ) -> MeshCandidate:
    """What the planner predicts for ``shape`` on ``machine`` (its step and its parts)."""
    found = evaluate_shape(profile, machine, shape, schedule, chunks, batch=BATCH,
                           optimizer="sgd")
    assert found is not None  # memory is not the question here
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="no PP=2 x DP=2")
    parser.add_argument("--rounds", type=int, help="timed steps per configuration")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="also the TP meshes and PP=4 (4 processes)")
    parser.add_argument("--json", metavar="FILE", help="where to write the results")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.rounds is not None and args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: each step is the lower quartile of its "
                     "rounds, which needs 2 or more")
    torch.set_num_threads(1)
    # 8: on a shared 2-core VM the lower quartile of 4 rounds moved by 20% between runs
    rounds = args.rounds or 8
    configs = dict(CONFIGS)
    if args.quick:
        del configs["PP=2 x DP=2"]
    if args.tensor_parallel:
        configs.update(TP_CONFIGS)
    else:
        print(f"note: TP meshes ({', '.join(TP_CONFIGS)}) skipped: not asked "
              "(--tensor-parallel)", file=sys.stderr)
    net, (x, _) = model(), batch()
    print("profiling, alone and beside a computing thread ...", file=sys.stderr, flush=True)
    # With the TP plan the meshes run: each block's all-reduces counted (one each way).
    alone = profile_model(net, x[:MICRO], name="mesh-blocks", repeat=10, tp_plan=TP_PLAN)
    with _common.neighbour_working(MICRO * 4, WIDTH):
        beside = profile_model(net, x[:MICRO], name="mesh-blocks", repeat=10,
                               tp_plan=TP_PLAN)
    return report(args, configs, rounds, alone, beside)


def report(args: argparse.Namespace, configs: dict[str, tuple[Shape, str, dict[str, Any]]],
           rounds: int, alone: Any, beside: Any) -> int:
    """Runs every configuration, by its number of processes, and writes the results."""
    by_processes: dict[int, dict[str, dict[str, Any]]] = {}
    for name, (shape, _, options) in configs.items():
        by_processes.setdefault(shape.devices, {})[name] = options
    measured: dict[str, list[float]] = {}
    crossed: dict[str, dict[str, int]] = {}
    host = (0.0, 0.0)  # the runtime's host seconds per action, per step
    levels: dict[int, list[tuple[float, float]]] = {}
    messages: dict[int, float] = {}
    shares: dict[int, tuple[float, float, float]] = {}
    reference: dict[int, list[float]] = {}
    after_sum: dict[int, list[float]] = {}  # processes -> the plain step after a sum
    sharing: dict[int, dict[int, float]] = {}  # processes -> slowdown with n computing
    for processes, options in sorted(by_processes.items()):
        print(f"{processes} process(es): {', '.join(options)}", file=sys.stderr, flush=True)
        found: dict[str, Any]
        if processes == 1:
            found = {"times": one_process(options, ONE_PROCESS_ROUNDS * rounds),
                     "levels": [(0.0, 1e12)]}
        else:
            found = launch(options, processes, rounds)
        sharing[processes] = slowdowns(found["times"], processes)
        reference[processes] = found["times"].pop(REFERENCE)
        after_sum[processes] = found["times"].pop(AFTER_SUM, reference[processes])
        if processes == 1:  # the runtime's own seconds, beyond the layers'
            host = _host.runtime_costs(found["times"])
        measured.update(found["times"])
        crossed.update(found.get("boundary_bytes", {}))
        levels[processes] = [tuple(level) for level in found["levels"]]
        messages[processes] = found.get("message", 0.0)  # one process: none
        gather, scatter, hooks = found.get("shares", (0.5, 0.5, 0.0))  # 1 process: none
        shares[processes] = (gather, scatter, hooks)
    results = {}
    for name, (shape, schedule, options) in configs.items():
        # a data-parallel step computes after its last step's collective of the model
        plain = (after_sum if shape.dp > 1 else reference)[shape.devices]
        profile = scaled(alone if shape.devices == 1 else beside,
                         _common.lower_quartile(plain))
        # the runtime's host seconds, timed alone, as slow as every process computing
        everyone = sharing[shape.devices][shape.devices]
        candidate = sliced(options.get("sliced_from", conveyor.tensor.SLICED_FROM), predict,
                           profile, shape, schedule, options["chunks"],
                           cluster(LEVELS[shape.devices], levels[shape.devices],
                                   (host[0] * everyone, host[1] * everyone),
                                   shares[shape.devices]))
        predicted = candidate.predicted_step_s
        if candidate.timeline is not None:  # its ranks take turns on the cores
            predicted += _sharing.shared_makespan(
                candidate.timeline, schedule, options["chunks"],
                _sharing.taking_turns(os.cpu_count() or 1, shape.devices),
                shape.tp, candidate.p2p_s) - candidate.timeline.makespan
        step = _common.lower_quartile(measured[name])
        results[name] = {"pp": shape.pp, "tp": shape.tp, "dp": shape.dp,
                         "sharding": shape.sharding, "schedule": schedule,
                         "chunks": options["chunks"], "processes": shape.devices,
                         "predicted_step_s": predicted, "measured_step_s": step,
                         "planner_step_s": candidate.predicted_step_s,
                         "predicted_parts_s": {part.removesuffix("_s"): getattr(candidate, part)
                                               for part in PARTS},
                         "prediction_error": abs(predicted - step) / step,
                         "steps_s": measured[name],
                         "spread": (max(measured[name]) - min(measured[name])) / step}
        if name in crossed and shape.pp > 1:
            pieces = "sliced_from" in options and shape.tp > 1
            results[name]["boundary_bytes"] = crossed[name]
            # what the planner counts: a micro-batch's activation and its gradient, 1/T
            # per tensor rank as pieces, else whole from each
            results[name]["predicted_boundary_bytes"] = \
                2 * BATCH * WIDTH * 4 * (1 if pieces else shape.tp)
    payload = {"model": f"{BLOCKS} blocks Linear({WIDTH}, {4 * WIDTH})-GELU-Linear, residual",
               "batch": BATCH, "micro_batch": MICRO, "rounds": rounds,
               "action_s": host[0], "step_s": host[1],
               "profile_alone": alone.source, "profile_beside": beside.source + ", another "
               "thread computing", "link": {
                   str(k): {"levels": [{"size": size, "latency_s": latency,
                                        "bandwidth_bytes_s": bandwidth}
                                       for size, (latency, bandwidth) in zip(LEVELS[k], v)],
                            "gloo_message_s": messages[k],
                            "all_gather_share": shares[k][0],
                            "reduce_scatter_share": shares[k][1],
                            "fsdp_unit_s": shares[k][2]}
                   for k, v in levels.items()},
               "plain_model_step_s": {str(k): {"lower_quartile": _common.lower_quartile(v),
                                                "steps": v} for k, v in reference.items()},
               "plain_model_step_after_sum_s": {
                   str(k): {"lower_quartile": _common.lower_quartile(v), "steps": v}
                   for k, v in after_sum.items() if k > 1},
               "slowdown_computing": {str(k): {str(n): v for n, v in curve.items()}
                                      for k, curve in sharing.items()},
               "configurations": results,
               "max_prediction_error": max(r["prediction_error"] for r in results.values()),
               "tensor_parallel": "run" if any(r["tp"] > 1 for r in results.values()) else
               "skipped: not asked (--tensor-parallel)", "quick": args.quick,
               "date": time.strftime("%Y-%m-%d")}
    path = _common.write("mesh", payload, Path(args.json) if args.json else None)
    print(_common.markdown_table(
        ["configuration", "processes", "measured ms", "predicted ms", "error", "spread",
         "bytes per boundary (predicted)"],
        [[name, r["processes"], f"{1e3 * r['measured_step_s']:.1f}",
          f"{1e3 * r['predicted_step_s']:.1f}", f"{100 * r['prediction_error']:.1f}%",
          f"{100 * r['spread']:.0f}%",
          ", ".join(f"{k}: {v / 1024:.0f} KiB" for k, v in r.get("boundary_bytes", {}).items())
          + (f" ({r['predicted_boundary_bytes'] / 1024:.0f} KiB)"
             if "predicted_boundary_bytes" in r else "")] for name, r in results.items()]))
    print(f"max_prediction_error: {100 * payload['max_prediction_error']:.1f}%  ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
