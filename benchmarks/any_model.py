"""Hugging Face GPT-2 and Llama: conveyor against torch's pipeline(), bytes sent, memory.

1. Step time. Each model, built from a small config (``SIZES``) with the same seed on
   every rank (real tensors, no dropout), is cut at its middle block into 2 stages, one
   per process (gloo, 1 intra-op thread each), 1F1B over M micro-batches: conveyor's
   ``Pipeline(split_at=[...])`` without recomputation (torch's schedules recompute
   nothing) and with its default (``except_last``), and torch's ``pipeline()`` +
   ``PipelineStage`` + ``Schedule1F1B`` with the same loss, as is and with its stages
   run as generated code rather than by ``torch.fx.Interpreter`` (see
   ``_hf_pipelines.torch_step``), interleaved round by round.
   A step's time is the slower rank's, from a barrier to the end of its step. The first
   step's loss and gradients are compared with the plain model's on the whole batch,
   the copies of GPT-2's tied embedding included.
2. Bytes sent per step (``_wire.py``): what each process hands to torch.distributed's
   isend / P2POp (activations, gradients, and what a library adds around them), and to
   collectives, counted on a step after the first.
3. Peak memory per rank: GPT-2 at 124M parameters (float32) built on the meta device
   and cut by ``Pipeline(split_at=...)`` over K = 2 and 4 processes, one step on a tiny
   batch; each rank's peak resident memory (``ru_maxrss``) above its baseline after
   imports, and its parameter bytes, against one process that builds the whole model on
   the CPU and takes the same step.

    python benchmarks/any_model.py            # about 4 minutes
    python benchmarks/any_model.py --quick    # tiny sizes, a few steps: checks the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _common

if "WORLD_SIZE" in os.environ:
    _common.prepare_process()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _hf_pipelines import (  # noqa: E402
    Batch,
    Named,
    Step,
    block_count,
    build,
    check_gradients,
    conveyor_step,
    middle_block,
    next_token_loss,
    parameter_bytes,
    reference,
    torch_step,
)
from _wire import count_bytes  # noqa: E402

STAGES = 2
# Batch, sequence length, micro-batches and the models' configs, sized so that a step
# takes ~100 ms of CPU on the busier rank (one thread each) on the 2-core machine the
# README reports.
SIZES: dict[str, dict[str, Any]] = {
    "full": {"batch": 8, "length": 64, "chunks": 4, "vocab": 2048,
             "gpt2": {"n_layer": 4, "n_embd": 160, "n_head": 4},
             "llama": {"num_hidden_layers": 4, "hidden_size": 160, "intermediate_size": 416,
                       "num_attention_heads": 4, "num_key_value_heads": 2}},
    "quick": {"batch": 4, "length": 16, "chunks": 2, "vocab": 256,
              "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 2},
              "llama": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                        "num_attention_heads": 2, "num_key_value_heads": 1}},
}
# GPT-2 small (124M parameters) for the memory part, and the step it takes.
MEMORY_SIZES: dict[str, dict[str, Any]] = {
    "full": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024},
    "quick": {"n_layer": 4, "n_embd": 64, "n_head": 2, "vocab_size": 1024, "n_positions": 64},
}
MEMORY_STEP = {"batch": 4, "length": 16, "chunks": 2}
WARMUP_ROUNDS = 2


# ---------------------------------------------------------------- processes


def spawn(role: str, world: int, args: argparse.Namespace,
          parts: Path) -> Callable[[], list[dict[str, Any]]]:
    """Starts ``world`` processes of this script as ``role``, joined by a file rendezvous
    (no port), one intra-op thread each; returns a function that waits for them and
    returns what they wrote, in rank order."""
    rendezvous = parts / f"rendezvous-{role}-{world}"
    command = [sys.executable, __file__, "--role", role, "--parts", str(parts),
               "--rounds", str(args.rounds), *(["--quick"] if args.quick else [])]
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "RENDEZVOUS": str(rendezvous), "OMP_NUM_THREADS": "1",
               "OMP_WAIT_POLICY": "PASSIVE"}
        processes.append(subprocess.Popen(command, env=env))

    def wait() -> list[dict[str, Any]]:
        codes = [p.wait() for p in processes]
        written = [parts / f"{role}-{world}-{r}.json" for r in range(world)]
        writers = written[:1] if role == "steps" else written  # steps: rank 0 writes
        if any(codes) and not all(path.exists() for path in writers):
            raise SystemExit(f"{role} on {world} processes failed: exit codes {codes}")
        if any(codes):  # a known abort at exit, after the figures: said, not hidden
            print(f"warning: {role} on {world} processes: exit codes {codes} after every "
                  "rank wrote its figures (an abort at process exit, after "
                  "destroy_process_group)", file=sys.stderr)
        return [json.loads(path.read_text()) for path in written if path.exists()]
    return wait


def join() -> int:
    """Joins the launcher's process group; returns this rank."""
    dist.init_process_group("gloo", init_method=f"file://{os.environ['RENDEZVOUS']}",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=300))
    return dist.get_rank()


def save_part(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    (args.parts / f"{args.role}-{world}-{rank}.json").write_text(json.dumps(payload))


def gather(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (a collective)."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def maxrss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- 1 and 2: steps, bytes


def prepare(name: str, size: dict[str, Any], rank: int, *,
            quick: bool) -> tuple[dict[str, Any], dict[str, Step]]:
    """Builds the model's pipelines, checks their first step and counts the bytes of
    their second; returns the findings and the steps to time."""
    batch = Batch(size["batch"], size["length"], size["chunks"], size["vocab"])
    plain_loss, grads, tied = reference(name, size, batch)
    model, blocks = build(name, size, device="meta")
    entry: dict[str, Any] = {
        "split_at": middle_block(model, blocks), "blocks": block_count(model, blocks),
        "parameters": sum(p.numel() for p in model.parameters()),
        "plain_loss": plain_loss, "tied": sorted(tied), "libraries": {}}
    makers: dict[str, Callable[[], tuple[Step, Named]]] = {
        "conveyor": lambda: conveyor_step(name, size, batch, "never"),
        "torch": lambda: torch_step(name, size, batch, rank)}
    if not quick:
        makers["conveyor, recompute"] = lambda: conveyor_step(name, size, batch, "except_last")
        makers["torch, no fx interpreter"] = lambda: torch_step(name, size, batch, rank,
                                                               interpreter=False)
    steps: dict[str, Step] = {}
    for label, make in makers.items():
        try:
            step, named = make()
        except Exception as exc:
            if not label.startswith("torch"):
                raise
            # torch cannot split the model: a finding, recorded as torch words it.
            entry["libraries"][label] = {"failed": f"{type(exc).__name__}: {exc}"}
            continue
        first_bytes, first_loss = count_bytes(step)
        entry["libraries"][label] = {
            "first_loss": gather(first_loss)[-1],
            "gradients": gather(check_gradients(named(), grads, tied)),
            "first_step_bytes": gather(first_bytes),
            "bytes": gather(count_bytes(step)[0]),
        }
        steps[f"{name}: {label}"] = step
    return entry, steps


def timed_rounds(steps: dict[str, Step], rounds: int,
                 rank: int) -> dict[str, dict[str, list[list[float]]]]:
    """Each step once per round, in turn, after warm-up rounds, from a barrier to its
    end on each rank. Returns per step ``{"seconds": ..., "cpu_seconds": ...}``, each
    per round, per rank: wall time, and the CPU time of the rank's process (all its
    threads: what it computed, and any time it spun while waiting)."""
    mine: dict[str, dict[str, list[float]]] = {
        name: {"seconds": [], "cpu_seconds": []} for name in steps}
    for index in range(WARMUP_ROUNDS + rounds):
        for name, step in steps.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            step()
            if index >= WARMUP_ROUNDS:
                mine[name]["seconds"].append(time.perf_counter() - start)
                mine[name]["cpu_seconds"].append(time.process_time() - cpu)
        if rank == 0:
            print(f"  round {index + 1 - WARMUP_ROUNDS}/{rounds} done"
                  if index >= WARMUP_ROUNDS else "  warm-up round done",
                  file=sys.stderr, flush=True)
    ranks = gather(mine)
    return {name: {kind: [[r[name][kind][i] for r in ranks] for i in range(rounds)]
                   for kind in ("seconds", "cpu_seconds")} for name in steps}


def steps_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank = join()
    size = SIZES["quick" if args.quick else "full"]
    models, steps = {}, {}
    for name in ("gpt2", "llama"):
        models[name], more = prepare(name, size, rank, quick=args.quick)
        steps.update(more)
    for label, times in timed_rounds(steps, args.rounds, rank).items():
        name, library = label.split(": ")
        models[name]["libraries"][library].update(times)
    if rank == 0:
        save_part(args, {"size": size, "models": models})
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- 3: memory


def memory_worker(args: argparse.Namespace) -> None:
    """One rank of GPT-2 built on the meta device and cut into WORLD_SIZE stages (or, as
    "whole", the model built on the CPU in one process), one step; its peak memory."""
    import transformers

    import conveyor

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    _ = transformers.GPT2LMHeadModel  # imports the modeling code (transformers is lazy)
    baseline = maxrss_mib()
    size = MEMORY_SIZES["quick" if args.quick else "full"]
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **size)
    batch = Batch(**MEMORY_STEP, vocab=size["vocab_size"])
    torch.manual_seed(0)
    if args.role == "whole":
        model = transformers.GPT2LMHeadModel(config)
        built, params = maxrss_mib(), parameter_bytes(model)
        loss = next_token_loss(model(input_ids=batch.ids, use_cache=False), batch.targets)
        loss.backward()
    else:
        world = int(os.environ["WORLD_SIZE"])
        join()
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        split_at = [f"transformer.h.{k * size['n_layer'] // world}" for k in range(1, world)]
        pipe = conveyor.Pipeline(model, split_at=split_at, sample=batch.sample,
                                 chunks=MEMORY_STEP["chunks"], schedule="1f1b",
                                 loss_fn=next_token_loss)
        built, params = maxrss_mib(), parameter_bytes(pipe)
        pipe.step({"input_ids": batch.ids, "use_cache": False}, batch.targets)
        dist.barrier()
        dist.destroy_process_group()
    save_part(args, {"baseline_mib": baseline, "built_mib": built,
                     "stepped_mib": maxrss_mib(), "parameter_bytes": params})


# ---------------------------------------------------------------- report


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and extremes, in milliseconds."""
    ms = sorted(v * 1e3 for v in values)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median": statistics.median(ms), "p25": quartiles[0], "p75": quartiles[2],
            "min": ms[0], "max": ms[-1]}


def summarize_steps(models: dict[str, Any]) -> None:
    """Adds to each library's entry its step times (the slower rank's per round), the
    ratio to torch's in the same rounds, and its bytes added up over the ranks."""
    for entry in models.values():
        libraries = entry["libraries"]
        torch_rounds = [max(r) for r in libraries.get("torch", {}).get("seconds", [])]
        for result in libraries.values():
            if "failed" in result:
                continue
            rounds = [max(r) for r in result["seconds"]]
            result["step_ms"] = spread(rounds)
            result["rank_median_ms"] = [statistics.median(r[k] for r in result["seconds"]) * 1e3
                                        for k in range(len(result["seconds"][0]))]
            result["rank_median_cpu_ms"] = [
                statistics.median(r[k] for r in result["cpu_seconds"]) * 1e3
                for k in range(len(result["cpu_seconds"][0]))]
            if torch_rounds:
                result["torch_over_this"] = {
                    "medians": statistics.median(torch_rounds) / statistics.median(rounds),
                    "median_of_rounds": statistics.median(
                        t / s for t, s in zip(torch_rounds, rounds, strict=True))}
            total: dict[str, Any] = {}
            for part in ("wire", "messages", "payload", "collective"):
                total[part] = {}
                for rank in result["bytes"]:
                    for kind, value in rank[part].items():
                        total[part][kind] = total[part].get(kind, 0) + value
            total["values"] = {k: v for rank in result["bytes"]
                               for k, v in rank["values"].items() if v}
            result["bytes_per_step"] = total


def kib(n: int) -> str:
    return f"{n / 1024:,.1f}"


def readable(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{kib(n)} KiB"


def tie_holds(gradients: list[dict[str, Any]]) -> str:
    """In words: what the copies of a tied weight hold after a step."""
    copies = [e for g in gradients for e in g.get("tied_copies", {}).values()]
    if not copies:
        return "-"
    if max(copies) < 1e-4:
        return "the whole gradient"
    if gradients[0]["copies_added_over_ranks"] < 1e-4:
        return "a part each (not summed)"
    return "neither the whole nor parts"


def steps_tables(size: dict[str, Any], models: dict[str, Any]) -> str:
    timing, checks, wire = [], [], []
    failures = []
    for name, entry in models.items():
        for library, result in entry["libraries"].items():
            if "failed" in result:
                failures.append(f"- {name}, {library}: torch cannot split this model: "
                                f"{result['failed'].splitlines()[0]}")
                continue
            step, ranks = result["step_ms"], result["rank_median_ms"]
            ratio = result.get("torch_over_this")
            timing.append([
                name, library, f"{step['median']:.1f}", f"{step['p25']:.1f}-{step['p75']:.1f}",
                " / ".join(f"{r:.1f}" for r in ranks),
                " / ".join(f"{r:.1f}" for r in result["rank_median_cpu_ms"]),
                f"{ratio['medians']:.2f}x ({ratio['median_of_rounds']:.2f}x)" if ratio else "-"])
            gradients = result["gradients"]
            tied = [f"{e:.1e}" for g in gradients for e in g.get("tied_copies", {}).values()]
            checks.append([
                name, library, f"{result['first_loss']:.6f}", f"{entry['plain_loss']:.6f}",
                f"{max(g['untied_max_relative_error'] for g in gradients):.1e}",
                " / ".join(tied) or "-", tie_holds(gradients)])
            sent = result["bytes_per_step"]
            payload, on_wire = sent["payload"], sent["wire"]
            wire.append([
                name, library, kib(payload.get("activation", 0)), kib(payload.get("gradient", 0)),
                kib(sum(on_wire.values())), sum(sent["messages"].values()),
                ", ".join(f"{k} {readable(v)}" for k, v in sent["collective"].items()) or "-",
                "; ".join(sent["values"].get("activation", []))])
    sizes = ", ".join(f"{name} {entry['parameters'] / 1e6:.2f}M parameters, "
                      f"{entry['blocks']} blocks split at {entry['split_at']}"
                      for name, entry in models.items())
    text = [f"batch {size['batch']} x {size['length']} tokens, vocabulary {size['vocab']}, "
            f"M={size['chunks']} micro-batches, 2 stages on 2 processes; {sizes}", "",
            _common.markdown_table(
                ["model", "library", "step (ms, median)", "p25-p75 (ms)",
                 "rank 0 / rank 1 (ms)", "CPU time, rank 0 / rank 1 (ms)",
                 "torch / this (medians; per round)"], timing),
            "", _common.markdown_table(
                ["model", "library", "first loss", "plain loss", "untied grads, max rel. err",
                 "tied copies' grads, rel. err per rank", "tied copies hold"],
                checks),
            "", _common.markdown_table(
                ["model", "library", "activations (KiB)", "gradients (KiB)",
                 "on the wire (KiB)", "sends", "collectives",
                 "one activation message carries"], wire)]
    return "\n".join(text + ([""] + failures if failures else []))


def memory_table(memory: dict[str, list[dict[str, Any]]]) -> str:
    whole = memory["1"][0]
    whole_peak = whole["stepped_mib"] - whole["baseline_mib"]
    rows = []
    for processes, ranks in memory.items():
        for rank, part in enumerate(ranks):
            built = part["built_mib"] - part["baseline_mib"]
            peak = part["stepped_mib"] - part["baseline_mib"]
            rows.append([processes if processes != "1" else "1 (whole model)",
                         rank, f"{part['parameter_bytes'] / 2**20:.0f}",
                         f"{part['parameter_bytes'] / whole['parameter_bytes']:.2f}",
                         f"{built:.0f}", f"{peak:.0f}", f"{peak / whole_peak:.2f}"])
    return _common.markdown_table(
        ["processes", "rank", "parameters (MiB)", "of the whole", "peak RSS after build (MiB)",
         "peak RSS after a step (MiB)", "of the whole's"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, two rounds, memory on 2 processes only")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 30)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default: results/any_model.json; none with "
                             "--quick)")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--parts", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "steps":
        steps_worker(args)
        return 0
    if args.role in ("pipeline", "whole"):
        memory_worker(args)
        return 0
    args.rounds = args.rounds or (2 if args.quick else 30)
    # Other work on the machine makes the times noisy. The load average at the end of the
    # timed rounds counts this benchmark's own 2 processes too (about 2).
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as directory:
        parts = Path(directory)
        finish_steps = spawn("steps", STAGES, args, parts)
        # Steps are timed alone (but --quick's timings mean nothing); peak memory does
        # not mind company.
        steps = None if args.quick else finish_steps()[0]
        load.append(os.getloadavg()[0])
        # One memory run at a time (the peaks are each process's own, but seven
        # processes of GPT-2 small on two cores are slow).
        memory = {"1": spawn("whole", 1, args, parts)()}
        for processes in (2,) if args.quick else (2, 4):
            memory[str(processes)] = spawn("pipeline", processes, args, parts)()
        steps = steps or finish_steps()[0]
    summarize_steps(steps["models"])
    table = steps_tables(steps["size"], steps["models"])
    table += "\n\n" + memory_table(memory)
    print(table)
    print(f"\nload average (1 min) before the steps and at their end: {load[0]:.1f}, "
          f"{load[1]:.1f}")
    out = args.out or (None if args.quick else _common.RESULTS / "any_model.json")
    if out is not None:
        size = MEMORY_SIZES["quick" if args.quick else "full"]
        payload = {"config": {"steps": steps["size"], "rounds": args.rounds,
                              "warmup_rounds": WARMUP_ROUNDS, "processes": STAGES,
                              "backend": "gloo", "threads_per_process": 1,
                              "load_average_1min_before_and_end_of_steps": load,
                              "memory_model": size, "memory_step": MEMORY_STEP},
                   "models": steps["models"], "memory": memory, "table": table}
        print(f"\nwrote {_common.write('any_model', payload, path=out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
