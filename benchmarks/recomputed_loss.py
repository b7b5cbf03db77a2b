"""The loss recomputed with the last stage: the memory a recomputed micro-batch keeps.

A language model's last stage ends on the head's logits (tokens x vocabulary), which
its cross-entropy reads and whose log-softmax it saves: the largest activations of the
model. A recomputed micro-batch computes its loss inside the stage's recomputed region
and keeps its input alone; a loss kept apart (``recomputed_with_stage = False``, as
``conveyor.VocabParallelCrossEntropy``) keeps the logits and the loss's graph until
its backward, one pair per micro-batch in flight.

One stage (GPipe's column: every forward, then every backward) of a Transformer LM
with a 32k vocabulary, width 64, 2 blocks, 32 sequences of 128 tokens, M=32,
``recompute="except_last"``; each way in processes of its own: the peak resident
memory over what it held before its first step (glibc's allocations mapped apart, so
that freed memory leaves), and the median step of three (conveyor's allocator settings,
in another process). Both losses are the same cross-entropy, and the gradients the same.

    python benchmarks/recomputed_loss.py           # about a minute
    python benchmarks/recomputed_loss.py --smoke   # toy sizes, a check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402
from conveyor.train.models import transformer_lm  # noqa: E402

WAYS = {"recomputed with the stage": False, "kept apart": True}
#: glibc maps each allocation of 64 KiB or more on its own and unmaps it when freed, and
#: conveyor leaves its settings alone (it tunes glibc to keep freed memory for reuse,
#: see conveyor.engine.allocator): the resident peak is then that of the live tensors.
FRESH_PAGES = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "CONVEYOR_TUNE_MALLOC": "0"}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class KeptApart:
    """The same loss, kept apart from the stage's recomputation."""

    recomputed_with_stage = False

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)


def measure(kept_apart: bool, smoke: bool) -> dict[str, float]:
    """One way's peak resident memory over its start and its median step, measured in
    this process (run in a process of its own)."""
    vocab, tokens, batch = (512, 16, 8) if smoke else (32000, 128, 32)
    torch.manual_seed(0)
    model = transformer_lm(2, 64, 256, 2, vocab=vocab, max_length=tokens)
    pipe = conveyor.Pipeline(model, balance=[len(model)], devices=["cpu"], chunks=batch,
                             loss_fn=KeptApart() if kept_apart else lm_loss,
                             recompute="except_last")
    ids = torch.randint(0, vocab, (batch, tokens))
    before = peak_rss_bytes()
    steps = []
    for _ in range(3):
        pipe.zero_grad(set_to_none=False)
        start = time.perf_counter()
        pipe.step(ids, ids)
        steps.append((time.perf_counter() - start) * 1e3)
    return {"peak_over_start_bytes": peak_rss_bytes() - before,
            "step_ms": statistics.median(steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes, a check")
    parser.add_argument("--way", choices=list(WAYS), help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(WAYS[args.way], args.smoke)))
        return 0
    results: dict[str, Any] = {}
    for way in WAYS:
        measured = [json.loads(subprocess.run(
            [sys.executable, __file__, "--way", way] + (["--smoke"] if args.smoke else []),
            capture_output=True, text=True, check=True, env=env).stdout.splitlines()[-1])
            # memory as above; the time as conveyor runs (a smoke run: one process)
            for env in ((FRESH_PAGES,) if args.smoke else (FRESH_PAGES, None))]
        results[way] = {"peak_over_start_bytes": measured[0]["peak_over_start_bytes"],
                        "step_ms": measured[-1]["step_ms"]}
        print(f"  {way} done", file=sys.stderr, flush=True)
    mib = 1 << 20
    rows = [[way, f"{r['peak_over_start_bytes'] / mib:.0f}", f"{r['step_ms']:.0f}"]
            for way, r in results.items()]
    table = _common.markdown_table(["loss", "peak memory over start (MiB)", "step (ms)"],
                                   rows)
    apart, with_stage = results["kept apart"], results["recomputed with the stage"]
    memory = apart["peak_over_start_bytes"] / max(with_stage["peak_over_start_bytes"], 1)
    print(f"\n{table}\n\nthe loss kept apart holds {memory:.2f}x the memory; recomputed "
          f"with the stage, the step takes {with_stage['step_ms'] / apart['step_ms']:.2f}x")
    if not args.smoke:
        print(f"wrote {_common.write('recomputed-loss', {'results': results, 'table': table})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
