"""The device mesh: PP x TP x DP, the data dimension replicated or FSDP-sharded, each
shape's step and per-rank peak memory predicted, so the planner can say whether to
pipeline at all (:mod:`conveyor.planner.verdict`).

Ranks are laid out with TP innermost (a TP group is consecutive devices of one node:
its all-reduces, a few per block in forward and in backward, stay on the node's link),
then the data dimension, then the pipeline (``order="pp-dp-tp"``: a pipeline's stages
are farthest apart, only activations cross the slow links), or the pipeline then the
data dimension (``"dp-pp-tp"``: the gradients cross them). Per stage of layers
[i, j), micro-batches of b samples and a TP group of T:

- compute: the profile's forward and backward of b samples over T, plus the layers'
  all-reduces among the T, as many and as large as the plan the profile was taken with
  makes them (:mod:`conveyor.tensor.costs`; without one, Megatron's f and g: two of a
  layer's output in forward and two in backward), and the forward again where it
  recomputes; and the host's
  ``cluster.action_s`` per forward and per backward (the runtime's own work);
- memory: parameters with their gradients and optimizer state over T (and over D under
  FSDP, which still gathers the stage's parameters and accumulates unsharded gradients
  within a step, as ``conveyor.distributed.sharding`` does); activations at the
  schedule's peak of micro-batches held, each layer's output whole on every TP rank
  and the rest of what it saves over T;
- data: the gradient all-reduce among the D replicas once per step, or FSDP's
  all-gathers (one per layer per step; GPipe re-gathers in each forward) and its
  reduce-scatter, each the cluster's share of an all-reduce (half on a ring; gloo's
  are slower), ring by ring up the levels the group spans; and FSDP's hooks, the
  host's ``cluster.fsdp_unit_s`` per layer per micro-batch, in its forward and backward;
- the runtime's step: the host's ``cluster.step_s`` on every rank, and its agreements
  with the other ranks (:func:`agreements`: small all-reduces, each its group's
  latencies);
- pipeline: the schedule's simulation (:func:`conveyor.planner.simulation.simulate_cut`)
  of the stages, each boundary sending 1/T of the activation per TP rank (whole under
  ``conveyor.tensor.SLICED_FROM`` bytes, as the runtime sends it); the receiving TP
  group's all-gather of the pieces is its own work, in the forward (an activation) or
  backward (a gradient) of the stage that takes them.

A stage's all-reduce counts after its last backward (not overlapped), as the solver's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

from conveyor import tensor
from conveyor.observe.plan import OPTIMIZER_BYTES
from conveyor.planner.machines import Cluster
from conveyor.planner.plans import StageChoice
from conveyor.planner.profiles import LayerCost, ModelProfile
from conveyor.planner.simulation import simulate_cut
from conveyor.schedules.timeline import Timeline
from conveyor.tensor.costs import Collectives

__all__ = ["MESH_SCHEDULES", "MeshCandidate", "Shape", "agreements", "balanced", "bound_at",
           "evaluate_shape",
           "group_ring"]

MESH_SCHEDULES = ("gpipe", "1f1b", "zero-bubble")
SHARDINGS = ("replicate", "fsdp")
#: The schedule a shape without a pipeline runs: each micro-batch forward then backward.
FLAT = "1f1b"


@dataclass(frozen=True)
class Shape:
    """A mesh: ``pp`` stages x ``tp`` ranks per TP group x ``dp`` replicas, the data
    dimension ``sharding`` ("replicate" or "fsdp"), laid out as ``order`` says."""

    pp: int
    tp: int
    dp: int
    sharding: str = "replicate"
    order: str = "pp-dp-tp"

    @property
    def devices(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def kind(self) -> str:
        """What runs, as people name it: "FSDP alone", "TP + FSDP", "PP + TP + DP"."""
        parts = (["PP"] if self.pp > 1 else []) + (["TP"] if self.tp > 1 else []) + \
            ([self.sharding.upper() if self.sharding == "fsdp" else "DP"]
             if self.dp > 1 else [])
        if not parts:
            return "one device"
        return f"{parts[0]} alone" if len(parts) == 1 else " + ".join(parts)

    def describe(self) -> str:
        return f"PP={self.pp} x TP={self.tp} x DP={self.dp} ({self.sharding})"


@dataclass(frozen=True)
class MeshCandidate:
    """One shape, schedule and micro-batch count, with what it is predicted to cost.

    Attributes:
        chunks: micro-batches per step of each pipeline (of batch / dp / chunks samples).
        predicted_step_s: the step's seconds.
        peak_memory_bytes: the most one rank holds at once.
        balance: layers per stage.
        recompute: whether the stages recompute their forward in backward.
        compute_s: the busiest rank's compute per step (its TP collectives included).
        tp_comm_s: of which its TP group's collectives: the layers' all-reduces and
            the gathers of what arrives in pieces.
        dp_comm_s: its gradient all-reduce, or FSDP's all-gathers and reduce-scatter.
        p2p_s: the slowest boundary's transfer of one micro-batch's activation.
        runtime_s: the runtime's own step on a rank: its host's seconds per step and
            its agreements with the other ranks (:func:`agreements`).
        idle_s: the rest of the step: waiting as the schedule fills and drains.
        timeline: a pipeline's simulated step (each rank a stage's TP group), from
            which ``idle_s`` comes; None without one.
    """

    shape: Shape
    schedule: str
    chunks: int
    predicted_step_s: float
    peak_memory_bytes: float
    balance: tuple[int, ...]
    recompute: bool
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    p2p_s: float
    runtime_s: float
    idle_s: float
    timeline: Timeline | None = field(default=None, compare=False, repr=False)

    @property
    def pipelined(self) -> bool:
        return self.shape.pp > 1

    def describe(self) -> str:
        """``PP=2 x TP=4 x DP=2 (fsdp), 1f1b, 16 micro-batches``."""
        how = f"{self.schedule}, {self.chunks} micro-batches" if self.pipelined else \
            "no pipeline, " + (f"{self.chunks} micro-batches accumulated"
                               if self.chunks > 1 else "the batch in one pass")
        return f"{self.shape.describe()}, {how}"

    def to_dict(self) -> dict[str, object]:
        shape = asdict(self.shape)
        rest = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("shape", "timeline")}  # (a timeline stays out whole)
        return {**shape, "kind": self.shape.kind, "devices": self.shape.devices,
                **rest, "balance": list(self.balance),
                "schedule": self.schedule if self.pipelined else "none"}


@dataclass(frozen=True)
class Prefix:
    """Prefix sums of a profile's per-sample figures, for layers [i, j)."""

    forward: list[float]
    backward: list[float]
    whole: list[float]  # saved bytes each TP rank keeps whole (up to the layer's output)
    split: list[float]  # saved bytes split over the TP group (the rest)
    parameters: list[float]
    parameter_bytes: list[float]
    units: list[float]  # layers with parameters: FSDP gathers each in a collective
    tp: list[Collectives]  # TP's all-reduces (see tp_collectives)
    output: list[float]  # output[j]: what crosses a cut before layer j

    @classmethod
    def of(cls, profile: ModelProfile) -> Prefix:
        def prefix(values: Sequence[float]) -> list[float]:
            return [0.0, *itertools.accumulate(float(v) for v in values)]

        layers = profile.layers
        return cls(prefix([x.forward for x in layers]), prefix([x.backward for x in layers]),
                   prefix([min(x.activation_bytes, x.output_bytes) for x in layers]),
                   prefix([max(x.activation_bytes - x.output_bytes, 0.0) for x in layers]),
                   prefix([x.parameters for x in layers]),
                   prefix([x.parameter_bytes for x in layers]),
                   prefix([1.0 if x.parameters else 0.0 for x in layers]),
                   list(itertools.accumulate((tp_collectives(x) for x in layers),
                                             initial=Collectives())),
                   [profile.input_bytes] + [x.output_bytes for x in layers])


def tp_collectives(layer: LayerCost) -> Collectives:
    """A layer's all-reduces over its TP group: as counted from the plan it was profiled
    with, else a transformer layer's (Megatron's: two of its output in forward, two in
    backward) where it has parameters."""
    if layer.tp is not None:
        return layer.tp
    if not layer.parameters:
        return Collectives()
    return Collectives(2, 2 * layer.output_bytes, 2, 2 * layer.output_bytes)


def group_ring(cluster: Cluster, size: int, stride: int) -> tuple[float, float]:
    """One all-reduce among ``size`` devices ``stride`` apart, ring by ring up the
    levels (as :meth:`Cluster.all_reduce`): its fixed seconds and its seconds per byte."""
    fixed = per_byte = 0.0
    span, below = 1, 1
    for level in cluster.levels:
        span *= level.size
        members = min(size, max(1, span // stride))
        ring = max(1, members // below)
        if ring > 1:
            fixed += 2 * (ring - 1) * level.latency
            per_byte += 2 * (ring - 1) / ring / level.bandwidth
        below = max(below, members)
    return fixed, per_byte


def agreements(cluster: Cluster, shape: Shape) -> float:
    """The seconds of the small all-reduces that end each step of ``shape`` on every rank
    (``conveyor.runtime.steps``): the loss from the last stage over each pipeline, the
    replicas' loss total, and the agreement over all ranks that the gradients are
    finite; each of a few bytes, its group's latencies ring by ring. Where a pipeline
    is every rank (DP = TP = 1) the agreement rides in the loss's all-reduce."""
    pipeline_apart = shape.dp * shape.tp if shape.order == "pp-dp-tp" else shape.tp
    data_apart = shape.tp if shape.order == "pp-dp-tp" else shape.pp * shape.tp
    groups = [(shape.pp, pipeline_apart), (shape.dp, data_apart)]
    if shape.devices > shape.pp:
        groups.append((shape.devices, 1))
    return sum(group_ring(cluster, size, apart)[0] for size, apart in groups if size > 1)


@dataclass(frozen=True)
class _Stage:
    """One stage of a shape, per micro-batch (``data``: per step) and per sample
    (the bytes it saves, for memory)."""

    layers: tuple[int, int]
    forward: float
    backward: float
    tp: float
    data: float
    step: float  # per step: the runtime's own (its host, its agreements)
    send: float
    weights: float
    saved: float  # per sample, on one TP rank
    inputs: float  # per sample: what it keeps of each micro-batch while recomputing
    output: float

    def compute(self, recompute: bool) -> float:
        return self.forward * (2 if recompute else 1) + self.backward

    def memory(self, micro: float, held: int, rebuilt: int, recompute: bool) -> float:
        if recompute:
            return self.weights + micro * (held * self.inputs + rebuilt * self.saved)
        return self.weights + micro * held * (self.saved + self.output)


def stage_costs(c: Prefix, cluster: Cluster, shape: Shape, balance: Sequence[int],
            micro: float, schedule: str, chunks: int, optimizer: str) -> list[_Stage]:
    """The stages of ``shape`` cut as ``balance`` says, their costs as the module
    docstring counts them."""
    tp, dp = shape.tp, shape.dp
    tp_fixed, tp_byte = group_ring(cluster, tp, 1)
    pipeline_apart = dp * tp if shape.order == "pp-dp-tp" else tp
    data_fixed, data_byte = group_ring(
        cluster, dp, tp if shape.order == "pp-dp-tp" else shape.pp * tp)
    gathers = chunks + 1 if schedule == "gpipe" and shape.pp > 1 else 1
    step = cluster.step_s + agreements(cluster, shape)

    def pieces(boundary: int) -> int:
        """The pieces what crosses before layer ``boundary`` goes in, as the runtime cuts it."""
        return tp if tp > 1 and micro * c.output[boundary] >= tensor.SLICED_FROM else 1

    def gathered(boundary: int) -> float:
        """The receiving group's all-gather of the pieces (see the module docstring):
        the cluster's share of an all-reduce (half on a ring)."""
        return 0.0 if pieces(boundary) == 1 else cluster.all_gather_share * (
            tp_fixed + tp_byte * micro * c.output[boundary])

    stages, i = [], 0
    for k, count in enumerate(balance):
        j, last = i + count, k == len(balance) - 1
        forward_tp = backward_tp = 0.0
        if tp > 1:
            ran = c.tp[j] - c.tp[i]
            forward_tp = ran.forward * tp_fixed + tp_byte * micro * ran.forward_bytes
            backward_tp = ran.backward * tp_fixed + tp_byte * (
                micro * ran.backward_bytes + ran.weight_bytes)
        taking = (gathered(i) if k > 0 else 0.0, 0.0 if last else gathered(j))
        parameters, nbytes = c.parameters[j] - c.parameters[i], \
            (c.parameter_bytes[j] - c.parameter_bytes[i]) / tp
        element = nbytes * tp / parameters if parameters else 4.0
        hooks = 0.0  # FSDP's host seconds per unit, half in each forward and backward
        if dp == 1:
            data, weights = 0.0, parameters / tp * OPTIMIZER_BYTES[optimizer]
        elif shape.sharding == "fsdp":  # gathers and a reduce-scatter: on rings, half each
            shares = gathers * cluster.all_gather_share + cluster.reduce_scatter_share
            data = shares * ((c.units[j] - c.units[i]) * data_fixed + data_byte * nbytes)
            hooks = (c.units[j] - c.units[i]) * cluster.fsdp_unit_s / 2
            weights = parameters / tp * (OPTIMIZER_BYTES[optimizer] / dp + 2 * element)
        else:
            data = data_fixed + data_byte * nbytes
            weights = parameters / tp * OPTIMIZER_BYTES[optimizer]
        send = 0.0
        if not last:
            first = k * pipeline_apart
            send = cluster.transfer(micro * c.output[j] / pieces(j),
                                    cluster.level_of(first, first + pipeline_apart))
        saved = (c.whole[j] - c.whole[i]) + (c.split[j] - c.split[i]) / tp
        stages.append(_Stage(
            (i, j), micro * (c.forward[j] - c.forward[i]) / tp + forward_tp + cluster.action_s
            + hooks + taking[0],
            micro * (c.backward[j] - c.backward[i]) / tp + backward_tp + cluster.action_s
            + hooks + taking[1],
            forward_tp + backward_tp + sum(taking),
            data, step, send, weights, saved,
            c.output[i] + (0.0 if last else c.output[j]), 0.0 if last else c.output[j]))
        i = j
    return stages


def _held(shape: Shape, schedule: str, chunks: int, k: int) -> int:
    """Micro-batches stage k holds at once at most, before the simulation says."""
    if shape.pp == 1:
        return 1
    return chunks if schedule == "gpipe" else min(chunks, shape.pp - k)


def choose_recompute(stages: Sequence[_Stage], shape: Shape, schedule: str, chunks: int,
               micro: float, memory: float) -> bool | None:
    """Whether the stages recompute (only if keeping does not fit); None: neither fits."""
    for recompute in (False, True):
        if all(s.memory(micro, _held(shape, schedule, chunks, k), 1, recompute) <= memory
               for k, s in enumerate(stages)):
            return recompute
    return None


def lower_bound(stages: Sequence[_Stage], chunks: int, recompute: bool) -> float:
    """No step is shorter: the busiest stage's compute and its data collectives."""
    return max(chunks * s.compute(recompute) + s.data + s.step for s in stages)


def evaluate_shape(profile: ModelProfile, cluster: Cluster, shape: Shape, schedule: str,
                   chunks: int, *, batch: int, optimizer: str = "adam",
                   balance: Sequence[int] | None = None,
                   prefix: Prefix | None = None) -> MeshCandidate | None:
    """What ``shape`` under ``schedule`` with ``chunks`` micro-batches per pipeline
    costs on ``cluster`` (its pipeline cut as ``balance`` says, default balanced by
    time); None if the batch does not divide or a rank does not fit its memory."""
    if batch % (shape.dp * chunks) or shape.pp > len(profile.layers):
        return None
    c = prefix or Prefix.of(profile)
    balance = list(balance or balanced(profile, shape.pp))
    micro = batch / shape.dp / chunks
    stages = stage_costs(c, cluster, shape, balance, micro, schedule, chunks, optimizer)
    recompute = choose_recompute(stages, shape, schedule, chunks, micro, cluster.memory)
    if recompute is None:
        return None
    return costed(shape, schedule, chunks, stages, micro, recompute, cluster.memory,
                   tuple(balance))


def costed(shape: Shape, schedule: str, chunks: int, stages: list[_Stage], micro: float,
            recompute: bool, memory: float, balance: tuple[int, ...]
            ) -> MeshCandidate | None:
    """The candidate of stages whose recomputation is decided: simulated (a pipeline;
    recomputing instead if the simulated peak does not fit), or counted (one stage)."""
    timeline = None
    if shape.pp == 1:
        s = stages[0]
        step, peaks = chunks * s.compute(recompute) + s.data + s.step, [
            s.memory(micro, 1, 1, recompute)]
    else:
        cut = [StageChoice((s.layers[0], s.layers[1] - 1), (k,), recompute, s.forward,
                           s.compute(recompute), s.data, s.send, 0.0)
               for k, s in enumerate(stages)]
        simulated = simulate_cut(cut, schedule, chunks)
        peaks = [s.memory(micro, held, rebuilt, recompute) for s, held, rebuilt
                 in zip(stages, simulated.held, simulated.rebuilt)]
        if max(peaks) > memory:
            return None if recompute else costed(shape, schedule, chunks, stages, micro,
                                                  True, memory, balance)
        step = max(end + s.data + s.step for end, s in zip(simulated.finish, stages))
        timeline = simulated.timeline
    busiest = max(stages, key=lambda s: chunks * s.compute(recompute) + s.data + s.step)
    compute = chunks * busiest.compute(recompute)
    return MeshCandidate(shape, schedule, chunks, step, max(peaks), balance, recompute,
                         compute, chunks * busiest.tp, busiest.data,
                         max(s.send for s in stages), busiest.step,
                         max(0.0, step - compute - busiest.data - busiest.step), timeline)


def balanced(profile: ModelProfile, stages: int) -> list[int]:
    """Layers per stage, balanced by forward and backward time."""
    from conveyor.graph.balance import solve_balance

    return solve_balance([x.forward + x.backward for x in profile.layers], stages)


def bound_at(profile: ModelProfile, cluster: Cluster, candidate: MeshCandidate, *,
             batch: int, optimizer: str = "adam") -> float:
    """``candidate``'s step on another ``cluster``, without simulating it again: its
    lower bound there plus the idle time its simulation found (held fixed)."""
    shape, chunks = candidate.shape, candidate.chunks
    micro = batch / shape.dp / chunks
    stages = stage_costs(Prefix.of(profile), cluster, shape, candidate.balance, micro,
                     candidate.schedule, chunks, optimizer)
    return lower_bound(stages, chunks, candidate.recompute) + candidate.idle_s
