"""The bodies of ``conveyor simulate``, ``conveyor trace`` and ``conveyor plan``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__: list[str] = []


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def _size(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:g}"


def simulate_command(args: argparse.Namespace) -> int:
    from conveyor.schedules import build, layout_clock, render_clock
    from conveyor.observe.simulate import CostModel, simulate
    from conveyor.observe.trace import plot_timelines

    table = build(args.schedule, args.stages, args.chunks, virtual_stages=args.virtual_stages)
    if args.costs:
        costs = CostModel.load(args.costs)
    else:
        costs = CostModel.uniform(table.num_stages, forward=args.forward,
                                  backward=args.backward, weight=args.weight,
                                  activation_bytes=args.activation_bytes,
                                  communication=args.communication)
    result = simulate(table, costs)
    if args.plot:
        plot_timelines([result.timeline], args.plot, titles=[f"simulated {table.name}"])
    if args.trace:
        result.timeline.save_chrome_trace(args.trace)
    if args.json:
        print(json.dumps({**result.summary(), "stages": args.stages, "chunks": args.chunks,
                          "virtual_stages": args.virtual_stages}, indent=2))
        return 0
    k, m = args.stages, args.chunks
    print(f"{table.name}: {k} ranks x {args.virtual_stages} stages, {m} micro-batches; "
          f"step {result.makespan:g}, bubble {100 * result.bubble:.1f}% "
          f"((K-1)/(M+K-1) = {100 * (k - 1) / (m + k - 1):.1f}%)")
    rows = []
    for rank in range(table.num_ranks):
        stages = table.stages_of(rank)
        rows.append([f"rank {rank}", ",".join(map(str, stages)),
                     f"{result.timeline.busy(rank):g}",
                     f"{100 * result.timeline.bubble(rank):.1f}%",
                     "/".join(str(result.peak_inflight[s]) for s in stages),
                     _size(result.peak_bytes[rank])])
    print(_table(["", "stages", "busy", "bubble", "micro-batches held", "peak bytes"], rows))
    grid = layout_clock(table)
    if len(grid[0]) <= 48:
        print("\none tick per action:\n" + render_clock(grid))
    for path, what in ((args.plot, "Gantt chart"), (args.trace, "Chrome trace")):
        if path:
            print(f"wrote {what} to {path}")
    return 0


def trace_command(args: argparse.Namespace) -> int:
    from conveyor.observe.trace import Timeline, plot_timelines

    timeline = Timeline.load(args.file)
    if args.plot:
        plot_timelines([timeline], args.plot)
    if args.chrome:
        timeline.save_chrome_trace(args.chrome)
    breakdown = timeline.breakdown()
    if args.json:
        print(json.dumps({"makespan": timeline.makespan, "bubble": timeline.mean_bubble,
                          "breakdown": breakdown}, indent=2))
        return 0
    rows = [[f"rank {r}"] + [f"{1e3 * v:.1f}" for v in part.values()]
            for r, part in enumerate(breakdown)]
    print(f"{timeline.source} {timeline.name}: {1e3 * timeline.makespan:.1f} ms, "
          f"{len(timeline.events)} actions, bubble {100 * timeline.mean_bubble:.1f}%")
    print(_table(["", "compute ms", "transfer ms", "waiting ms", "between ms",
                  "imbalance ms"], rows))
    return 0


def plan_command(args: argparse.Namespace) -> int:
    from conveyor.observe import plan as planning
    from conveyor.train import models

    memory = planning.parse_bytes(args.memory)
    remat = not args.no_rematerialize
    if args.model == "transformer":
        def figures_of(depth: int) -> list[planning.LayerFigures]:
            return models.transformer_figures(depth, args.d_model, args.d_ff, args.heads,
                                                vocab=args.vocab, length=args.length)
    else:
        def figures_of(depth: int) -> list[planning.LayerFigures]:
            return models.convnet_figures(depth, args.channels, image=args.image,
                                            classes=args.classes)
    figures = figures_of(args.layers)
    parameters = sum(f.parameters for f in figures)
    plans = planning.rank_plans(figures, devices=args.devices, memory=memory,
                                batch=args.batch, optimizer=args.optimizer,
                                rematerialize=remat, flops_per_second=args.flops)
    if not plans:
        print(f"no schedule fits {len(figures)} layers on {args.devices} devices",
              file=sys.stderr)
        return 1
    chosen = plans[0]
    depth, _ = planning.largest(figures_of, devices=args.devices, memory=memory,
                                batch=args.batch, chunks=chosen.chunks,
                                schedule=chosen.schedule, optimizer=args.optimizer,
                                rematerialize=remat)
    if args.json:
        print(json.dumps({"parameters": parameters, "best": chosen.summary(),
                          "options": [p.summary() for p in plans],
                          "largest_layers": depth}, indent=2))
        return 0
    per = planning.OPTIMIZER_BYTES[args.optimizer]
    print(f"{args.model}, {args.layers} layers: {parameters / 1e9:.2f}B parameters, "
          f"{per} bytes each with {args.optimizer}; batch {args.batch}, {args.devices} "
          f"devices of {_size(memory)}, re-materialization {'on' if remat else 'off'}")
    status = "fits" if chosen.fits else "does NOT fit"
    print(f"\nbest: {chosen.schedule}, {chosen.chunks} micro-batches, balance "
          f"{chosen.balance} - {status}")
    rows = [[f"stage {s}", f"{p.layers[0]}-{p.layers[1]}", f"{p.parameters / 1e6:.1f}M",
             _size(p.parameter_bytes), _size(p.activation_bytes), _size(p.total_bytes)]
            for s, p in enumerate(chosen.stages)]
    print(_table(["", "layers", "params", "param+opt", "activations", "total"], rows))
    print("\nschedules and micro-batches (simulated, fitting first):")
    rows = [[p.schedule, str(p.chunks), "yes" if p.fits else "no", _size(max(p.rank_bytes)),
             f"{p.throughput:.1f}"] for p in plans[:args.top]]
    print(_table(["schedule", "M", "fits", "largest rank", "samples/s"], rows))
    print(f"\nthe deepest {args.model} of this width that fits: {depth} layers")
    return 0
