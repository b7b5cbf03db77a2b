"""The bodies of ``conveyor simulate``, ``conveyor trace`` and ``conveyor plan``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING

from conveyor.cli import tables

if TYPE_CHECKING:
    from conveyor.schedules.simulate import CostModel, Simulation
    from conveyor.observe.plan import Plan
    from conveyor.schedules import Schedule

__all__: list[str] = []


def _time(value: float, unit: str) -> str:
    """A time in its unit: seconds as ms or s, an abstract unit by its name."""
    if unit != "s":
        return f"{value:.4g} {unit}"
    return f"{1e3 * value:.4g} ms" if value < 10 else f"{value:.4g} s"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# The cost flags of conveyor simulate and their defaults (None: count micro-batches).
_COST_FLAGS: dict[str, float | None] = {"forward": 1.0, "backward": 1.0, "weight": 1.0,
                                        "communication": 0.0, "activation_bytes": None}


def simulate_command(args: argparse.Namespace) -> int:
    """``conveyor simulate``: bad options end it with one line on stderr and code 2."""
    from conveyor.errors import ConveyorError

    try:
        return _simulate(args)
    except ConveyorError as exc:
        print(f"conveyor simulate: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # matplotlib, for --plot
        print(f"conveyor simulate: error: {exc}", file=sys.stderr)
        return 1


def _simulate(args: argparse.Namespace) -> int:
    """Checks the options, simulates, draws and writes what was asked, prints the figures."""
    from conveyor.errors import ConfigError
    from conveyor.schedules.simulate import simulate
    from conveyor.schedules.timeline import plot_timelines
    from conveyor.schedules import build

    for name in ("stages", "chunks", "virtual_stages"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{_flag(name)} must be at least 1, got {getattr(args, name)}")
    table = build(args.schedule, args.stages, args.chunks, virtual_stages=args.virtual_stages)
    flags = _cost_flags(args)
    costs = _simulate_costs(args, table, flags)
    result = simulate(table, costs)
    k, m = args.stages, args.chunks
    v = table.num_stages // table.num_ranks  # 2 for the V shapes, whatever the flag says
    shape = f"{k} ranks, {v} stages each, {m} micro-batches" if v > 1 else \
        f"{k} ranks, {m} micro-batches"
    if args.plot:
        axis = None if args.costs else _axis_label(flags)
        _write(args.plot, lambda path: plot_timelines(
            [result.timeline], path, titles=[f"simulated {table.name} step ({shape})"],
            xlabel=axis))
    if args.trace:
        _write(args.trace, result.timeline.save_chrome_trace)
    if args.json:
        print(json.dumps({**result.summary(), "stages": k, "chunks": m, "virtual_stages": v},
                         indent=2))
        return 0
    unit = costs.unit
    print(f"{table.name}: {shape}; step {_time(result.makespan, unit)}, bubble "
          f"{100 * result.bubble:.1f}%{_textbook(args, flags)}")
    _print_simulation(args, table, result, flags)
    for path, what in ((args.plot, "Gantt chart"), (args.trace, "Chrome trace")):
        if path:
            print(f"wrote {what} to {path}")
    return 0


def _cost_flags(args: argparse.Namespace) -> dict[str, float | None]:
    """The cost flags, checked, with the defaults for those left out.

    Raises:
        ConfigError: a cost is negative or not finite, a cost flag is given beside
            --costs (the file gives every cost), or F, I and W are all 0.
    """
    from conveyor.errors import ConfigError

    given = {name: getattr(args, name) for name in _COST_FLAGS
             if getattr(args, name) is not None}
    if args.costs and given:
        raise ConfigError("--costs gives every cost; leave out "
                          + ", ".join(_flag(name) for name in given))
    for name, value in given.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{_flag(name)} must be a finite number of at least 0, "
                              f"got {value}")
    flags = {**_COST_FLAGS, **given}
    if not args.costs and not any(flags[k] for k in ("forward", "backward", "weight")):
        raise ConfigError("--forward, --backward and --weight are all 0: there is nothing "
                          "to simulate")
    return flags


def _simulate_costs(args: argparse.Namespace, table: Schedule,
                    flags: dict[str, float | None]) -> CostModel:
    """The --costs file as it is, or the flags, which describe one rank's layers: each of
    a rank's V stages costs 1/V of them (``CostModel.per_rank``)."""
    from conveyor.schedules.simulate import CostModel

    if args.costs:
        costs = CostModel.load(args.costs)
        costs.check(table.num_stages)
        return costs
    bytes_ = flags["activation_bytes"]
    return CostModel.per_rank(table, forward=flags["forward"] or 0.0,
                              backward=flags["backward"] or 0.0,
                              weight=flags["weight"] or 0.0,
                              communication=flags["communication"] or 0.0,
                              activation_bytes=1.0 if bytes_ is None else bytes_)


def _write(path: str, write: Callable[[str], None]) -> None:
    from conveyor.errors import ConfigError

    try:
        write(path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def _axis_label(flags: dict[str, float | None]) -> str:
    """The time axis of the flags' costs: in units of one rank's forward of a
    micro-batch, or of the user's choice when that forward is not 1."""
    forward = flags["forward"]
    if forward == 1:
        return "time (units of one rank's forward of a micro-batch)"
    return f"time (units in which one rank's forward of a micro-batch takes {forward:g})"


def _textbook(args: argparse.Namespace, flags: dict[str, float | None]) -> str:
    """The schedule's bubble by formula, where the costs are the textbook's: the same on
    every rank, no transfer time (and F = I = W for zero-bubble, with M >= K; for the
    V shapes, with M >= 2K)."""
    from conveyor.schedules import V_SHAPES

    if args.costs or flags["communication"]:
        return ""
    k, m, v = args.stages, args.chunks, args.virtual_stages
    equal = flags["forward"] == flags["backward"] == flags["weight"]
    if args.schedule in V_SHAPES:  # only the fill of the V (tests/test_vshape.py)
        if not (equal and m >= 2 * k):
            return ""
        formula, value = "(K-1)/(6M+K-1)", (k - 1) / (6 * m + k - 1)
    elif args.schedule == "interleaved-1f1b" and v > 1:
        formula, value = "(K-1)/(VM+K-1)", (k - 1) / (v * m + k - 1)
    elif args.schedule == "zero-bubble":
        if not (equal and m >= k):
            return ""
        formula, value = "(K-1)/(3M+K-1)", (k - 1) / (3 * m + k - 1)
    else:
        formula, value = "(K-1)/(M+K-1)", (k - 1) / (m + k - 1)
    return f" (textbook {formula} = {100 * value:.1f}%)"


def _print_simulation(args: argparse.Namespace, table: Schedule, result: Simulation,
                      flags: dict[str, float | None]) -> None:
    """Per rank: its stages, time computing, bubble and memory; what the columns mean;
    the table on a clock of one tick per action."""
    from conveyor.schedules import layout_clock, render_clock

    unit = result.timeline.unit
    counting = not args.costs and flags["activation_bytes"] is None
    rows = []
    for rank in range(table.num_ranks):
        stages = table.stages_of(rank)
        held = [result.peak_inflight[s] for s in stages]
        peak = result.peak_bytes[rank]
        rows.append([f"rank {rank}", ", ".join(map(str, stages)),
                     _time(result.timeline.busy(rank), unit),
                     f"{100 * result.timeline.bubble(rank):.1f}%",
                     str(held[0]) if len(held) == 1 else
                     ", ".join(f"stage {s}: {n}" for s, n in zip(stages, held, strict=True)),
                     f"{peak:.3g} micro-batch{'' if peak == 1 else 'es'}" if counting
                     else tables.size(peak)])
    print(tables.table(["", "stages", "busy", "bubble", "most micro-batches held",
                  "peak activations"], rows))
    notes = _notes(args, flags, unit, counting=counting,
                   per_rank=table.num_stages // table.num_ranks)
    print("\n" + "\n".join(textwrap.fill(note, 88, subsequent_indent="  ")
                            for note in notes))
    grid = layout_clock(table)
    if len(grid[0]) <= 48:
        print("\nthe order of actions, one tick each (not to scale):\n" + render_clock(grid))


def _notes(args: argparse.Namespace, flags: dict[str, float | None], unit: str, *,
           counting: bool, per_rank: int) -> list[str]:
    """What the printed figures are: the unit of time, and what each memory column counts
    (``per_rank``: the stages each rank runs)."""
    v = per_rank
    if args.costs:
        notes = [f"times as the cost model {args.costs} gives them"
                 + (" (seconds)." if unit == "s" else f" ({unit}).")]
    else:
        forward = flags["forward"] or 0.0
        backward, weight = flags["backward"] or 0.0, flags["weight"] or 0.0
        units = "one rank's forward of a micro-batch" if forward == 1 else "your choice"
        notes = [f"time: in units of {units}; per micro-batch one rank's layers take "
                 f"F={forward:g}, I={backward:g}, W={weight:g} (a full backward "
                 f"B=I+W={backward + weight:g})."
                 + (f" Each of a rank's {v} stages does 1/{v} of that." if v > 1 else "")]
    notes.append("most micro-batches held: per stage, the most micro-batches whose "
                 "activations it held at once (from a forward until the backward that "
                 "frees them).")
    if counting:
        notes.append("peak activations: the most activations a rank held at once, in "
                     "micro-batches' worth of one rank's layers (its stages' peaks need "
                     "not coincide).")
    else:
        per = "stage (the cost model's activation_bytes)" if args.costs else \
            "rank's layers (--activation-bytes)"
        notes.append("peak activations: the most activation bytes a rank held at once, "
                     f"from the bytes of one micro-batch of each {per}.")
    return notes


def trace_command(args: argparse.Namespace) -> int:
    """``conveyor trace``: a file it cannot read or write ends it with one line on stderr
    and code 2."""
    from conveyor.errors import ConfigError
    from conveyor.schedules.timeline import Timeline, plot_timelines

    try:
        try:
            timeline = Timeline.load(args.file)
        except OSError as exc:
            raise ConfigError(f"cannot read {args.file}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{args.file} is not a timeline (Timeline.save writes one): "
                              f"{exc!r}") from None
        if args.plot:
            _write(args.plot, lambda path: plot_timelines([timeline], path))
        if args.chrome:
            _write(args.chrome, timeline.save_chrome_trace)
    except ConfigError as exc:
        print(f"conveyor trace: error: {exc}", file=sys.stderr)
        return 2
    breakdown = timeline.breakdown()
    if args.json:
        print(json.dumps({"makespan": timeline.makespan, "bubble": timeline.mean_bubble,
                          "breakdown": breakdown}, indent=2))
        return 0
    scale, unit = (1e3, "ms") if timeline.unit == "s" else (1.0, timeline.unit)
    rows = [[f"rank {r}"] + [f"{scale * v:.1f}" for v in part.values()]
            for r, part in enumerate(breakdown)]
    print(f"{timeline.source} {timeline.name}: {scale * timeline.makespan:.1f} {unit}, "
          f"{len(timeline.events)} actions, bubble {100 * timeline.mean_bubble:.1f}%")
    parts = ("compute", "transfer", "waiting", "between", "imbalance")  # breakdown's keys
    print(tables.table([""] + [f"{part} {unit}" for part in parts], rows))
    return 0


def plan_command(args: argparse.Namespace) -> int:
    """``conveyor plan``: a family (transformer, convnet) or the user's model, on a
    cluster (PipeDream's planner) or on K devices of one memory."""
    from conveyor.cli.clusterplan import plan_cluster_command, wants_cluster

    if wants_cluster(args):
        return plan_cluster_command(args)
    if args.model not in ("transformer", "convnet"):
        from conveyor.cli.modelplan import plan_model_command

        return int(plan_model_command(args))
    missing = [flag for flag, value in (("--devices", args.devices), ("--memory", args.memory))
               if value is None]
    if missing or args.split_at:
        print(f"conveyor plan: error: --model {args.model} needs {' and '.join(missing)}"
              if missing else "conveyor plan: error: --split-at is for your own model "
              "(--model package.module:function)", file=sys.stderr)
        return 2
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
                                rematerialize=remat, flops_per_second=args.flops or 1e14,
                                offload=args.offload)
    if not plans:
        print(f"no schedule fits {len(figures)} layers on {args.devices} devices",
              file=sys.stderr)
        return 1
    chosen = plans[0]
    depth, _ = planning.largest(figures_of, devices=args.devices, memory=memory,
                                batch=args.batch, chunks=chosen.chunks,
                                schedule=chosen.schedule,
                                virtual_stages=chosen.virtual_stages,
                                optimizer=args.optimizer, rematerialize=chosen.rematerialize,
                                offload=chosen.offload)
    if args.json:
        print(json.dumps({"parameters": parameters, "best": chosen.summary(),
                          "options": [p.summary() for p in plans],
                          "largest_layers": depth}, indent=2))
        return 0
    _print_plans(args, plans, parameters, memory, remat)
    print(f"\nthe deepest {args.model} of this width that fits: {depth} layers")
    return 0


def _print_plans(args: argparse.Namespace, plans: list[Plan], parameters: int, memory: float,
                 remat: bool) -> None:
    """The family's plans as ``conveyor plan`` prints them: the best one's stages, then
    every schedule and micro-batch count it tried."""
    from conveyor.observe import plan as planning

    chosen = plans[0]
    per = planning.OPTIMIZER_BYTES[args.optimizer]
    print(f"{args.model}, {args.layers} layers: {parameters / 1e9:.2f}B parameters, "
          f"{per} bytes each with {args.optimizer}; batch {args.batch}, {args.devices} "
          f"devices of {tables.size(memory)}, re-materialization {'on' if remat else 'off'}")
    status = "fits" if chosen.fits else "does NOT fit"
    print(f"\nbest: {chosen.name}, {chosen.chunks} micro-batches, balance "
          f"{chosen.balance} - {status}")
    rows = [[f"stage {s}", f"{p.layers[0]}-{p.layers[1]}", f"{p.parameters / 1e6:.1f}M",
             tables.size(p.parameter_bytes), tables.size(p.activation_bytes),
             tables.size(p.total_bytes)]
            for s, p in enumerate(chosen.stages)]
    print(tables.table(["", "layers", "params", "param+opt", "activations", "total"], rows))
    print("\nschedules and micro-batches (simulated, fitting first):")
    rows = [[p.name, str(p.chunks), "yes" if p.fits else "no",
             tables.size(max(p.rank_bytes)),
             f"{p.throughput:.1f}"] for p in plans[:args.top]]
    print(tables.table(["schedule", "M", "fits", "largest rank", "samples/s"], rows))
