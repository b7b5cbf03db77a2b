"""Compiled stages against eager ones, on CPU threads, in one run.

    python benchmarks/compiled.py                 # config P and the Transformer LM
    python benchmarks/compiled.py --rounds 3 --quick

Two stages on CPU threads, M=8, the default recomputation (``except_last``), under GPipe,
1F1B and zero-bubble: each pipeline once with eager stages and once with
``compile=True``, timed in turn (round robin, after a warm-up step that compiles). Two
models: config P (8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), N=256, MSE), an
``nn.Sequential`` whose stages each run as one compiled graph (and a recomputed
micro-batch as a second one, which recomputes inside its backward), and the Transformer
LM of ``benchmarks/schedules.py``, traced and cut by ``split_at`` (each stage's graph
compiled; recomputed by calling it again). Also reported: how many graphs torch.compile made (a recompilation in the
middle of the timed steps would show as more) and the compiled step's error against
the eager one. Writes ``benchmarks/results/compiled.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor.train.models import feed_forward_stack, transformer_lm  # noqa: E402

STAGES, CHUNKS = 2, 8
SCHEDULES = ("gpipe", "1f1b", "zero-bubble")


class Blocks(nn.Module):
    """The Transformer LM as a model with a forward of its own (traced, not a list)."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def models(quick: bool) -> dict[str, dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    length = 32 if quick else 128
    tokens = torch.randint(0, 256, (32, length + 1), generator=generator)
    width = 256 if quick else 512
    return {
        "config P": {
            "build": lambda: feed_forward_stack(8, width, 4 * width),
            "x": torch.randn(256, width, generator=generator),
            "y": torch.randn(256, width, generator=generator),
            "loss": nn.functional.mse_loss, "options": {"balance": [4, 4]}},
        "transformer_lm traced": {
            "build": lambda: Blocks(transformer_lm(4, 256, 1024, 4, vocab=256,
                                                   max_length=length)),
            "x": tokens[:, :-1], "y": tokens[:, 1:], "loss": lm_loss,
            "options": {"split_at": ["layers.3"], "sample": tokens[:4, :-1]}},
    }


def pipeline(spec: dict[str, Any], schedule: str, compiled: bool) -> conveyor.Pipeline:
    torch.manual_seed(0)
    return conveyor.Pipeline(spec["build"](), loss_fn=spec["loss"], chunks=CHUNKS,
                             schedule=schedule, devices=["cpu"] * STAGES,
                             compile=compiled, **spec["options"])


def stepper(pipe: conveyor.Pipeline, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        pipe.zero_grad(set_to_none=False)
        pipe.step(x, y)
    return step


def gradient_error(eager: conveyor.Pipeline, compiled: conveyor.Pipeline) -> float:
    """The largest relative difference of a gradient after one step of each."""
    worst = 0.0
    for (_, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        if a.grad is not None and b.grad is not None:
            worst = max(worst, float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-30)))
    return worst


def measure(name: str, spec: dict[str, Any], rounds: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    steps, pipes = {}, {}
    for schedule in SCHEDULES:
        for compiled in (False, True):
            key = f"{schedule} {'compiled' if compiled else 'eager'}"
            pipes[key] = pipeline(spec, schedule, compiled)
            steps[key] = stepper(pipes[key], spec["x"], spec["y"])
    before = counters["stats"]["unique_graphs"]
    for step in steps.values():  # compiles; the round robin warms up once more
        step()
    errors = {schedule: gradient_error(pipes[f"{schedule} eager"], pipes[f"{schedule} compiled"])
              for schedule in SCHEDULES}
    graphs_first = counters["stats"]["unique_graphs"] - before
    print(f"{name}: timing {len(steps)} pipelines, {rounds} rounds", file=sys.stderr)
    measured = _common.median_ms(_common.round_robin(steps, rounds))
    graphs_after = counters["stats"]["unique_graphs"] - before
    speed = {schedule: measured[f"{schedule} eager"] / measured[f"{schedule} compiled"]
             for schedule in SCHEDULES}
    return {"step_ms": measured, "compiled_speed": speed, "gradient_error": errors,
            "graphs_compiled_first_step": graphs_first,
            "graphs_compiled_in_timed_steps": graphs_after - graphs_first}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller models (a check)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core per stage's thread
    results = {name: measure(name, spec, args.rounds)
               for name, spec in models(args.quick).items()}
    for name, result in results.items():
        print(f"\n{name}, {STAGES} stages on CPU threads, M={CHUNKS}, except_last")
        print(_common.markdown_table(
            ["schedule", "eager (ms)", "compiled (ms)", "compiled speed", "grad error"],
            [[s, f"{result['step_ms'][f'{s} eager']:.1f}",
              f"{result['step_ms'][f'{s} compiled']:.1f}", f"{result['compiled_speed'][s]:.2f}x",
              f"{result['gradient_error'][s]:.1e}"] for s in SCHEDULES]))
        print(f"graphs compiled: {result['graphs_compiled_first_step']} in the first steps, "
              f"{result['graphs_compiled_in_timed_steps']} after")
    if not args.quick:
        payload = {"stages": STAGES, "chunks": CHUNKS, "results": results}
        print(f"wrote {_common.write('compiled', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
