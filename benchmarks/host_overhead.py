"""Host cost per action: conveyor against torch.distributed.pipelining on tiny layers.

A step whose compute is almost nothing is bound by what the host does per action
(dispatch, bookkeeping, the side-effect watch, messages). 32 layers of Linear(16, 16)
with a tanh, cut 16 | 16 over two processes under torchrun (gloo, one intra-op thread
each), M micro-batches of one sample each, no recomputation (torch's schedules do none).
Interleaved in one run, each timed between barriers (so by the slower process), the
median of the rounds:

* conveyor ``Pipeline(schedule="1f1b")`` and ``schedule="zero-bubble"``;
* torch.distributed.pipelining ``Schedule1F1B`` on the same stages;
* each stage's column on its own, both processes at once (M forwards then M backwards
  of plain PyTorch): the compute, which the two above share.

Reported (``benchmarks/results/host_overhead.json``, or ``--json FILE``), beside each
step's median, ``main_thread_cpu_ms``: the CPU time of the busier rank's main thread per
step, which a neighbour's load on a shared machine moves less than the step's wall time;
``per_action_us`` for conveyor's 1F1B and torch's 1F1B (the step over the 2M compute
actions a rank runs: F and B of each micro-batch), ``overhead_per_action_us`` (the same
less the stage's own column: the pipeline's host cost alone), and ``zb_over_1f1b``
(conveyor's zero-bubble step over its 1F1B step; zero-bubble runs 3M actions, F, I and
W, where 1F1B runs 2M).

    python benchmarks/host_overhead.py            # M=32, 7 rounds; about a minute
    python benchmarks/host_overhead.py --quick    # M=16, 3 rounds; the smoke test's
    python benchmarks/host_overhead.py --pin --rounds 15   # each process on a core

On a 2-core VM the processes' threads (the stage's, gloo's, conveyor's receive
watchers) otherwise wander between the cores, and two runs of the same code differ by
up to 1.5x; pinned, by about 10%.
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

import _common

if "WORLD_SIZE" in os.environ:
    _common.prepare_process()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

LAYERS, WIDTH, STAGES = 32, 16, 2


def tiny_model() -> nn.Sequential:
    """LAYERS tiny layers, each a Linear and a tanh (one module each, so the layer
    count is what a rank's stage holds and runs per action)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(LAYERS)])


def launch(args: argparse.Namespace) -> int:
    """Runs this script under torchrun with 2 processes, then prints rank 0's table."""
    with tempfile.TemporaryDirectory() as scratch:
        handoff = Path(scratch) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "HOST_OVERHEAD_RESULT": str(handoff)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(STAGES), __file__, "--rounds", str(args.rounds),
                   "--chunks", str(args.chunks)] + (["--pin"] if args.pin else [])
        result = subprocess.run(command, env=env)
        if result.returncode != 0:
            return result.returncode
        payload = json.loads(handoff.read_text())
    out = _common.write("host_overhead", payload, Path(args.json) if args.json else None)
    print(payload["table"])
    print(f"\nwrote {out}")
    return 0


def measure(args: argparse.Namespace) -> None:
    """One process of the torchrun job: every configuration in turn, each round."""
    import conveyor
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    if args.pin:  # each process (and the threads gloo starts) on a core of its own
        os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1)})
    dist.init_process_group("gloo")
    rank, chunks = dist.get_rank(), args.chunks
    model = tiny_model()
    x, y = torch.randn(chunks, WIDTH), torch.randn(chunks, WIDTH)
    half = model[rank * (LAYERS // STAGES):(rank + 1) * (LAYERS // STAGES)]

    def conveyor_step(schedule: str) -> Callable[[], None]:
        pipe = conveyor.Pipeline(copy.deepcopy(model), chunks=chunks, schedule=schedule,
                                 recompute="never", loss_fn=nn.functional.mse_loss)
        pipe.step(x, y)  # cuts the model

        def step() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.step(x, y)
        return step

    def torch_step() -> Callable[[], None]:
        module = copy.deepcopy(half)
        stage = PipelineStage(module, stage_index=rank, num_stages=STAGES,
                              device=torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=chunks, loss_fn=nn.functional.mse_loss)

        def step() -> None:
            module.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
        return step

    def stage_column() -> Callable[[], None]:
        module = copy.deepcopy(half)
        inputs = [t.clone() for t in torch.randn(chunks, WIDTH).tensor_split(chunks)]
        grads = [torch.randn_like(t) for t in inputs]

        def step() -> None:
            module.zero_grad(set_to_none=True)
            outputs = [module(t.requires_grad_(rank > 0)) for t in inputs]
            for out, grad in zip(reversed(outputs), reversed(grads)):
                out.backward(grad)
        return step

    configs = {"conveyor 1f1b": conveyor_step("1f1b"),
               "conveyor zero-bubble": conveyor_step("zero-bubble"),
               "torch Schedule1F1B": torch_step(), "stage column": stage_column()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}  # this main thread's
    for round_index in range(args.rounds + 1):
        for name, step in configs.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            step()
            used = time.thread_time() - start_cpu
            dist.barrier()
            if round_index:  # the first round warms up
                times[name].append(time.perf_counter() - start)
                cpu[name].append(used)
        if rank == 0:
            print(f"  round {round_index}/{args.rounds} done", file=sys.stderr, flush=True)
    ranks: list[dict[str, float]] = [{}] * dist.get_world_size()
    dist.all_gather_object(ranks, _common.median_ms(cpu))
    if rank == 0:
        busiest = {name: max(mine[name] for mine in ranks) for name in configs}
        Path(os.environ["HOST_OVERHEAD_RESULT"]).write_text(
            json.dumps(report(args, times, busiest)))
    dist.destroy_process_group()


def report(args: argparse.Namespace, times: dict[str, list[float]],
           cpu_ms: dict[str, float]) -> dict[str, object]:
    """The figures and their table, from each configuration's seconds per round and
    the busier rank's main-thread CPU milliseconds per step (the median of its rounds)."""
    ms = _common.median_ms(times)
    actions = 2 * args.chunks  # F and B of each micro-batch, on each rank
    column = ms["stage column"]
    per_action = {name: 1e3 * ms[config] / actions for name, config in
                  (("conveyor", "conveyor 1f1b"), ("torch", "torch Schedule1F1B"))}
    overhead = {name: 1e3 * (ms[config] - column) / actions for name, config in
                (("conveyor", "conveyor 1f1b"), ("torch", "torch Schedule1F1B"))}
    zb_over_1f1b = ms["conveyor zero-bubble"] / ms["conveyor 1f1b"]
    rows = [[name, f"{value:.1f}", f"{1e3 * value / actions:.0f}", f"{cpu_ms[name]:.1f}"]
            for name, value in ms.items()]
    table = _common.markdown_table(["configuration", "step (ms)", "per F/B action (us)",
                                    "main thread's CPU (ms)"], rows)
    table += (f"\n\n{LAYERS} layers Linear({WIDTH}, {WIDTH}) + tanh, 2 processes, "
              f"M={args.chunks}, median of {args.rounds} rounds.\n"
              f"host cost per action beyond the stage's own compute: conveyor "
              f"{overhead['conveyor']:.0f} us, torch {overhead['torch']:.0f} us "
              f"(conveyor / torch {overhead['conveyor'] / overhead['torch']:.2f}x); "
              f"conveyor zero-bubble / 1f1b {zb_over_1f1b:.2f}x")
    return {"config": {"layers": LAYERS, "width": WIDTH, "stages": STAGES,
                       "chunks": args.chunks, "rounds": args.rounds, "backend": "gloo",
                       "threads_per_process": 1, "recompute": "never"},
            "median_ms": ms, "main_thread_cpu_ms": cpu_ms, "per_action_us": per_action,
            "overhead_per_action_us": overhead, "zb_over_1f1b": zb_over_1f1b,
            "table": table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="M=16 and 3 rounds (the smoke test's run)")
    parser.add_argument("--chunks", type=int, default=None, help="micro-batches (32)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (7)")
    parser.add_argument("--pin", action="store_true",
                        help="pin each process to a core of its own (steadier figures "
                             "where there are at least 2 cores)")
    parser.add_argument("--json", default=None,
                        help="where to write the results (default "
                             "benchmarks/results/host_overhead.json)")
    args = parser.parse_args()
    args.chunks = args.chunks or (16 if args.quick else 32)
    args.rounds = args.rounds or (3 if args.quick else 7)
    if "WORLD_SIZE" not in os.environ:
        return launch(args)
    measure(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
