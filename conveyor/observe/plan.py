"""Planning before running: will it fit, how to cut it, which schedule and how many chunks.

The planner works from per-layer figures: parameters, the bytes autograd saves per
sample, the bytes a layer hands on per sample, and forward FLOPs per sample.
:func:`measure` takes them from one forward of the model on a sample, and on the meta
device that costs no memory: an 80-billion-parameter Transformer plans on a laptop.
(``conveyor.train.models.transformer_figures`` and ``convnet_figures`` measure the reference
families.) :func:`measure_split` takes them per stage of any model, cut as a pipeline
cuts it (at ``split_at``, or among its blocks for K stages), one figure per stage.

Per stage, memory is parameters times the optimizer's bytes per parameter (weights,
gradients and state: 12 for RMSProp, as in the paper), plus activations: the
micro-batches a stage holds at once (simulated for the schedule) times what each holds,
all of its saved activations without re-materialization, its input and output with it
(plus the micro-batches recomputed at once: one for a full backward, those between an
``I`` and its ``W`` for a split one, which keeps the rebuilt graph for ``W``). Time is
FLOPs over an assumed rate, backward twice forward (``I`` and ``W`` one each),
recomputation one more forward, paid once per micro-batch by its ``B`` or ``I``; the
schedule's simulation gives the step time.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from conveyor.engine.microbatch import batch_size
from conveyor.errors import BalanceError, ScheduleError
from conveyor.graph.balance import solve_balance
from conveyor.graph.source import sequential_layers
from conveyor.schedules.simulate import CostModel, simulate
from conveyor.schedules import build
from conveyor.torchprivate import pytree

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
class LayerFigures:
    """What one layer costs, per sample.

    Attributes:
        parameters: parameter elements.
        parameter_bytes: bytes of the parameters themselves.
        activation_bytes: bytes autograd saves for backward (parameters excluded).
        input_bytes: bytes the layer receives.
        output_bytes: bytes the layer hands to the next.
        flops: forward floating-point operations.
    """

    name: str
    parameters: int
    parameter_bytes: int
    activation_bytes: float
    input_bytes: float
    output_bytes: float
    flops: float


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree)
               if isinstance(t, torch.Tensor))


def measure(model: nn.Sequential, sample: Any) -> list[LayerFigures]:
    """Per-layer figures from one forward of ``model`` on ``sample`` (meta works).

    Args:
        model: the model as an ``nn.Sequential``, on any device (meta: no memory).
        sample: a batch on the same device; figures are divided by its batch size.
    """
    samples = batch_size(sample)
    figures = []
    x = sample
    # Storages a layer saved (kept alive, so that no new storage takes their address): a
    # later layer saving one adds nothing.
    counted: dict[int, Any] = {}
    for name, layer in sequential_layers(model):
        x = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), x)
        figure, out = _figures(name, layer, list(layer.parameters()), x, samples, counted)
        figures.append(figure)
        x = out
    return figures


def measure_split(model: nn.Module, sample: Any, *, split_at: Sequence[str] | None = None,
                  stages: int | None = None) -> list[LayerFigures]:
    """Figures of each stage of ``model`` cut at ``split_at``, or into ``stages`` stages
    where ``Pipeline(model, stages=...)`` would cut it, from one forward of each stage
    on ``sample`` (a micro-batch as the model takes it; on the meta device with a meta
    model: no memory). A stage's figure is named by the submodule it begins at
    (``"(start)"`` for the first); its parameters are those it holds, a copy of a weight
    tied across stages included; its input and output are what crosses to it and from it.

    The model is copied first (``copy.deepcopy``), as cutting gives a tied weight a copy
    per stage: build a large model on the meta device.

    Raises:
        BalanceError: neither ``split_at`` nor ``stages``, or they disagree; see
            ``conveyor.Pipeline`` for the errors of choosing a cut.
        ModelError: the model cannot be traced or cut there.
    """
    from conveyor.graph.autosplit import choose_split_at
    from conveyor.graph.export import split_model

    if split_at is None:
        if stages is None:
            raise BalanceError("give split_at= (where stages begin) or stages= (to cut as "
                               "Pipeline would)")
        split_at = choose_split_at(model, stages, sample)
    elif stages is not None and len(split_at) + 1 != stages:
        raise BalanceError(f"split_at gives {len(split_at) + 1} stages but stages={stages}")
    model = copy.deepcopy(model)
    device = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device
    split = split_model(model, sample, split_at, dict.fromkeys(range(len(split_at) + 1), device))
    samples = batch_size(sample)
    figures, live = [], sample
    made: dict[str, Any] = {}  # every value the stages so far made for later ones
    for name, stage in zip(["(start)", *split_at], split.stages.values()):
        if stage.index > 0:
            live = {value: made[value] for value in stage.programs[True].receives}
        figure, out = _figures(name, stage.train(), stage.bound_parameters(), live, samples)
        figures.append(figure)
        if isinstance(out, dict) and stage.index < len(split_at):
            made.update(pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), out))
    return figures


def _figures(name: str, module: Any, params: Sequence[torch.Tensor], live: Any,
             samples: int, counted: dict[int, Any] | None = None
             ) -> tuple[LayerFigures, Any]:
    """The figures of a layer or traced stage reading ``params``, from one forward on
    ``live``, and its output. A storage in ``counted`` (an earlier layer saved it: a
    ReLU its output, which the next layer saves as its input) is not counted again;
    what this layer saves is added to it."""
    held = {p.untyped_storage()._cdata for p in params} | set(counted or ())
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in held:
            saved[storage._cdata] = max(saved.get(storage._cdata, 0),
                                        t.numel() * t.element_size())
            if counted is not None:
                counted[storage._cdata] = storage
        return t

    with torch.enable_grad(), FlopCounterMode(display=False) as flops, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(live)
    return LayerFigures(
        name=name,
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        activation_bytes=sum(saved.values()) / samples,
        input_bytes=_nbytes(live) / samples,
        output_bytes=_nbytes(out) / samples,
        flops=flops.get_total_flops() / samples,
    ), out


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

    @property
    def fits(self) -> bool:
        return max(self.rank_bytes) <= self.memory

    def summary(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "chunks": self.chunks,
                "virtual_stages": self.virtual_stages, "rematerialize": self.rematerialize,
                "balance": self.balance, "rank_bytes": self.rank_bytes,
                "fits": self.fits, "step_time": self.step_time, "throughput": self.throughput,
                "stages": [{**asdict(s), "total_bytes": s.total_bytes} for s in self.stages]}


def plan(figures: Sequence[LayerFigures], *, devices: int, memory: float, batch: int,
         chunks: int, schedule: str = "1f1b", virtual_stages: int = 1,
         optimizer: str = "adam", rematerialize: bool = True, balance_by: str = "time",
         flops_per_second: float = 1e14) -> Plan:
    """What running ``figures`` on ``devices`` devices of ``memory`` bytes takes.

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
    # What a micro-batch in flight holds on each stage: its activations, or with
    # recomputation its boundary tensors (what is rebuilt comes on top, below).
    kept = [micro * (g[0].input_bytes + g[-1].output_bytes if rematerialize
                     else saved[s] + g[-1].output_bytes) for s, g in enumerate(groups)]
    cost_model = CostModel(tuple(forward), tuple(f + r for f, r in zip(forward, recompute)),
                           tuple(forward), tuple(kept), (0.0,) * (stages - 1))
    simulation = simulate(table, cost_model)

    plans, rebuilt = [], []
    for s, group in enumerate(groups):
        # One micro-batch rebuilt at a time for B; a split backward keeps what its I
        # rebuilt until its W, so zero-bubble holds several.
        rebuilt.append(micro * max(1, simulation.peak_split[s]) * saved[s]
                       if rematerialize else 0.0)
        parameters = sum(f.parameters for f in group)
        plans.append(StagePlan((bounds[s], bounds[s + 1] - 1), parameters,
                               float(parameters * per_parameter),
                               simulation.peak_inflight[s] * kept[s] + rebuilt[s]))
    # A rank's stages (two in a V, or V interleaved) peak together only as the simulation
    # shows: their held micro-batches at once, then each one's rebuilt graphs.
    rank_bytes = [simulation.peak_bytes[r] + sum(rebuilt[s] + plans[s].parameter_bytes
                                                 for s in table.stages_of(r))
                  for r in range(devices)]
    return Plan(schedule, chunks, virtual_stages, rematerialize, balance, plans, rank_bytes,
                memory, simulation.makespan, batch / simulation.makespan)


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
               flops_per_second: float = 1e14) -> list[Plan]:
    """Every (schedule, chunks) that the sizes allow, fitting plans first, fastest first."""
    options = chunk_options or [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= batch]
    found = []
    for name, virtual in schedules:
        for chunks in options:
            if batch % chunks or (name == "interleaved-1f1b" and chunks % devices) or \
                    devices * virtual > len(figures):
                continue
            with contextlib.suppress(ScheduleError):  # sizes the schedule does not take
                found.append(plan(figures, devices=devices, memory=memory, batch=batch,
                                  chunks=chunks, schedule=name, virtual_stages=virtual,
                                  optimizer=optimizer, rematerialize=rematerialize,
                                  flops_per_second=flops_per_second))
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
            optimizer: str = "adam", rematerialize: bool = True,
            limit: int = 1 << 14) -> tuple[int, Plan | None]:
    """The deepest model of a family that fits: the depth and its plan (0, None if none).

    ``figures_of(depth)`` gives the figures of the family's model of that depth.
    """
    def fitting(depth: int) -> Plan | None:
        figures = figures_of(depth)
        if len(figures) < devices:
            return None
        result = plan(figures, devices=devices, memory=memory, batch=batch, chunks=chunks,
                      schedule=schedule, optimizer=optimizer, rematerialize=rematerialize,
                      balance_by="memory")
        return result if result.fits else None

    start = 1  # the shallowest model with a layer for every device
    while start <= limit and len(figures_of(start)) < devices:
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
