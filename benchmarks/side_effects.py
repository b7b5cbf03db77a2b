"""What watching a forward's side effects costs: a stage's forward with and without it.

Under recomputation every stage watches the state of its modules across each forward
(conveyor/engine/recompute/sideeffects.py): the buffers and the tensor and plain
attributes of every module, by version counters and identities, so that a recomputed
forward starts from the state the first one saw. This times one stage of the default
``conveyor train`` model, T(4, 512, 4) of width 128 (its modules counted in the output),
on a micro-batch of 4 x 128 bytes, without gradients: the forward alone, and the same
forward inside ``ModuleState.run``, interleaved in one run. The difference is the watch's
cost per forward; its share of the forward is what a recomputed step pays at most.

    python benchmarks/side_effects.py          # about 20 s
"""

from __future__ import annotations

import argparse

import _common

_common.prepare_process()

import torch  # noqa: E402

from conveyor.engine.recompute.sideeffects import ModuleState, SideEffects  # noqa: E402
from conveyor.train.models import transformer_lm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20, help="forwards per round")
    args = parser.parse_args()
    torch.manual_seed(0)
    stage = transformer_lm(4, 128, 512, 4)
    modules = list(stage.modules())
    state = ModuleState(lambda: modules)
    x = torch.randint(0, 256, (4, 128))

    def plain() -> None:
        for _ in range(args.calls):
            stage(x)

    def watched() -> None:
        for _ in range(args.calls):
            state.run(stage, x, SideEffects())

    with torch.no_grad():
        times = _common.round_robin({"forward": plain, "watched": watched}, args.rounds)
    per_call = {name: ms * 1e3 / args.calls for name, ms in _common.median_ms(times).items()}
    cost = per_call["watched"] - per_call["forward"]
    result = {"modules": len(modules), "forward_us": round(per_call["forward"], 1),
              "watched_us": round(per_call["watched"], 1), "cost_us": round(cost, 1),
              "share": round(cost / per_call["forward"], 4)}
    print(f"{len(modules)} modules: forward {per_call['forward']:.0f} us, watched "
          f"{per_call['watched']:.0f} us: the watch costs {cost:.0f} us a forward "
          f"({100 * cost / per_call['forward']:.1f}%)")
    print("wrote", _common.write("side_effects", result))


if __name__ == "__main__":
    main()
