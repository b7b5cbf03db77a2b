"""The shape of the paper's Table 2, by simulation with costs profiled on this machine.

A Transformer LM (16 blocks of width 256, feed-forward 1024, 4 heads, 128 tokens; N=64
sequences) is profiled layer by layer (forward and backward, one thread) at each
micro-batch size N/M. For K devices the layers are balanced by time, and GPipe with
re-materialization (backward = recomputed forward + backward) is simulated; throughput
is normalised to K=2, M=1 as in the paper (TPU Transformer: 1, 1.07, 1.3 at M=1;
1.7, 3.2, 4.8 at M=4; 1.8, 3.4, 6.3 at M=32 for K=2, 4, 8).

    python benchmarks/table2.py               # about a minute
"""

from __future__ import annotations

import sys

import _common

_common.prepare_process()

import torch  # noqa: E402

from conveyor.train.models import transformer_lm  # noqa: E402
from conveyor.balance import profile_layers, solve_balance  # noqa: E402
from conveyor.schedules import gpipe  # noqa: E402
from conveyor.schedules.simulate import CostModel, simulate  # noqa: E402

BATCH, LENGTH, DEVICES, CHUNKS = 64, 128, (2, 4, 8), (1, 4, 32)
PAPER = {2: (1.0, 1.7, 1.8), 4: (1.07, 3.2, 3.4), 8: (1.3, 4.8, 6.3)}


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformer_lm(16, 256, 1024, 4, vocab=256, max_length=LENGTH)
    profiles = {}
    for chunks in CHUNKS:
        sample = torch.randint(0, 256, (BATCH // chunks, LENGTH))
        profiles[chunks] = profile_layers(model, sample, repeat=3)
        print(f"  profiled micro-batches of {BATCH // chunks}", file=sys.stderr, flush=True)

    throughput: dict[tuple[int, int], float] = {}
    for devices in DEVICES:
        for chunks in CHUNKS:
            forward = [p.forward_seconds for p in profiles[chunks]]
            backward = [p.backward_seconds for p in profiles[chunks]]
            balance = solve_balance([f + b for f, b in zip(forward, backward)], devices)
            bounds = [sum(balance[:s]) for s in range(devices + 1)]
            f = tuple(sum(forward[bounds[s]:bounds[s + 1]]) for s in range(devices))
            b = tuple(sum(backward[bounds[s]:bounds[s + 1]]) for s in range(devices))
            costs = CostModel(f, tuple(x + y for x, y in zip(f, b)), (0.0,) * devices,
                              (1.0,) * devices, (0.0,) * (devices - 1))
            throughput[(devices, chunks)] = BATCH / simulate(gpipe(devices, chunks),
                                                             costs).makespan
    base = throughput[(2, 1)]
    rows = [[f"M = {m}"] + [f"{throughput[(k, m)] / base:.2f} ({PAPER[k][i]})"
                            for k in DEVICES] for i, m in enumerate(CHUNKS)]
    table = _common.markdown_table(["", *[f"K = {k}" for k in DEVICES]], rows)
    table += ("\n\nnormalised to K=2, M=1; the paper's TPU Transformer figures in "
              "parentheses")
    print(table)
    picture = _common.RESULTS / "table2.png"
    draw(throughput, base, picture)
    path = _common.write("table2", {
        "config": {"batch": BATCH, "length": LENGTH, "blocks": 16, "width": 256},
        "normalised_throughput": {f"K={k},M={m}": v / base for (k, m), v in throughput.items()},
        "paper": {f"K={k}": list(v) for k, v in PAPER.items()},
        "microbatch_seconds": {m: sum(p.forward_seconds + p.backward_seconds
                                      for p in profiles[m]) for m in CHUNKS},
        "table": table,
    })
    print(f"\nwrote {path}, {picture}")
    return 0


def draw(throughput: dict[tuple[int, int], float], base: float, path: object) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4))
    for devices, colour in zip(DEVICES, ("#4C72B0", "#55A868", "#DD8452")):
        axis.plot(CHUNKS, [throughput[(devices, m)] / base for m in CHUNKS], "o-",
                  color=colour, label=f"K={devices}, simulated here")
        axis.plot(CHUNKS, PAPER[devices], "s--", color=colour, alpha=0.45,
                  label=f"K={devices}, paper (TPU)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(CHUNKS, [str(m) for m in CHUNKS])
    axis.set_xlabel("micro-batches M")
    axis.set_ylabel("throughput, relative to K=2, M=1")
    axis.set_title("GPipe throughput (Transformer): more micro-batches, more devices",
                   fontsize=10)
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
