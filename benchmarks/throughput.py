"""Throughput: GPipe K=2 on CPU threads against the plain model, on config P.

Config P: 8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), batch N=256, MSE loss.
For each number of micro-batches M it times, in one run and interleaved:

* the plain model on the whole batch, at 1 and at 2 intra-op threads;
* the plain model at 1 thread over M micro-batches in turn (gradient accumulation);
* GPipe with K=2 stages on two CPU threads, for checkpoint modes never and except_last;
* each stage alone at 1 thread, running its GPipe column (M forwards, then M backwards,
  recomputing as the mode says) in plain PyTorch: t = that time / M, and the measured
  bound (M + K - 1) * max over stages of t;
* both stages running their columns at once on two threads, with no pipeline between
  them: the same t under the load the pipeline puts on the machine (on this 2-core
  machine they share the caches and memory bandwidth), and the bound from it.

The first bound is strict (it charges the pipeline for the machine's contention); the
second isolates what the schedule and the runtime cost.

Normalised throughput is relative to GPipe with M=1, as in the paper's Table 2.

    python benchmarks/throughput.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import sys
import threading

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from conveyor import GPipe  # noqa: E402
from conveyor.engine.recompute.replay import recomputes  # noqa: E402
from conveyor.train.models import feed_forward_stack  # noqa: E402

STAGES = 2
BATCH = 256
WIDTH = 512


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--modes", nargs="+", default=["never", "except_last"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = feed_forward_stack(8, WIDTH, 4 * WIDTH)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    halves = [model[:4], model[4:]]

    def with_threads(count: int, body):  # type: ignore[no-untyped-def]
        def step() -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(count)
            try:
                body()
            finally:
                torch.set_num_threads(before)
        return step

    def plain_full() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()

    def plain_microbatches(chunks: int):  # type: ignore[no-untyped-def]
        def step() -> None:
            model.zero_grad(set_to_none=True)
            for xm, ym in zip(x.tensor_split(chunks), y.tensor_split(chunks)):
                (nn.functional.mse_loss(model(xm), ym) * (len(xm) / BATCH)).backward()
        return step

    def pipelined(pipe: GPipe):  # type: ignore[no-untyped-def]
        def step() -> None:
            pipe.zero_grad(set_to_none=True)
            nn.functional.mse_loss(pipe(x), y).backward()
        return step

    def stage_alone(stage: int, chunks: int, mode: str):  # type: ignore[no-untyped-def]
        layers = halves[stage]
        inputs = [t.detach() for t in torch.randn(BATCH, WIDTH).tensor_split(chunks)]
        grads = [torch.randn_like(t) for t in inputs]

        def step() -> None:
            layers.zero_grad(set_to_none=True)
            outputs = []
            for m, xm in enumerate(inputs):
                xm = xm.requires_grad_(stage > 0)
                if recomputes(mode, m, chunks):
                    outputs.append(checkpoint(layers, xm, use_reentrant=False))
                else:
                    outputs.append(layers(xm))
            for m in reversed(range(chunks)):
                outputs[m].backward(grads[m])
        return with_threads(1, step)

    def stages_together(chunks: int, mode: str):  # type: ignore[no-untyped-def]
        columns = [stage_alone(stage, chunks, mode) for stage in range(STAGES)]

        def step() -> None:
            threads = [threading.Thread(target=column) for column in columns]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        return step

    configs = {"plain 1 thread": with_threads(1, plain_full),
               "plain 2 threads": with_threads(2, plain_full)}
    for chunks in args.chunks:
        configs[f"plain 1 thread, M={chunks} in turn"] = with_threads(1, plain_microbatches(chunks))
        for mode in args.modes:
            pipe = GPipe(copy.deepcopy(model), [4, 4], devices=["cpu"] * STAGES, chunks=chunks,
                         recompute=mode)
            configs[f"gpipe {mode} M={chunks}"] = with_threads(2, pipelined(pipe))
            for stage in range(STAGES):
                configs[f"stage {stage} alone {mode} M={chunks}"] = stage_alone(stage, chunks, mode)
            configs[f"stages together {mode} M={chunks}"] = stages_together(chunks, mode)

    print(f"timing {len(configs)} configurations, {args.rounds} rounds ...", file=sys.stderr)
    times = _common.round_robin(configs, args.rounds)
    ms = _common.median_ms(times)

    rows, results = [], []
    for mode in args.modes:
        base = ms[f"gpipe {mode} M={args.chunks[0]}"]
        for chunks in args.chunks:
            t_stage = max(ms[f"stage {s} alone {mode} M={chunks}"] for s in range(STAGES)) / chunks
            t_loaded = ms[f"stages together {mode} M={chunks}"] / chunks
            bound = (chunks + STAGES - 1) * t_stage
            loaded_bound = (chunks + STAGES - 1) * t_loaded
            step = ms[f"gpipe {mode} M={chunks}"]
            sequential = ms[f"plain 1 thread, M={chunks} in turn"]
            result = {
                "checkpoint": mode, "chunks": chunks, "gpipe_ms": step,
                "plain_1_thread_microbatches_ms": sequential, "stage_microbatch_ms": t_stage,
                "bound_ms": bound, "step_over_bound": step / bound,
                "stage_microbatch_loaded_ms": t_loaded, "loaded_bound_ms": loaded_bound,
                "step_over_loaded_bound": step / loaded_bound,
                "speedup_over_plain_microbatches": sequential / step,
                "normalized_throughput": base / step,
            }
            results.append(result)
            rows.append([mode, chunks, f"{sequential:.0f}", f"{step:.0f}", f"{bound:.0f}",
                         f"{step / bound:.3f}", f"{loaded_bound:.0f}",
                         f"{step / loaded_bound:.3f}", f"{sequential / step:.2f}x",
                         f"{base / step:.2f}"])
    table = _common.markdown_table(
        ["checkpoint", "M", "plain 1 thread, M in turn (ms)", "GPipe K=2 (ms)",
         "bound (M+K-1)t, t alone (ms)", "step / bound", "bound, t under load (ms)",
         "step / bound under load", "speedup vs plain M in turn",
         "normalised throughput"], rows)
    print(f"\nconfig P, N={BATCH}: plain model on the whole batch "
          f"{ms['plain 1 thread']:.0f} ms at 1 thread, {ms['plain 2 threads']:.0f} ms at 2\n")
    print(table)
    path = _common.write("throughput", {
        "config": {"blocks": 8, "width": WIDTH, "hidden": 4 * WIDTH, "batch": BATCH,
                   "stages": STAGES, "rounds": args.rounds},
        "median_ms": ms, "results": results, "table": table,
    })
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
