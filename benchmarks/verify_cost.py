"""What ``verify_every`` costs: a verified step against a plain one.

Two pipelines of the default ``conveyor train`` model, T(4, 512, 4) of width 128, on two
CPU stages (1F1B, 8 micro-batches of 4 x 128 bytes, the default recomputation), one
built with ``verify_every=1`` (every step verified), stepped in turn on the same batch.
A verified step costs the pipeline's step plus the certificate's re-run: one more
forward and backward of every micro-batch through the stages one after another (no
overlap, no recomputation); with ``verify_every=N`` that is spread over N steps::

    python benchmarks/verify_cost.py            # about a minute
    python benchmarks/verify_cost.py --smoke    # seconds: that it runs
"""

from __future__ import annotations

import argparse

import _common

_common.prepare_process()

import torch  # noqa: E402

import conveyor  # noqa: E402
from conveyor.train.language import next_token_loss  # noqa: E402
from conveyor.train.models import transformer_lm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, two rounds")
    args = parser.parse_args()
    torch.manual_seed(0)
    size = (2, 16, 32, 2) if args.smoke else (4, 128, 512, 4)
    rows, length, chunks = (4, 16, 2) if args.smoke else (32, 128, 8)
    rounds = 2 if args.smoke else args.rounds
    pipes = {}
    for name, every in (("plain", None), ("verified", 1)):
        torch.manual_seed(0)
        model = transformer_lm(*size, vocab=256, max_length=length)
        pipes[name] = conveyor.Pipeline(model, stages=2, devices=["cpu", "cpu"],
                                        chunks=chunks, schedule="1f1b",
                                        loss_fn=next_token_loss, verify_every=every)
    x = torch.randint(0, 256, (rows, length))

    def step(pipe: conveyor.Pipeline) -> None:
        pipe.step(x, x)
        pipe.zero_grad(set_to_none=True)

    times = _common.round_robin({name: lambda p=pipe: step(p) for name, pipe in
                                 pipes.items()}, rounds)
    ms = _common.median_ms(times)
    extra = ms["verified"] / ms["plain"] - 1
    result = {"model": f"T{size}", "batch": [rows, length], "chunks": chunks,
              "step_ms": round(ms["plain"], 1), "verified_step_ms": round(ms["verified"], 1),
              "extra_per_verified_step": round(extra, 3)}
    print(f"a step {ms['plain']:.0f} ms, a verified step {ms['verified']:.0f} ms: "
          f"+{100 * extra:.0f}% per verified step (+{100 * extra / 10:.0f}% a step at "
          "verify_every=10)")
    if not args.smoke:
        print("wrote", _common.write("verify_cost", result))


if __name__ == "__main__":
    main()
