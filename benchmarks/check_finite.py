"""The cost of ``check_finite`` (on by default): a step with the loss and gradient checks
against one without, the same pipeline and batch.

The bundled Transformer LM T(4, 512, 4), width 128, 32 sequences of 128 bytes, 2 stages on
CPU threads, M=8, 1F1B; the configurations timed in turn (``_common.round_robin``), the
median step of each. The check is one ``isfinite`` per micro-batch's loss and a norm per
gradient, all in one call, with a host sync per stage.

    python benchmarks/check_finite.py            # about a minute on a CPU
    python benchmarks/check_finite.py --smoke    # toy sizes, a check
"""

from __future__ import annotations

import argparse
import time

import _common

_common.prepare_process()

import torch  # noqa: E402

import conveyor  # noqa: E402
from conveyor.train.language import summed_next_token_loss  # noqa: E402
from conveyor.train.models import transformer_lm  # noqa: E402


def pipeline(check: bool, *, width: int, hidden: int, length: int) -> conveyor.Pipeline:
    torch.manual_seed(0)
    model = transformer_lm(4, width, hidden, 4, vocab=256, max_length=length)
    return conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=8, schedule="1f1b",
                             loss_fn=summed_next_token_loss, check_finite=check)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="toy sizes, two rounds")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    width, hidden, length, batch = (16, 32, 16, 8) if args.smoke else (128, 512, 128, 32)
    rounds = 2 if args.smoke else args.rounds
    data = torch.randint(0, 256, (batch, length + 1))
    inputs, targets = data[:, :-1], data[:, 1:]
    pipes = {name: pipeline(check, width=width, hidden=hidden, length=length)
             for name, check in (("check_finite=True", True), ("check_finite=False", False))}

    def step(pipe: conveyor.Pipeline):  # type: ignore[no-untyped-def]
        return lambda: (pipe.step(inputs, targets), pipe.zero_grad(set_to_none=True))

    times = _common.median_ms(_common.round_robin({n: step(p) for n, p in pipes.items()},
                                                  rounds))
    ratio = times["check_finite=True"] / times["check_finite=False"]
    check_ms = gradient_check_ms(pipes["check_finite=True"], inputs, targets)
    share = check_ms / times["check_finite=False"]
    print(_common.markdown_table(["", "median step (ms)"],
                                 [[n, f"{t:.1f}"] for n, t in times.items()]))
    print(f"steps with the check take {ratio:.3f}x those without (noisy on a busy machine); "
          f"the gradient check alone takes {check_ms:.2f} ms, {100 * share:.2f}% of the step")
    print(f"check_finite costs {100 * (ratio - 1):+.1f}% of the step")
    if not args.smoke:
        _common.write("check_finite", {"median_ms": times, "ratio": ratio, "rounds": rounds,
                                       "gradient_check_ms": check_ms,
                                       "gradient_check_share": share})


def gradient_check_ms(pipe: conveyor.Pipeline, inputs: torch.Tensor,
                      targets: torch.Tensor, repeats: int = 50) -> float:
    """The median time of the gradients' check alone, on a step's gradients (the loss's
    check is one float() per micro-batch, which the loss's own total reads anyway)."""
    from conveyor.runtime.finite import check_gradients

    pipe.zero_grad(set_to_none=True)
    pipe.step(inputs, targets)
    params = list(pipe.parameters())
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        check_gradients(pipe.runtime, params, 1)
        seconds.append(time.perf_counter() - start)
    pipe.zero_grad(set_to_none=True)
    return _common.median(seconds) * 1e3


if __name__ == "__main__":
    main()
