"""Planning before running: will it fit, how to cut it, which schedule and how many chunks.

The planner works from per-layer figures: parameters, the bytes autograd saves per
sample, the bytes a layer hands on per sample, and forward FLOPs per sample.
:func:`measure` takes them from one forward of the model on a sample, and on the meta
device that costs no memory: an 80-billion-parameter Transformer plans on a laptop.
(``conveyor.train.models.transformer_figures`` and ``convnet_figures`` measure the reference
families.) :func:`measure_split` takes them per stage of any model, cut as a pipeline
cuts it (at ``split_at``, or among its blocks for K stages), one figure per stage.

Per rank, memory is parameters times the optimizer's bytes per parameter (weights,
gradients and state: 12 for RMSProp, as in the paper), plus the most activations its
stages hold at once, action by action down its column of the schedule: a micro-batch
keeps its saved activations and output from its F until its B or W (an I frees the
output), with re-materialization its input and output, plus what a recomputed F, B or
I (until its W) rebuilds. Time is FLOPs over an assumed rate, backward twice forward
(``I`` and ``W`` one each), recomputation one more forward, paid once per micro-batch
by its ``B`` or ``I``; the schedule's simulation gives the step time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from conveyor.engine.offload import OffloadPlan, offload_plan
from conveyor.errors import BalanceError, ScheduleError
from conveyor.graph.balance import solve_balance
from conveyor.observe.figures import LayerFigures, measure, measure_split
from conveyor.schedules.simulate import CostModel, simulate
from conveyor.schedules.table import Kind, Schedule
from conveyor.schedules import build

__all__ = [
    "OPTIMIZER_BYTES",
    "Exactness",
    "LayerFigures",
    "Plan",
    "StagePlan",
    "largest",
    "measure",
    "measure_split",
    "parse_bytes",
    "plan",
    "rank_plans",
]

#: Bytes per fp32 parameter: the weight, its gradient and the optimizer's state.
OPTIMIZER_BYTES = {"sgd": 8, "momentum": 12, "rmsprop": 12, "adam": 16, "adamw": 16}


@dataclass(frozen=True)
class StagePlan:
    """One stage of a plan (a rank holds one, or V with interleaving)."""

    layers: tuple[int, int]
    parameters: int
    parameter_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.parameter_bytes + self.activation_bytes


@dataclass(frozen=True)
class Plan:
    """A partition, schedule and chunk count, with what each rank needs.

    Attributes:
        rank_bytes: per rank, parameters and activations of the stages it holds.
        step_time: the simulated step, in seconds at the assumed FLOP rate.
        throughput: samples per second.
    """

    schedule: str
    chunks: int
    virtual_stages: int
    rematerialize: bool
    balance: list[int]
    stages: list[StagePlan]
    rank_bytes: list[float]
    memory: float
    step_time: float
    throughput: float
    offload: bool = False

    @property
    def fits(self) -> bool:
        return max(self.rank_bytes) <= self.memory

    @property
    def name(self) -> str:
        """The schedule, and "+ offload" where activations are offloaded."""
        return f"{self.schedule} + offload" if self.offload else self.schedule

    def summary(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "chunks": self.chunks,
                "virtual_stages": self.virtual_stages, "rematerialize": self.rematerialize,
                "offload": self.offload, "balance": self.balance, "rank_bytes": self.rank_bytes,
                "fits": self.fits, "step_time": self.step_time, "throughput": self.throughput,
                "stages": [{**asdict(s), "total_bytes": s.total_bytes} for s in self.stages]}


def plan(figures: Sequence[LayerFigures], *, devices: int, memory: float, batch: int,
         chunks: int, schedule: str = "1f1b", virtual_stages: int = 1,
         optimizer: str = "adam", rematerialize: bool = True, balance_by: str = "time",
         flops_per_second: float = 1e14, offload: bool = False,
         host_bandwidth: float = 25e9) -> Plan:
    """What running ``figures`` on ``devices`` devices of ``memory`` bytes takes.

    ``offload`` (without ``rematerialize``): activations wait in host memory as
    ``offload="activations"`` has them, each way at ``host_bandwidth`` bytes/s
    overlapped with compute (an action lasts at least its copy).

    Raises:
        BalanceError: more stages than layers, or an unknown optimizer or balance_by.
        ScheduleError: the schedule does not take these sizes.
    """
    per_parameter = _optimizer_bytes(optimizer)
    table = build(schedule, devices, chunks, virtual_stages=virtual_stages)
    stages = table.num_stages
    micro = batch / chunks
    if balance_by == "time":
        costs = [f.flops for f in figures]
    elif balance_by == "memory":
        costs = [f.parameters * per_parameter + micro * f.activation_bytes for f in figures]
    else:
        raise BalanceError(f"balance_by={balance_by!r}: use 'time' or 'memory'")
    balance = solve_balance(costs, stages)
    bounds = [sum(balance[:s]) for s in range(stages + 1)]
    groups = [figures[bounds[s]:bounds[s + 1]] for s in range(stages)]

    forward = [micro * sum(f.flops for f in g) / flops_per_second for g in groups]
    recompute = forward if rematerialize else [0.0] * stages
    saved = [sum(f.activation_bytes for f in g) for g in groups]
    output = [micro * g[-1].output_bytes for g in groups]
    # What a micro-batch in flight holds on each stage: its activations and output, or
    # with recomputation its input and output (the last stage its input alone: it
    # recomputes its output with the loss), and rebuilds the rest (see rank_peaks).
    kept_output = [0.0 if rematerialize and s == stages - 1 else o
                   for s, o in enumerate(output)]
    kept = [micro * (g[0].input_bytes if rematerialize else saved[s]) + kept_output[s]
            for s, g in enumerate(groups)]
    rebuilt = [micro * max(saved[s] - g[0].input_bytes, 0.0) if rematerialize else 0.0
               for s, g in enumerate(groups)]
    moves = [micro * max(saved[s] - g[0].input_bytes, 0.0) for s, g in enumerate(groups)] \
        if offload and not rematerialize else None
    copies = [m / host_bandwidth for m in moves] if moves else [0.0] * stages
    cost_model = CostModel(tuple(max(f, c) for f, c in zip(forward, copies)),
                           tuple(max(f + r, c) for f, r, c in zip(forward, recompute, copies)),
                           tuple(forward), tuple(kept), (0.0,) * (stages - 1))
    simulation = simulate(table, cost_model)

    plans = []
    for s, group in enumerate(groups):
        # The stage's own peak: one micro-batch rebuilt at a time for B; a split
        # backward keeps what its I rebuilt until its W, so zero-bubble holds several.
        parameters = sum(f.parameters for f in group)
        plans.append(StagePlan((bounds[s], bounds[s + 1] - 1), parameters,
                               float(parameters * per_parameter),
                               simulation.peak_inflight[s] * kept[s]
                               + (micro * max(1, simulation.peak_split[s]) * saved[s]
                                  if rematerialize else 0.0)))
    # A rank's stages (two in a V) peak together only as its actions show: one B at a time.
    rank_bytes = [peak + sum(plans[s].parameter_bytes for s in table.stages_of(r))
                  for r, peak in enumerate(rank_peaks(table, kept, output, rebuilt, moves,
                                                      kept_output=kept_output))]
    return Plan(schedule, chunks, virtual_stages, rematerialize, balance, plans, rank_bytes,
                memory, simulation.makespan, batch / simulation.makespan, moves is not None)


def rank_peaks(table: Schedule, kept: Sequence[float], output: Sequence[float],
               rebuilt: Sequence[float], moves: Sequence[float] | None = None, *,
               kept_output: Sequence[float] | None = None) -> list[float]:
    """Per rank, the most activation bytes its stages hold at once, down its column (a
    rank's memory changes with its own actions only). A micro-batch of stage s holds
    ``kept[s]`` from its F until its B or W is done, less ``output[s]`` after its I (W
    needs only the graph), and ``rebuilt[s]`` while a recomputed F runs (torch frees it
    as it goes: at most this at once), during a B, and from an I until its W is done.
    ``kept_output[s]`` (default ``output[s]``) is the part of ``kept[s]`` that is the
    output; a rebuilt graph makes ``output[s]`` again.

    With ``moves`` (offloaded activations, none recomputed), a micro-batch that the
    runtime's own plan (:func:`conveyor.engine.offload.offload_plan`) offloads holds
    ``moves[s]`` of its ``kept[s]`` on the host from its F until one action before its
    B or I, and between an I and one action before a W that comes later."""
    stages = {a.stage for column in table.columns for a in column}
    lanes = {r: [(r, a) for a in column] for r, column in enumerate(table.columns)}
    offload = offload_plan(lanes, stages, lambda s, m: False) if moves is not None \
        else OffloadPlan()
    peaks = []
    for r, column in enumerate(table.columns):
        now = peak = 0.0
        reloads, parks = offload.reloads.get(r, {}), offload.parks.get(r, {})
        for at, action in enumerate(column):
            k, o, b = kept[action.stage], output[action.stage], rebuilt[action.stage]
            held_output = o if kept_output is None else kept_output[action.stage]
            if at in reloads:
                now += moves[reloads[at][0]] if moves is not None else 0.0
            again = o if b else 0.0  # a rebuilt graph makes the output again
            during, after = {Kind.FORWARD: (k + b, -b),
                             Kind.BACKWARD: (b + again, -k - b - again),
                             Kind.INPUT: (b + again, -held_output - again),
                             Kind.WEIGHT: (0.0, held_output - k - b)}[action.kind]
            peak, now = max(peak, now + during), now + during + after
            if moves is not None and ((action.kind is Kind.FORWARD and (
                    action.stage, action.microbatch) in offload.offloaded) or at in parks):
                now -= moves[action.stage]
        peaks.append(peak)
    return peaks


def _optimizer_bytes(optimizer: str) -> int:
    if optimizer not in OPTIMIZER_BYTES:
        raise BalanceError(f"unknown optimizer {optimizer!r}; choose one of "
                           + ", ".join(OPTIMIZER_BYTES))
    return OPTIMIZER_BYTES[optimizer]


def rank_plans(figures: Sequence[LayerFigures], *, devices: int, memory: float, batch: int,
               optimizer: str = "adam", rematerialize: bool = True,
               schedules: Sequence[tuple[str, int]] = (("gpipe", 1), ("1f1b", 1),
                                                       ("interleaved-1f1b", 2),
                                                       ("zero-bubble", 1), ("v-half", 2),
                                                       ("v-min", 2)),
               chunk_options: Sequence[int] | None = None,
               flops_per_second: float = 1e14, offload: bool = False) -> list[Plan]:
    """Every (schedule, chunks) that the sizes allow, fitting plans first, fastest first;
    with ``offload``, each also with its activations offloaded rather than recomputed
    or kept."""
    ways = [(rematerialize, False)] + ([(False, True)] if offload else [])
    options = chunk_options or [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= batch]
    found = []
    for name, virtual in schedules:
        for chunks in options:
            if batch % chunks or (name == "interleaved-1f1b" and chunks % devices) or \
                    devices * virtual > len(figures):
                continue
            with contextlib.suppress(ScheduleError):  # sizes the schedule does not take
                found += [plan(figures, devices=devices, memory=memory, batch=batch,
                               chunks=chunks, schedule=name, virtual_stages=virtual,
                               optimizer=optimizer, flops_per_second=flops_per_second,
                               rematerialize=recompute, offload=offloaded)
                          for recompute, offloaded in ways]
    return sorted(found, key=lambda p: (not p.fits, -p.throughput))


@dataclass(frozen=True)
class Exactness:
    """Whether the runtime computes a schedule exactly on a model, as
    :func:`conveyor.check` found it (float64, on copies).

    Attributes:
        schedule: the schedule checked.
        exact: every output, the loss, every gradient and buffer matched the plain model.
        reason: what was compared, or the first difference and its likely cause.
    """

    schedule: str
    exact: bool
    reason: str


def largest(figures_of: Callable[[int], Sequence[LayerFigures]], *, devices: int,
            memory: float, batch: int, chunks: int, schedule: str = "gpipe",
            virtual_stages: int = 1, optimizer: str = "adam", rematerialize: bool = True,
            offload: bool = False, limit: int = 1 << 14) -> tuple[int, Plan | None]:
    """The deepest model of a family that fits: the depth and its plan (0, None if none).

    ``figures_of(depth)`` gives the figures of the family's model of that depth.
    """
    stages = build(schedule, devices, chunks, virtual_stages=virtual_stages).num_stages

    def fitting(depth: int) -> Plan | None:
        figures = figures_of(depth)
        if len(figures) < stages:
            return None
        result = plan(figures, devices=devices, memory=memory, batch=batch, chunks=chunks,
                      schedule=schedule, virtual_stages=virtual_stages, optimizer=optimizer,
                      rematerialize=rematerialize, balance_by="memory", offload=offload)
        return result if result.fits else None

    start = 1  # the shallowest model with a layer for every stage
    while start <= limit and len(figures_of(start)) < stages:
        start += 1
    best: tuple[int, Plan | None] = (0, None)
    low, high = start - 1, start
    while high <= limit and (found := fitting(high)) is not None:
        best, low, high = (high, found), high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        found = fitting(middle)
        if found is not None:
            best, low = (middle, found), middle
        else:
            high = middle
    return best


def parse_bytes(text: str) -> float:
    """``"16GiB"``, ``"80 GB"``, ``"512MiB"`` or a number of bytes."""
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    value = text.strip().lower().replace(" ", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    if unit not in units or not number:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 16GiB or 80GB")
    return float(number) * units[unit]
