"""Pipeline-1 on one GPU: the largest Transformer that trains naively vs with GPipe.

The paper's Table 1 (Pipeline-1 column): on one accelerator, re-materialization and
micro-batches alone let a much larger model train (AmoebaNet: 82M to 318M parameters,
3.9x; Transformer-L: 3 to 13 layers). This reproduces it for a Transformer T(L, 8192,
16) of width 2048 trained with RMSProp (12 bytes per parameter, as the paper):

* naive: the plain model on the whole batch;
* Pipeline-1: ``Pipeline(model, balance=[L + 3], chunks=M, recompute="except_last",
  loss_fn=...)``: the loss computed micro-batch by micro-batch inside the pipeline, so
  that only one micro-batch's logits exist at a time (at 32k tokens the whole batch's
  would decide the search; before 2026-11-27 it was ``GPipe(model, [L + 3], ...)``
  with the loss on the whole batch's output);
* offload: the same with ``recompute="never", offload="activations"``: every
  micro-batch's activations wait in pinned host memory but the one being saved and the
  one brought back for the next backward.

For each, it searches the largest number of blocks L for which a training step runs
without running out of memory (doubling, then bisection). ``--memory-gib`` caps the
memory the process may use (torch.cuda.set_per_process_memory_fraction), to emulate a
smaller device and keep the search short.

    python benchmarks/pipeline1_gpu.py --memory-gib 16      # on a machine with a GPU
    python benchmarks/pipeline1_gpu.py --smoke              # a seconds-long CPU check
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor import Pipeline  # noqa: E402
from conveyor.observe.plan import OPTIMIZER_BYTES  # noqa: E402
from conveyor.train.models import transformer_lm  # noqa: E402


def largest_fitting(fits: Callable[[int], bool], *, start: int = 1, limit: int = 4096) -> int:
    """The largest n in [start, limit] with fits(n), assuming fits is monotone; 0 if none.

    Doubles n until a step fails, then bisects between the last success and it.
    """
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None:
        candidate = min(good * 2, limit)
        if candidate == good:
            return good
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


#: The ways to train of Table 1, by name.
MODES = ("naive", "pipeline_1", "offload")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_step(layers: int, *, mode: str, args: argparse.Namespace,
               device: torch.device) -> None:
    """Builds T(layers, ...) on ``device`` and runs one RMSProp training step ``mode``'s
    way (one of :data:`MODES`)."""
    with device:
        model = transformer_lm(layers, args.width, args.hidden, args.heads, vocab=args.vocab,
                               max_length=args.length)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), device=device)
    if mode == "naive":
        optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-4)
        lm_loss(model(ids), ids).backward()
    else:
        options = ({"recompute": "never", "offload": "activations"} if mode == "offload"
                   else {"recompute": "except_last"})
        pipe = Pipeline(model, balance=[len(model)], devices=[device], chunks=args.chunks,
                        loss_fn=lm_loss, **options)
        optimizer = torch.optim.RMSprop(pipe.parameters(), lr=1e-4)
        pipe.step(ids, ids)
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fits(layers: int, *, mode: str, args: argparse.Namespace,
         device: torch.device, log: list[dict[str, Any]]) -> bool:
    start = time.perf_counter()
    try:
        train_step(layers, mode=mode, args=args, device=device)
        ok = True
    except (torch.cuda.OutOfMemoryError, conveyor.StageError) as exc:
        # A stage that ran out of memory fails the step with a StageError naming it.
        if not isinstance(exc, torch.cuda.OutOfMemoryError) and not isinstance(
                exc.__cause__, torch.cuda.OutOfMemoryError):
            raise
        ok = False
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log.append({"mode": mode, "length": args.length, "layers": layers, "fits": ok,
                "seconds": time.perf_counter() - start})
    print(f"  {mode}, {args.length} tokens: L={layers} "
          f"{'fits' if ok else 'out of memory'}", file=sys.stderr, flush=True)
    return ok


def activation_bytes(layers: int, *, mode: str, args: argparse.Namespace,
                     device: torch.device) -> float | None:
    """The peak memory of a step beyond its model's parameters and optimizer state
    (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    train_step(layers, mode=mode, args=args, device=device)
    return float(torch.cuda.max_memory_allocated(device)
                 - parameters(layers, args) * OPTIMIZER_BYTES["rmsprop"])


def parameters(layers: int, args: argparse.Namespace) -> int:
    with torch.device("meta"):
        model = transformer_lm(layers, args.width, args.hidden, args.heads, vocab=args.vocab,
                               max_length=args.length)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="cap the GPU memory this process may use")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU, one step each (checks the script)")
    args = parser.parse_args()

    if args.smoke:
        args.width, args.hidden, args.heads, args.vocab = 32, 64, 2, 50
        args.length, args.batch, args.chunks = 8, 4, 2
        device = torch.device("cpu")
        for mode in MODES:
            train_step(2, mode=mode, args=args, device=device)
        print("smoke run: naive, Pipeline-1 and offload steps ran on the CPU")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device (use --smoke to check the script on a CPU)")
        return 2
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    if args.memory_gib is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total),
                                                   device)
    log: list[dict[str, Any]] = []
    largest = {mode: largest_fitting(lambda n, m=mode: fits(n, mode=m, args=args,
                                                            device=device, log=log))
               for mode in MODES}
    params = {name: parameters(layers, args) for name, layers in largest.items()}
    rows = [[name, layers, f"{params[name] / 1e6:.0f}M"] for name, layers in largest.items()]
    ratio = params["pipeline_1"] / max(params["naive"], 1)
    table = _common.markdown_table(["", "largest L", "parameters"], rows)
    print(f"\nT(L, {args.hidden}, {args.heads}), width {args.width}, batch {args.batch} x "
          f"{args.length} tokens, RMSProp, memory "
          f"{args.memory_gib or total / 2**30:.0f} GiB; Pipeline-1 with M={args.chunks}\n")
    print(table)
    print(f"\nPipeline-1 trains {ratio:.1f}x the parameters (paper, AmoebaNet: 3.9x)")
    path = _common.write("pipeline1_gpu", {
        "config": vars(args), "largest_layers": largest, "parameters": params,
        "parameter_ratio": ratio, "attempts": log, "table": table,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
