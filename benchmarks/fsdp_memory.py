"""Memory per rank of data-parallel replicas held whole or sharded with FSDP2.

``conveyor train``'s Transformer at T(8, 2048, 8), width 512, a tied byte embedding
(25.4M parameters), cut into 2 stages, 1F1B over 2 micro-batches, AdamW; D replicas of
the pipeline (world 2·D, gloo on the CPU), ``sharding="replicate"`` against
``sharding="fsdp"``. After three steps (step, clip, AdamW; the last step's gradients
kept), every rank counts the bytes its tensors' local storage holds: parameters,
gradients, AdamW's state (``DTensor.to_local()`` for a shard), and what FSDP still holds
gathered (0 between steps). Peak RSS is the process's whole high-water mark (Python,
torch, buffers, and within a step the gathered parameters and unsharded gradients that
deferring the reduce-scatter to the step's end keeps).

    python benchmarks/fsdp_memory.py                      # D=2: 2 launches of 4 processes
    python benchmarks/fsdp_memory.py --data-parallel 2 4  # and D=4: 8 processes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

STAGES, LAYERS, WIDTH, HIDDEN, HEADS, LENGTH, PER_REPLICA, CHUNKS = 2, 8, 512, 2048, 8, 64, 4, 2
SHARDINGS = ("replicate", "fsdp")


def launch(args: argparse.Namespace) -> int:
    """Runs one torchrun per (D, sharding), then prints and writes the table."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for replicas in args.data_parallel:
            for sharding in SHARDINGS:
                out = Path(scratch) / f"{sharding}-{replicas}"
                out.mkdir()
                env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                       "PYTHONPATH": str(_common.ROOT)}
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(STAGES * replicas), __file__,
                           "--sharding", sharding, "--data-parallel", str(replicas),
                           "--into", str(out)]
                print(f"D={replicas} {sharding}: {STAGES * replicas} processes",
                      file=sys.stderr, flush=True)
                if subprocess.run(command, env=env).returncode:
                    return 1
                rows += [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    table = _summary(rows)
    print(_common.markdown_table(
        ["D", "sharding", "params MB", "grads MB", "AdamW MB", "total MB", "x replicate",
         "gathered MB", "peak RSS MB", "s/step"],
        [[r["data_parallel"], r["sharding"], *(f"{r[k] / 1e6:.1f}" for k in (
            "parameter_bytes", "gradient_bytes", "optimizer_bytes", "total_bytes")),
          f"{r['of_replicate']:.3f}", f"{r['gathered_bytes'] / 1e6:.1f}",
          f"{r['peak_rss_bytes'] / 1e6:.0f}", f"{r['seconds_per_step']:.2f}"]
         for r in table]))
    path = _common.write("fsdp_memory", {
        "model": {"layers": LAYERS, "width": WIDTH, "hidden": HIDDEN, "heads": HEADS,
                  "vocab": 256, "length": LENGTH, "tie": True,
                  "parameters": rows[0]["model_parameters"]},
        "pipeline": {"stages": STAGES, "schedule": "1f1b", "chunks": CHUNKS,
                     "sequences_per_replica": PER_REPLICA, "optimizer": "AdamW"},
        "summary": table, "ranks": rows}, args.out)
    print(f"wrote {path}")
    return 0


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (D, sharding): the largest rank's bytes (the one that must fit), and its
    ratio to replication's."""
    table = []
    for replicas in sorted({r["data_parallel"] for r in rows}):
        largest: dict[str, dict[str, Any]] = {}
        for sharding in SHARDINGS:
            ranks = [r for r in rows if r["data_parallel"] == replicas
                     and r["sharding"] == sharding]
            largest[sharding] = dict(max(ranks, key=lambda r: r["total_bytes"]))
            largest[sharding]["seconds_per_step"] = max(r["seconds_per_step"] for r in ranks)
            largest[sharding]["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ranks)
        for sharding in SHARDINGS:
            entry = largest[sharding]
            entry["of_replicate"] = entry["total_bytes"] / largest["replicate"]["total_bytes"]
            table.append({k: v for k, v in entry.items() if k != "rank"})
    return table


def _local_bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _gathered_bytes(pipe: Any) -> int:
    """Bytes of FSDP's gathered (unsharded) parameters still allocated."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in pipe.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    gathered = getattr(param, "_unsharded_param", None)
                    if gathered is not None:
                        total += gathered.untyped_storage().nbytes()
    return total


def worker(args: argparse.Namespace) -> None:
    """One rank: three training steps, then its bytes as JSON in ``--into``."""
    _common.prepare_process()
    import torch
    import torch.distributed as dist

    import conveyor
    from conveyor.train.language import summed_next_token_loss
    from conveyor.train.models import transformer_lm

    torch.manual_seed(0)
    model = transformer_lm(LAYERS, WIDTH, HIDDEN, HEADS, vocab=256, max_length=LENGTH,
                           tie=True)
    parameters = sum(p.numel() for p in model.parameters())
    pipe = conveyor.Pipeline(model, chunks=CHUNKS, schedule="1f1b",
                             data_parallel=args.data_parallel, sharding=args.sharding,
                             loss_fn=summed_next_token_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    times = []
    for step in range(3):
        ids = torch.randint(0, 256, (PER_REPLICA, LENGTH + 1),
                            generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        pipe.step(ids[:, :-1], ids[:, 1:])
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    row = {
        "rank": dist.get_rank(), "pipeline_rank": pipe.topology.pipeline_rank,
        "data_parallel": args.data_parallel, "sharding": args.sharding,
        "model_parameters": parameters,
        "parameter_bytes": sum(_local_bytes(p) for p in pipe.parameters()),
        "gradient_bytes": sum(_local_bytes(p.grad) for p in pipe.parameters()
                              if p.grad is not None),
        "optimizer_bytes": sum(_local_bytes(v) for state in optimizer.state.values()
                               for v in state.values() if isinstance(v, torch.Tensor)),
        "gathered_bytes": _gathered_bytes(pipe),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds_per_step": statistics.median(times[1:]),
    }
    row["total_bytes"] = row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"]
    Path(args.into, f"rank{dist.get_rank()}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-parallel", type=int, nargs="+", default=[2])
    parser.add_argument("--sharding", choices=SHARDINGS, help=argparse.SUPPRESS)
    parser.add_argument("--into", help=argparse.SUPPRESS)  # a worker's output folder
    parser.add_argument("--out", type=Path, default=None,
                        help="result file (default benchmarks/results/fsdp_memory.json)")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        args.data_parallel = args.data_parallel[0]
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
