"""PipeDream's Table 1 on paper: the planner on the paper's clusters and models.

    python benchmarks/pipedream_paper.py          # a few seconds; prints the README's table

PipeDream (Narayanan et al., SOSP 2019) reports, per model and cluster, the configuration
its optimizer chose ("15-1": a stage of 15 replicas, then one of 1; "Straight": one
device per stage) and its speed-up over data parallelism. Here conveyor's planner
(``conveyor.planner.solve``) plans the same models on the same clusters, and its
simulation gives the speed-up of its plan over data parallelism (every device a replica
of the whole model, gradients all-reduced after each micro-batch of 64, as the paper's
baseline).

The profiles are built from the models' shapes, not timed: VGG-16 is built on the meta
device and its FLOPs counted per layer; GNMT-8 and GNMT-16 (hidden 1024, vocabulary
32,320, 25 tokens a sentence, as the authors' own GNMT-16 profile holds) are written
per layer: an LSTM step costs 2 FLOPs per weight per token, as does the classifier.
Compute runs at an assumed 10 TFLOP/s per V100 (backward twice forward). The clusters
are the paper's: A, servers of 4 V100s on PCIe (taken as 10 GB/s) with 10 Gb/s between
servers; B, servers of 8 V100s on NVLink (taken as 50 GB/s) with 25 Gb/s between them;
16 GB per GPU. What the paper says of its figures is the only source of the
"paper" columns; the rows the notes mark unverified come from a reading of the paper
that could not be checked against its text here.

Conveyor runs pipelines synchronously (with flushes) and PipeDream did not: the
comparison is of shape (which configuration wins, and how far ahead of data
parallelism), not of absolute speed. Writes ``benchmarks/results/pipedream_paper.json``.
"""

from __future__ import annotations

import sys
from typing import Any

import _common

import torch  # noqa: E402
from torch import nn  # noqa: E402

from conveyor.observe.plan import measure  # noqa: E402
from conveyor.planner import (Cluster, LayerCost, Level, ModelProfile, PipelinePlan,  # noqa: E402
                              evaluate, solve)

FLOPS = 1e13  # sustained FP32 FLOP/s of one V100, as assumed
MICRO = 64  # samples per GPU per iteration, as the paper's runs
CLUSTERS = {
    "A": lambda servers: Cluster((Level("server", 4, 10e9, 1e-5),
                                  Level("network", servers, 10e9 / 8, 5e-5)), 16e9, FLOPS),
    "B": lambda servers: Cluster((Level("server", 8, 50e9, 5e-6),
                                  Level("network", servers, 25e9 / 8, 5e-5)), 16e9, FLOPS),
}
# (model, cluster, servers, the paper's configuration, its speed-up over DP, source)
PAPER = [
    ("VGG-16", "A", 4, "15-1", 5.28, "reported"),
    ("VGG-16", "B", 2, "15-1", 2.98, "reported"),
    ("GNMT-16", "A", 4, "Straight", 2.34, "unverified"),
    ("GNMT-16", "B", 2, "Straight", 3.14, "reported"),
    ("GNMT-8", "A", 1, "Straight", 1.5, "unverified"),
    ("GNMT-8", "B", 2, "16 (DP)", 1.0, "unverified"),
]


def vgg16() -> ModelProfile:
    with torch.device("meta"):
        model = _vgg16()
        figures = measure(model, torch.zeros(1, 3, 224, 224))
    return ModelProfile.from_figures(figures, flops=FLOPS, name="VGG-16")


def _vgg16() -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = 3
    for width in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                  512, 512, 512, "M"):
        if width == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        layers += [nn.Conv2d(channels, int(width), 3, padding=1), nn.ReLU()]
        channels = int(width)
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Linear(4096, 4096),
               nn.ReLU(), nn.Linear(4096, 1000)]
    return nn.Sequential(*layers)


def gnmt(depth: int, tokens: int = 25, hidden: int = 1024, vocab: int = 32320) -> ModelProfile:
    """GNMT-8 (depth 4: 4 encoder and 4 decoder LSTM layers) or GNMT-16 (depth 8)."""
    def lstm(inputs: int) -> int:
        return 4 * (inputs * hidden + hidden * hidden + 2 * hidden)

    step = 4 * tokens * hidden  # one sentence's hidden states, float32
    # Decoder layers read the encoder's states through attention: a cut there sends both.
    plan = ([("encoder embedding", vocab * hidden, 0, step),
             ("encoder bi-LSTM", 2 * lstm(hidden), 2, 2 * step),
             ("encoder LSTM 2", lstm(2 * hidden), 2, step)]
            + [(f"encoder LSTM {i}", lstm(hidden), 2, step) for i in range(3, depth + 1)]
            + [("decoder embedding", vocab * hidden, 0, 2 * step),
               ("decoder attention LSTM", lstm(2 * hidden) - lstm(hidden) // 4, 2, 3 * step)]
            + [(f"decoder LSTM {i}", lstm(2 * hidden), 2, 3 * step)
               for i in range(2, depth + 1)]
            + [("classifier", hidden * vocab, 2, 4 * tokens * vocab)])
    layers = tuple(LayerCost(name, flops_per_weight * weights * tokens / FLOPS,
                             2 * flops_per_weight * weights * tokens / FLOPS, weights,
                             4.0 * weights, float(out), float(out))
                   for name, weights, flops_per_weight, out in plan)
    return ModelProfile(f"GNMT-{2 * depth}", layers, float(4 * tokens),
                        f"per layer from its shape, {tokens} tokens, {FLOPS:.0e} FLOP/s")


def configuration(replicas: list[int]) -> str:
    if len(replicas) == 1:
        return f"{replicas[0]} (DP)"
    if set(replicas) == {1}:
        return "Straight"
    return "-".join(map(str, replicas))


def paper_plan(profile: ModelProfile, cluster: Cluster, config: str, chunks: int
               ) -> PipelinePlan:
    """The paper's configuration on our simulation: "15-1" (the last stage the fully
    connected layers), "Straight" (the best cut with one device per stage) or DP."""
    devices, options = cluster.devices, {"optimizer": "momentum", "sync_per_microbatch": True}
    if config == "Straight":
        return solve(profile, cluster, batch=MICRO * chunks, chunk_options=[chunks],
                     replicate=False, keep=1, **options)[0]
    if config.endswith("(DP)"):
        return evaluate(profile, cluster, batch=MICRO * devices, balance=[len(profile)],
                        replicas=[devices], schedule="gpipe", chunks=devices, **options)
    head = next(i for i, layer in enumerate(profile.layers) if layer.parameters > 10**7)
    return evaluate(profile, cluster, batch=MICRO * chunks, chunks=chunks, schedule="1f1b",
                    balance=[head, len(profile) - head],
                    replicas=[int(r) for r in config.split("-")], **options)


def row(profile: ModelProfile, cluster: Cluster, config: str) -> dict[str, Any]:
    devices = cluster.devices
    data_parallel = paper_plan(profile, cluster, f"{devices} (DP)", devices)
    best = None
    for chunks in (4 * devices, 4 * devices - 4):
        for plan in solve(profile, cluster, batch=MICRO * chunks, chunk_options=[chunks],
                          optimizer="momentum", keep=1, sync_per_microbatch=True)[:1]:
            if best is None or plan.throughput > best.throughput:
                best = plan
    assert best is not None
    theirs = paper_plan(profile, cluster, config, 4 * devices - 4 if "-" in config
                        else 4 * devices)
    return {"paper_config_simulated_speedup": theirs.throughput / data_parallel.throughput,
            "plan": configuration(best.replicas), "replicas": best.replicas,
            "balance": best.balance, "schedule": best.schedule, "chunks": best.chunks,
            "speedup_over_dp": best.throughput / data_parallel.throughput,
            "plan_samples_s": best.throughput, "dp_samples_s": data_parallel.throughput,
            "bottleneck": best.bottleneck, "dp_bottleneck": data_parallel.bottleneck}


def main() -> int:
    profiles = {"VGG-16": vgg16(), "GNMT-16": gnmt(8), "GNMT-8": gnmt(4)}
    rows, results = [], []
    for model, name, servers, config, speedup, source in PAPER:
        cluster = CLUSTERS[name](servers)
        found = row(profiles[model], cluster, config)
        per_server = cluster.levels[0].size
        results.append({"model": model, "cluster": name, "servers": servers,
                        "gpus_per_server": per_server, "paper_config": config,
                        "paper_speedup": speedup, "paper_source": source, **found})
        rows.append([model, f"{name}, {servers}x{per_server}", config,
                     f"{speedup:g}x" + ("" if source == "reported" else " (unverified)"),
                     f"{found['paper_config_simulated_speedup']:.2f}x",
                     found["plan"], f"{found['speedup_over_dp']:.2f}x"])
        print(f"  {model} on {name}: {found['plan']}", file=sys.stderr, flush=True)
    table = _common.markdown_table(["model", "cluster", "paper: config", "paper: vs DP",
                                    "paper's config, simulated vs DP", "conveyor's plan",
                                    "simulated vs DP"], rows)
    _common.write("pipedream_paper", {"flops_assumed": FLOPS, "micro_batch": MICRO,
                                      "rows": results, "table": table})
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
