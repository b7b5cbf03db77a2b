"""Everything conveyor claims on a GPU, measured by one command.

Run it first whenever a machine with CUDA is at hand:

    python benchmarks/gpu.py                 # about 2.5 minutes on one H100
    python benchmarks/gpu.py --parts tests,overhead
    python benchmarks/gpu.py --smoke         # every part at toy sizes on the CPU (a check)

Without CUDA (and without ``--smoke``) it says so and exits 0. On a torch older than
conveyor's floor (2.11 on the GPU machines here), run it with CONVEYOR_UNTESTED_TORCH=1.
The parts, in order:

* ``tests``: ``pytest tests/test_cuda.py tests/test_compiled_backward.py
  tests/test_cuda_graphs.py`` in a child process (its counts and failures);
* ``compiled``: compiled stages against eager in bf16 under 1F1B and zero-bubble, and
  1F1B's replayed from CUDA graphs (the goal: 1.15x), beside the plain model eager and
  compiled whole;
* ``equivalence``: generated models (``tests/generated``) on ``cuda``, every stage on
  it, against the plain model in float64;
* ``overhead``: K stages on one GPU (``cuda:0`` x K, M = 4K, no recomputation) against
  the plain model's step: the runtime's own cost (goal: at most 1.05x); and each with
  autograd's accumulation of weight gradients instead of conveyor's fused one;
* ``schedules``: every schedule on 4 stages of one GPU: step time and the activation
  memory it holds, against the planner's simulation (time calibrated on 1F1B);
* ``precision``: the plain model (eager, and compiled whole) and 2 stages (M=8) in
  float32, under the caller's bf16 autocast, with ``precision="bf16"`` and ``"fp16"``,
  and with ``compile=True`` (each stage one graph; also without ``EagerLayout``, and
  under zero-bubble): time, memory, and the GPU's busy share of a step;
* ``table1``: the paper's Table 1 on one GPU capped at 16 GiB: the largest
  Transformer that trains naively, with Pipeline-1 (re-materialization and
  micro-batches) and with its activations offloaded (``offload="activations"``), and
  the activation memory of each at one size; then the same for 4 sequences of 32k
  tokens (long context);
* ``speedup`` (two or more GPUs): K = 2, 4 stages on K GPUs against one.

It writes ``benchmarks/results/gpu.json``, ``gpu.md`` (the tables) and ``gpu.png``. To
measure some parts again and keep the others, run them into another folder and merge:
``python benchmarks/gpu_report.py benchmarks/results/gpu.json new/gpu.json``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import _common

_common.prepare_process()
sys.path.insert(0, str(_common.ROOT))  # tests.generated, for the equivalence part

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor.observe.plan import OPTIMIZER_BYTES, measure, plan  # noqa: E402
from conveyor.schedules.builders import SCHEDULES, V_SHAPES  # noqa: E402
from conveyor.train.models import transformer_lm  # noqa: E402

PARTS = ("tests", "compiled", "equivalence", "overhead", "schedules", "precision", "table1",
         "speedup")


class Sizes:
    """The model and batch each part uses; ``smoke`` shrinks them to seconds on a CPU."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.layers, self.width, self.hidden, self.heads = (4, 32, 64, 2) if smoke else (
            8, 1024, 4096, 16)
        self.vocab, self.length, self.batch = (64, 16, 16) if smoke else (8192, 512, 32)
        self.rounds = 1 if smoke else 5
        self.seeds = 1 if smoke else 12
        self.memory_gib = 16.0

    def model(self, layers: int | None = None) -> nn.Sequential:
        return transformer_lm(layers or self.layers, self.width, self.hidden, self.heads,
                              vocab=self.vocab, max_length=self.length)

    def batch_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (self.batch, self.length + 1), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               chunks: int = 1) -> Callable[[], None]:
    """The plain model's step; with ``chunks``, micro-batch after micro-batch
    (gradient accumulation: the same small kernels as a pipeline, no pipeline)."""
    def step() -> None:
        model.zero_grad(set_to_none=False)
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (lm_loss(model(xs), ys) * (len(xs) / len(x))).backward()
        synchronize(x.device)
    return step


def pipe_step(pipe: conveyor.Pipeline, x: torch.Tensor, y: torch.Tensor,
              device: torch.device) -> Callable[[], None]:
    def step() -> None:
        pipe.zero_grad(set_to_none=False)
        pipe.step(x, y)
        synchronize(device)
    return step


def activation_bytes(step: Callable[[], None], device: torch.device) -> float | None:
    """The memory one step holds beyond what is resident before it (weights, grads)."""
    if device.type != "cuda":
        return None
    step()  # grads exist from here on: they count as resident
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    return float(torch.cuda.max_memory_allocated(device) - before)


def time_configs(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    return _common.median_ms(_common.round_robin(steps, rounds))


def part_tests(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "tests/test_cuda.py",
               "tests/test_compiled_backward.py", "tests/test_cuda_graphs.py", "-p",
               "no:cacheprovider", "-o", "faulthandler_timeout=60", "-rfEs"]
    if sizes.smoke:
        command += ["--collect-only"]
    done = subprocess.run(command, cwd=_common.ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "240"})  # (reasons)
    lines = done.stdout.strip().splitlines()
    counts = [line.strip("= ") for line in lines
              if any(w in line for w in (" passed", " failed", " error", "collected"))]
    return {"command": " ".join(command[1:]), "returncode": done.returncode,
            "summary": counts[-1] if counts else (lines[-1:] or [done.stderr[-500:]])[0],
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
            "output_tail": done.stdout[-8000:] if done.returncode else ""}


def part_equivalence(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    from tests.generated.cases import TOLERANCE, draw_cases
    from tests.generated.running import quiet, run_cases

    quiet()
    worst, failures, count = 0.0, [], 0
    for seed in range(sizes.seeds):
        cases = draw_cases(seed)
        for case, result in zip(cases, run_cases(cases, device=str(device))):
            count += 1
            worst = max(worst, result.error)
            if not result.error <= TOLERANCE:
                failures.append(f"seed {seed} variant {case.variant}: {result.error:.2e} "
                                f"at {result.where}" + (f" ({result.exception!r})"[:300]
                                                        if result.exception else ""))
        print(f"  seed {seed}: {count} cases, worst {worst:.1e}", file=sys.stderr, flush=True)
    return {"cases": count, "seeds": sizes.seeds, "worst_error": worst,
            "tolerance": TOLERANCE, "failures": failures}


def part_overhead(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    x, y = sizes.batch_on(device)
    torch.manual_seed(0)
    plain = sizes.model().to(device)
    steps = {"plain": plain_step(plain, x, y)}
    for stages in (1, 2, 4):
        steps[f"plain, M={4 * stages} accumulated"] = plain_step(plain, x, y, 4 * stages)
    for stages, fused in itertools.product((1, 2, 4), (True, False)):
        torch.manual_seed(0)
        os.environ["CONVEYOR_FUSE_ACCUMULATION"] = "1" if fused else "0"  # read as it cuts
        pipe = conveyor.Pipeline(sizes.model().to(device), loss_fn=lm_loss,
                                 chunks=4 * stages, schedule="1f1b", recompute="never",
                                 balance=balanced(sizes, stages), devices=[device] * stages)
        del os.environ["CONVEYOR_FUSE_ACCUMULATION"]
        name = f"K={stages}, M={4 * stages}" + ("" if fused else ", autograd's accumulation")
        steps[name] = pipe_step(pipe, x, y, device)
    measured = time_configs(steps, sizes.rounds)
    return {"step_ms": measured,
            "over_plain": {name: ms / measured["plain"] for name, ms in measured.items()},
            "over_accumulated": {
                name: ms / measured[f"plain, M={name.split('M=')[1].split(',')[0]} accumulated"]
                for name, ms in measured.items() if name.startswith("K=")}}


def balanced(sizes: Sizes, stages: int) -> list[int]:
    """The embedding and the norm + head ride with the first and last block's stage."""
    per, extra = divmod(sizes.layers, stages)
    blocks = [per + (s < extra) for s in range(stages)]
    blocks[0] += 1
    blocks[-1] += 2
    return blocks


def part_schedules(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    ranks, chunks = 4, 8
    x, y = sizes.batch_on(device)
    with torch.device("meta"):
        figures = measure(sizes.model(), x.to("meta"))
    plans, steps, held = {}, {}, {}
    for name in SCHEDULES:
        virtual = 2 if name == "interleaved-1f1b" else 1
        stages = ranks * (2 if name in V_SHAPES or virtual == 2 else 1)
        if sizes.layers + 3 < stages:
            continue
        found = plan(figures, devices=ranks, memory=float("inf"), batch=sizes.batch,
                     chunks=chunks, schedule=name, virtual_stages=virtual,
                     rematerialize=False, optimizer="sgd", flops_per_second=1.0)
        torch.manual_seed(0)
        pipe = conveyor.Pipeline(sizes.model().to(device), loss_fn=lm_loss, chunks=chunks,
                                 schedule=name, virtual_stages=virtual, recompute="never",
                                 balance=found.balance, devices=[device] * ranks)
        plans[name], steps[name] = found, pipe_step(pipe, x, y, device)
        held[name] = activation_bytes(steps[name], device)
    measured = time_configs(steps, sizes.rounds)
    rate = plans["1f1b"].step_time / measured["1f1b"]
    parameters = sum(f.parameters for f in figures)
    predicted_bytes = {name: sum(p.rank_bytes) - parameters * OPTIMIZER_BYTES["sgd"]
                       for name, p in plans.items()}
    return {"ranks": ranks, "chunks": chunks, "step_ms": measured,
            "predicted_ms": {name: p.step_time / rate for name, p in plans.items()},
            "activation_bytes": held, "predicted_activation_bytes": predicted_bytes}


def part_precision(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """Each precision eager and compiled; the compiled variants: stages as whole graphs
    (what ``compile=True`` does), without the copies into eager's layout (their
    cost), under zero-bubble (weight gradients in ``I``); and the plain
    model compiled whole, the most torch.compile gives this model. The GPU's busy share
    of a step tells host-bound from GPU-bound."""
    x, y = sizes.batch_on(device)
    steps, held = {}, {}
    torch.manual_seed(0)
    plain = sizes.model().to(device)
    plains = [("plain float32", plain, None), ("plain bf16 autocast", plain, torch.bfloat16)]
    if not sizes.smoke:
        plains.append(("plain bf16 autocast, compiled", torch.compile(plain), torch.bfloat16))
    for label, model, dtype in plains:
        step = plain_step(model, x, y, 8)
        steps[label] = step if dtype is None else autocast(step, device, dtype)
        held[label] = activation_bytes(steps[label], device)
    bf16: dict[str, Any] = {"precision": "bf16"}
    variants: list[tuple[str, torch.dtype | None, dict[str, Any]]] = [
        ("float32", None, {}), ("bf16 autocast", torch.bfloat16, {}),
        ("precision='bf16'", None, bf16), ("precision='fp16'", None, {"precision": "fp16"}),
        ("float32 compiled", None, {"compile": True}),
        ("bf16 compiled", None, {"compile": True, **bf16}),
        ("fp16 compiled", None, {"compile": True, "precision": "fp16"}),
        ("bf16 compiled, no EagerLayout", None, {"compile": True, **bf16}),
        ("precision='bf16', zero-bubble", None, {"schedule": "zero-bubble", **bf16}),
        ("bf16 compiled, zero-bubble", None, {"schedule": "zero-bubble", "compile": True,
                                              **bf16})]
    if sizes.smoke:  # each kind once: a compile takes seconds on the CPU, and the
        # compiled part's smoke run compiles 1F1B and zero-bubble in bf16
        variants = [v for v in variants if v[0] in (
            "float32", "bf16 autocast", "precision='bf16'", "bf16 compiled, no EagerLayout")]
    errors = two_stage_variants(sizes, device, variants, steps, held)
    measured = time_configs(steps, sizes.rounds)
    busy = {label: gpu_busy(steps[label], device) for label in (
        "plain bf16 autocast", "plain bf16 autocast, compiled", "precision='bf16'",
        "bf16 compiled") if label in steps}
    return {"step_ms": measured, "activation_bytes": held, "gpu_busy": busy, "errors": errors}


def two_stage_variants(sizes: Sizes, device: torch.device,
                       variants: list[tuple[str, torch.dtype | None, dict[str, Any]]],
                       steps: dict[str, Callable[[], None]],
                       held: dict[str, Any]) -> dict[str, str]:
    """Adds to ``steps`` and ``held`` a step of 2 stages (M=8, 1F1B unless the options
    say otherwise, no recomputation) per variant: its label, the caller's autocast dtype
    (or None) and its options. Returns the errors of the variants that failed."""
    x, y = sizes.batch_on(device)
    errors = {}
    for label, dtype, options in variants:
        torch.manual_seed(0)
        model = sizes.model().to(device)
        pipe = conveyor.Pipeline(model, loss_fn=lm_loss, chunks=8, recompute="never",
                                 balance=balanced(sizes, 2), devices=[device] * 2,
                                 **{"schedule": "1f1b", **options})
        step = pipe_step(pipe, x, y, device)
        if label.endswith("no EagerLayout"):
            step = without_eager_layout(pipe, step)
        if dtype is not None:
            step = autocast(step, device, dtype)
        try:  # its first steps; a variant that fails is reported, the others measured
            held[label] = activation_bytes(step, device)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            errors[label] = f"{type(exc).__name__}: {exc}"[:500]
            continue
        steps[label] = step
    return errors


def part_compiled(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """Compiled stages against eager ones in bf16 (``precision="bf16"``), under 1F1B and
    zero-bubble (whose compiled backward is an I and a W graph), 1F1B's also replayed
    from CUDA graphs, with the plain model eager and compiled whole for reference: the
    part to run first when the GPU's time is short (the precision part weighs every
    precision)."""
    x, y = sizes.batch_on(device)
    steps, held = {}, {}
    torch.manual_seed(0)
    plain = sizes.model().to(device)
    plains = [("plain", plain)] + ([] if sizes.smoke else [  # (a compile: seconds on a CPU)
        ("plain, compiled whole", torch.compile(plain))])
    for label, model in plains:
        steps[label] = autocast(plain_step(model, x, y, 8), device, torch.bfloat16)
        held[label] = activation_bytes(steps[label], device)
    bf16: dict[str, Any] = {"precision": "bf16"}
    variants: list[tuple[str, torch.dtype | None, dict[str, Any]]] = [
        (f"{schedule}{' compiled' if compiled else ''}", None,
         {"schedule": schedule, "compile": compiled, **bf16})
        for schedule in ("1f1b", "zero-bubble") for compiled in (False, True)]
    if device.type == "cuda":  # (refused elsewhere)
        variants.append(("1f1b compiled, CUDA graphs", None,
                         {"compile": True, "cuda_graphs": True, **bf16}))
    errors = two_stage_variants(sizes, device, variants, steps, held)
    measured = time_configs(steps, sizes.rounds)
    speed = {label: measured[label.split()[0]] / measured[label] for label in measured
             if label.split()[0] in ("1f1b", "zero-bubble") and label.split()[0] != label}
    busy = {label: gpu_busy(step, device) for label, step in steps.items()}
    return {"step_ms": measured, "activation_bytes": held, "compiled_speed": speed,
            "gpu_busy": busy, "errors": errors}


def gpu_busy(step: Callable[[], None], device: torch.device) -> float | None:
    """The share of one step's time in which the GPU runs a kernel (from torch's
    profiler; kernels of several streams counted once): well under 1, the step waits
    on the host."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - start) * 1e6
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    covered, reach = 0.0, float("-inf")
    for begin, end in spans:
        if end > reach:
            covered += end - max(begin, reach)
            reach = end
    return covered / wall_us if wall_us else None


def without_eager_layout(pipe: conveyor.Pipeline, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the copies of compiled outputs into eager's layout taken off: their
    cost is the difference in time. Not exact where dropout follows a compiled layer;
    this model has no dropout."""
    for stage in pipe.runtime.stages.values():
        if stage.compiled is not None:
            stage.compiled.graph._layout = lambda *args: None
    return step


def autocast(step: Callable[[], None], device: torch.device,
             dtype: torch.dtype) -> Callable[[], None]:
    def cast() -> None:
        with torch.autocast(device.type, dtype=dtype):
            step()
    return cast


def part_table1(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    import pipeline1_gpu

    args = argparse.Namespace(width=2048, hidden=8192, heads=16, vocab=32000, length=512,
                              batch=32, chunks=32)
    if sizes.smoke:
        args = argparse.Namespace(width=32, hidden=64, heads=2, vocab=50, length=8, batch=4,
                                  chunks=2)
    resident = 0
    if device.type == "cuda":
        # What the parts before it left (compiled graphs hold their weights) would count
        # against the cap: drop it, and cap what is allocated from here on.
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        resident = torch.cuda.memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, (resident + sizes.memory_gib * 2**30) / total), device)
    log: list[dict[str, Any]] = []
    limit = 4 if sizes.smoke else 256
    largest = _largest(pipeline1_gpu, args, device, log, limit)
    # Long context: 4 sequences of 32k tokens, one a micro-batch, and a vocabulary of
    # 8192: at 32000, one sequence's float32 logits alone are 3.9 GiB, and the naive
    # step's whole batch of them 16 GiB, the cap; the head would decide the search, not
    # the blocks. (The pipelines compute the loss micro-batch by micro-batch: on the
    # H200, when Pipeline-1 took the whole batch's output, no mode fit one block.)
    long_args = argparse.Namespace(**{**vars(args), "length": 16 if sizes.smoke else 32768,
                                      "batch": 4, "chunks": 4,
                                      "vocab": args.vocab if sizes.smoke else 8192})
    long_largest = _largest(pipeline1_gpu, long_args, device, log, min(limit, 32))
    at = max(1, largest["naive"])
    held = {mode: pipeline1_gpu.activation_bytes(at, mode=mode, args=args, device=device)
            for mode in pipeline1_gpu.MODES}
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    params = {name: pipeline1_gpu.parameters(layers, args) for name, layers in largest.items()}
    return {"memory_gib": sizes.memory_gib, "config": vars(args), "largest_layers": largest,
            "parameters": params, "activation_layers": at, "activation_bytes": held,
            "long_context": {"config": vars(long_args), "largest_layers": long_largest},
            "resident_before_bytes": resident, "attempts": log}


def _largest(pipeline1_gpu: Any, args: argparse.Namespace, device: torch.device,
             log: list[dict[str, Any]], limit: int) -> dict[str, int]:
    """Per way to train (naive, Pipeline-1, offload), the most blocks that train."""
    return {mode: pipeline1_gpu.largest_fitting(
        lambda n, m=mode: pipeline1_gpu.fits(n, mode=m, args=args, device=device, log=log),
        limit=limit) for mode in pipeline1_gpu.MODES}


def part_speedup(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s): needs two or more"}
    x, y = sizes.batch_on(device)
    steps = {}
    for stages in (1, 2, 4):
        if stages > gpus:
            break
        torch.manual_seed(0)
        devices = [torch.device("cuda", i) for i in range(stages)]
        pipe = conveyor.Pipeline(sizes.model().to(device), loss_fn=lm_loss, chunks=4 * stages,
                                 schedule="1f1b", recompute="except_last",
                                 balance=balanced(sizes, stages), devices=devices)
        steps[f"K={stages}"] = pipe_step(pipe, x, y, devices[-1])
    measured = time_configs(steps, sizes.rounds)
    return {"step_ms": measured,
            "speedup": {name: measured["K=1"] / ms for name, ms in measured.items()}}


RUNNERS: dict[str, Callable[[Sizes, torch.device], dict[str, Any]]] = {
    "tests": part_tests, "compiled": part_compiled, "equivalence": part_equivalence, "overhead": part_overhead,
    "schedules": part_schedules, "precision": part_precision, "table1": part_table1,
    "speedup": part_speedup,
}


def run_parts(names: list[str], sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """Each part's results, or its error: one part failing does not stop the others."""
    results: dict[str, Any] = {}
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            results[name] = RUNNERS[name](sizes, device)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next part runs
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {results[name]['seconds']} s", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on the CPU, to check the script without a GPU")
    parser.add_argument("--out", default=str(_common.RESULTS),
                        help="folder for gpu.json, gpu.md and gpu.png")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing measured "
              "(--smoke checks the script on the CPU)")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda:0")
    results = run_parts(names, Sizes(args.smoke), device)
    from gpu_report import write_report

    for path in write_report(results, args.out, smoke=args.smoke):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
