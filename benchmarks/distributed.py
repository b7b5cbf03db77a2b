"""Two processes under torchrun: conveyor against torch.distributed.pipelining.

Config P (8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), N=256, MSE loss) cut
into two stages of 4 blocks, one per process, gloo, 1 intra-op thread each, no
recomputation (torch's schedules do none). For M in {4, 8, 16}, interleaved in one run:

* conveyor ``Pipeline(schedule="gpipe")`` and ``schedule="1f1b"``, as it runs by default
  (each linear layer's weight gradient added into ``.grad`` by its own product), with
  autograd's accumulation (``CONVEYOR_FUSE_ACCUMULATION=0``), as torch runs, and with
  ``compile=True`` (each stage one compiled graph, its backward two);
* torch.distributed.pipelining ``ScheduleGPipe`` and ``Schedule1F1B`` on the same stages;
* each stage's column on its own (M forwards, then M backwards, plain PyTorch), both
  processes at once: t, and the bound (M + K - 1) t; and the same one process at a
  time (no contention for caches or memory bandwidth), the stricter bound; and the
  column with fused weight gradients, both at once: the bound of conveyor's own work;
* the plain model on one thread over M micro-batches in turn.

Every configuration is timed between barriers (so, by the slower process), median of
the rounds. Then three steps of conveyor's 1F1B at M=8, eager and compiled, are recorded
(``conveyor.record``) and the one of median length kept: where each process's time
went (computing, sending, waiting, between actions), in the results and drawn in
``distributed_timeline.png``.

    python benchmarks/distributed.py          # starts torchrun itself; about 3 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import _common

if "WORLD_SIZE" in os.environ:
    _common.prepare_process()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from conveyor.schedules.timeline import plot_timelines  # noqa: E402

BATCH, WIDTH, BLOCKS, STAGES = 256, 512, 8, 2


def launch(args: argparse.Namespace) -> int:
    """Runs this script under torchrun with 2 processes, then prints rank 0's table."""
    out = _common.RESULTS / "distributed.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(STAGES), __file__, "--rounds", str(args.rounds),
               "--chunks", *map(str, args.chunks)]
    result = subprocess.run(command, env=env)
    if result.returncode == 0:
        print(json.loads(out.read_text())["table"])
        print(f"\nwrote {out}")
    return result.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        return launch(args)

    import conveyor
    from conveyor.engine.backward.accumulation import FusedAccumulation
    from conveyor.train.models import feed_forward_stack
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = feed_forward_stack(BLOCKS, WIDTH, 4 * WIDTH)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    half = model[rank * 4:(rank + 1) * 4]

    pipes: dict[str, conveyor.Pipeline] = {}

    def conveyor_step(schedule: str, chunks: int, *, fused: bool,
                      compiled: bool = False) -> Callable[[], None]:
        os.environ["CONVEYOR_FUSE_ACCUMULATION"] = "1" if fused else "0"
        pipe = conveyor.Pipeline(copy.deepcopy(model), chunks=chunks, schedule=schedule,
                                 recompute="never", loss_fn=nn.functional.mse_loss,
                                 compile=compiled)
        pipe.step(x, y)  # cuts the model, and reads whether to fuse, now
        del os.environ["CONVEYOR_FUSE_ACCUMULATION"]
        pipes[f"{schedule}{' compiled' if compiled else ''} M={chunks}"] = pipe

        def step() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.step(x, y)
        return step

    def torch_step(kind: type, chunks: int) -> Callable[[], None]:
        module = copy.deepcopy(half)
        stage = PipelineStage(module, stage_index=rank, num_stages=STAGES,
                              device=torch.device("cpu"))
        schedule = kind(stage, n_microbatches=chunks, loss_fn=nn.functional.mse_loss)

        def step() -> None:
            module.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
        return step

    def stage_column(chunks: int, *, turn: bool, fused: bool = False) -> Callable[[], None]:
        module = copy.deepcopy(half)
        inputs = [t.clone() for t in torch.randn(BATCH, WIDTH).tensor_split(chunks)]
        grads = [torch.randn_like(t) for t in inputs]
        fusion = FusedAccumulation(module.modules()) if fused else None

        def column() -> None:
            module.zero_grad(set_to_none=True)
            with fusion.layers() if fusion else contextlib.nullcontext():
                outputs = [module(t.requires_grad_(rank > 0)) for t in inputs]
            with fusion.backward() if fusion else contextlib.nullcontext():
                for out, grad in zip(reversed(outputs), reversed(grads)):
                    out.backward(grad)

        def step() -> None:
            if not turn:
                column()
                return
            for r in range(STAGES):  # one process at a time, each timing itself
                dist.barrier()
                if r == rank:
                    start = time.perf_counter()
                    column()
                    alone_seconds[chunks].append(time.perf_counter() - start)
        return step

    def plain_in_turn(chunks: int) -> Callable[[], None]:
        plain = copy.deepcopy(model)

        def step() -> None:
            if rank == 0:
                plain.zero_grad(set_to_none=True)
                for xm, ym in zip(x.tensor_split(chunks), y.tensor_split(chunks)):
                    (nn.functional.mse_loss(plain(xm), ym) * len(xm) / BATCH).backward()
        return step

    alone_seconds: dict[int, list[float]] = {m: [] for m in args.chunks}
    configs: dict[str, Callable[[], None]] = {}
    for chunks in args.chunks:
        for schedule in ("gpipe", "1f1b"):
            configs[f"conveyor {schedule} M={chunks}"] = conveyor_step(
                schedule, chunks, fused=True)
            configs[f"conveyor {schedule} unfused M={chunks}"] = conveyor_step(
                schedule, chunks, fused=False)
            configs[f"conveyor {schedule} compiled M={chunks}"] = conveyor_step(
                schedule, chunks, fused=True, compiled=True)
        configs[f"torch ScheduleGPipe M={chunks}"] = torch_step(ScheduleGPipe, chunks)
        configs[f"torch Schedule1F1B M={chunks}"] = torch_step(Schedule1F1B, chunks)
        configs[f"stage columns at once M={chunks}"] = stage_column(chunks, turn=False)
        configs[f"stage columns in turn M={chunks}"] = stage_column(chunks, turn=True)
        configs[f"fused stage columns at once M={chunks}"] = stage_column(
            chunks, turn=False, fused=True)
        configs[f"plain 1 thread M={chunks} in turn"] = plain_in_turn(chunks)

    times: dict[str, list[float]] = {name: [] for name in configs}
    for round_index in range(args.rounds + 1):
        for name, step in configs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if round_index:
                times[name].append(time.perf_counter() - start)
        if round_index == 0:
            for values in alone_seconds.values():
                values.clear()
        if rank == 0:
            print(f"  round {round_index}/{args.rounds} done", file=sys.stderr, flush=True)

    # The stricter t: each process's own column alone; the bound takes the slower stage.
    alone = torch.tensor([_common.median(alone_seconds[m]) for m in args.chunks])
    dist.all_reduce(alone, op=dist.ReduceOp.MAX)
    recorded = {}
    for name in ("1f1b M=8", "1f1b compiled M=8"):
        if name in pipes:  # three steps recorded; the one of median length is kept
            steps = []
            for _ in range(3):
                with conveyor.record(pipes[name]) as timeline:
                    pipes[name].step(x, y)
                steps.append(timeline)
            recorded[name] = sorted(steps, key=lambda t: t.makespan)[1]
    if rank == 0:
        report(args, times, dict(zip(args.chunks, alone.tolist())), recorded)
    dist.destroy_process_group()
    return 0


def report(args: argparse.Namespace, times: dict[str, list[float]],
           alone: dict[int, float], recorded: dict[str, Any]) -> None:
    ms = _common.median_ms(times)
    rows, results = [], []
    for chunks in args.chunks:
        def bound(column: str) -> float:
            return (chunks + STAGES - 1) * ms[f"{column} M={chunks}"] / chunks
        loaded, fused = bound("stage columns at once"), bound("fused stage columns at once")
        strict = (chunks + STAGES - 1) * alone[chunks] * 1e3 / chunks
        entry = {"chunks": chunks, "bound_ms": strict, "loaded_bound_ms": loaded,
                 "fused_loaded_bound_ms": fused,
                 "plain_1_thread_in_turn_ms": ms[f"plain 1 thread M={chunks} in turn"]}
        for name, theirs in (("gpipe", "torch ScheduleGPipe"), ("1f1b", "torch Schedule1F1B")):
            ours, unfused, compiled = (ms[f"conveyor {name} M={chunks}"],
                                       ms[f"conveyor {name} unfused M={chunks}"],
                                       ms[f"conveyor {name} compiled M={chunks}"])
            torch_ms = entry[theirs] = ms[f"{theirs} M={chunks}"]
            entry[f"conveyor {name}"], entry[f"conveyor {name} unfused"] = ours, unfused
            entry[f"conveyor {name} compiled"] = compiled
            rows.append([chunks, name, f"{ours:.0f}", f"{torch_ms:.0f}",
                         f"{torch_ms / ours:.2f}x", f"{compiled:.0f}",
                         f"{torch_ms / compiled:.2f}x", f"{unfused:.0f}",
                         f"{torch_ms / unfused:.2f}x", f"{strict:.0f}", f"{loaded:.0f}",
                         f"{unfused / loaded:.3f}", f"{fused:.0f}", f"{ours / fused:.3f}"])
        results.append(entry)
    table = _common.markdown_table(
        ["M", "schedule", "conveyor (ms)", "torch.distributed.pipelining (ms)",
         "conveyor faster by", "conveyor compiled (ms)", "that faster by",
         "conveyor, autograd's accumulation (ms)", "that faster by",
         "bound (M+K-1)t, t alone (ms)", "bound, t under load (ms)",
         "autograd's accumulation / bound under load", "bound, fused t under load (ms)",
         "conveyor / fused bound under load"], rows)
    plain = ", ".join(f"M={m}: {ms[f'plain 1 thread M={m} in turn']:.0f} ms"
                      for m in args.chunks)
    table += f"\n\nplain model on 1 thread, M micro-batches in turn: {plain}"
    where = {}
    for name, timeline in recorded.items():
        where[name] = timeline.breakdown()
        shares = "; ".join(
            f"rank {r}: " + ", ".join(f"{part} {1e3 * seconds:.0f}" for part, seconds
                                      in row.items() if part != "imbalance")
            for r, row in enumerate(where[name]))
        table += (f"\n\nconveyor {name}, the median of 3 recorded steps "
                  f"({1e3 * timeline.makespan:.0f} ms),"
                  f" ms per rank: {shares}")
    if recorded:
        picture = _common.RESULTS / "distributed_timeline.png"
        plot_timelines(list(recorded.values()), picture,
                       titles=[f"conveyor {name}, 2 processes" for name in recorded])
    _common.write("distributed", {
        "config": {"blocks": BLOCKS, "width": WIDTH, "batch": BATCH, "stages": STAGES,
                   "processes": STAGES, "backend": "gloo", "threads_per_process": 1,
                   "rounds": args.rounds},
        "median_ms": ms, "results": results, "table": table,
        "recorded": {name: {"makespan_ms": 1e3 * timeline.makespan, "per_rank_s": where[name],
                            "timeline": timeline.to_dict()}
                     for name, timeline in recorded.items()},
    })


if __name__ == "__main__":
    sys.exit(main())
