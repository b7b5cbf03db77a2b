"""PipeDream's question, for synchronous pipelines: where to cut, how many replicas each
stage gets, which schedule and how many micro-batches, and which stages recompute.

The solver is PipeDream's dynamic program (Narayanan et al., SOSP 2019, section 3.1) made
to know conveyor's schedules and a memory cap. Stages take consecutive devices, so each
stage's replicas and each cut between stages sit at a known level of the cluster.
Over the layers still to place (from layer i on), the devices still free (from device d
on) and the stages still to make (s), it keeps the smallest *bottleneck*: the busiest of

- a stage's compute per step: the micro-batches each replica runs (M/r, rounded up)
  times forward, backward and recomputation of one, plus the all-reduce of its
  gradients among its r replicas at their level;
- a cut's link per step: M messages of the activation that crosses it and M of its
  gradient back (counted together: a schedule that flushes sends the ones in its
  forward phase and the others in its backward), shared by the links between the two
  stages' replicas.

Memory decides recomputation stage by stage: a stage keeps its activations if its
parameters, optimizer state and the activations of the micro-batches it holds at once
(all of its own under GPipe, at most the stages from it to the end under 1F1B, as the
schedule's simulation shows) fit the cap, else it recomputes, else it cannot take those
layers there. Working from the last stage backwards makes the stages after each one
known, so 1F1B's bound is exact for it.

A cut whose bottleneck is a little worse can still be faster, its fill and drain
shorter (PipeDream's 15-1 for VGG-16): the same program, with every stage and link
capped at 15% and 40% above the smallest bottleneck, also finds the cut whose one
micro-batch crosses the stages and links soonest.

For every schedule, micro-batch count and number of stages these cuts are then run
through the schedule's simulation (each replica of a stage dealt its micro-batches in
turn, every message on a serial link) to predict the step with its bubble, and each
device's memory at the peak the simulation shows (zero-bubble's rebuilt graphs held
from an ``I`` to its ``W`` included; a stage that would hold too much recomputes, or
the plan is dropped); plans come out fastest first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from conveyor.errors import ConveyorError
from conveyor.observe.plan import OPTIMIZER_BYTES
from conveyor.planner.machines import Cluster
from conveyor.planner.plans import PipelinePlan, StageChoice, readable_time
from conveyor.planner.profiles import ModelProfile
from conveyor.planner.simulation import simulate_cut

__all__ = ["evaluate", "solve"]

#: The schedules the solver weighs (one stage per rank).
SOLVED_SCHEDULES = ("gpipe", "1f1b", "zero-bubble")
#: The bottlenecks, over the smallest, under which the shortest fill is searched too.
_SLACKS = (1.15, 1.4)
_HOLDS_ALL = {"gpipe"}  # schedules whose stages hold every micro-batch before backward


@dataclass(frozen=True)
class _Costs:
    """Prefix sums of the profile's per-sample figures, for stages [i, j)."""

    forward: list[float]
    backward: list[float]
    saved: list[float]
    parameters: list[float]
    parameter_bytes: list[float]
    output: list[float]  # output[j]: what crosses a cut before layer j (input_bytes at 0)

    @classmethod
    def of(cls, profile: ModelProfile) -> _Costs:
        def prefix(values: Sequence[float]) -> list[float]:
            return [0.0, *itertools.accumulate(float(v) for v in values)]

        layers = profile.layers
        return cls(prefix([x.forward for x in layers]), prefix([x.backward for x in layers]),
                   prefix([x.activation_bytes for x in layers]),
                   prefix([x.parameters for x in layers]),
                   prefix([x.parameter_bytes for x in layers]),
                   [profile.input_bytes] + [x.output_bytes for x in layers])


def solve(profile: ModelProfile, cluster: Cluster, *, batch: int, optimizer: str = "adam",
          schedules: Sequence[str] = SOLVED_SCHEDULES,
          chunk_options: Sequence[int] | None = None, replicate: bool = True,
          uniform_replicas: bool = False, communication: bool = True,
          max_stages: int | None = None, keep: int = 8,
          sync_per_microbatch: bool = False) -> list[PipelinePlan]:
    """The fastest plans that fit the cluster's memory, fastest first (empty if
    nothing fits): at least the ``keep`` fastest of the best cuts of every schedule,
    micro-batch count and number of stages, the fastest cut of each schedule,
    micro-batch count and replicas per stage.

    Args:
        batch: the mini-batch N; micro-batch counts are its divisors.
        replicate: whether stages may have several replicas (False: one device each).
        uniform_replicas: every stage the same number of replicas (``data_parallel=D``,
            D replicas of the whole pipeline; else ``data_parallel=[r0, r1, ...]``).
        communication: False plans as if links were free (compute and memory only).
        max_stages: at most this many stages.
        keep: at least this many plans are simulated and returned.
        sync_per_microbatch: PipeDream's regime, to compare with its paper: a stage's
            replicas synchronise their weights after every micro-batch (conveyor's
            synchronise once per step).

    Raises:
        ConveyorError: an unknown optimizer, or an empty profile.
    """
    if optimizer not in OPTIMIZER_BYTES:
        raise ConveyorError(f"unknown optimizer {optimizer!r}; choose one of "
                            + ", ".join(OPTIMIZER_BYTES))
    if not profile.layers:
        raise ConveyorError(f"the profile of {profile.name} has no layers")
    costs = _Costs.of(profile)
    options = chunk_options or [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if batch % m == 0]
    deepest = min(len(profile.layers), cluster.devices, max_stages or cluster.devices)
    cuts = []
    for chunks in options:
        if batch % chunks:
            continue
        # Schedules that hold as many micro-batches make the same cuts: search once.
        searched: dict[bool, _Search] = {}
        for schedule in schedules:
            holds_all = schedule in _HOLDS_ALL
            if holds_all not in searched:
                searched[holds_all] = _Search(costs, cluster, batch, chunks, holds_all,
                                              optimizer, replicate, uniform_replicas,
                                              communication, sync_per_microbatch)
            search = searched[holds_all]
            for stages in range(1, deepest + 1):
                cut = search.best(stages)
                if cut is None:
                    continue
                bottleneck = search.bottleneck(cut)
                cuts.append((bottleneck, schedule, search, cut))
                for slack in _SLACKS:  # a little more per step, a shorter fill and drain
                    capped = search.capped(bottleneck * slack).best(stages)
                    if capped is not None and capped != cut:
                        cuts.append((search.bottleneck(capped), schedule, search, capped))
    # A step lasts at least its bottleneck: simulate the cuts in that order, until the
    # next one's bottleneck alone is slower than the best step found.
    plans: list[PipelinePlan] = []
    for bottleneck, schedule, search, cut in sorted(cuts, key=lambda c: c[0]):
        if len(plans) >= keep and bottleneck > plans[keep - 1].step_time:
            break
        plan = _plan(profile, cluster, search, cut, schedule)
        if plan is None:
            continue
        same = [p for p in plans if (p.schedule, p.chunks, p.replicas) ==
                (plan.schedule, plan.chunks, plan.replicas)]  # another cut of it: the faster
        if same and same[0].step_time <= plan.step_time:
            continue
        plans = sorted([p for p in plans if p not in same] + [plan], key=lambda p: p.step_time)
    return plans


@dataclass
class _Search:
    """The dynamic program for one micro-batch count, under schedules that hold every
    micro-batch before backward (``holds_all``: GPipe) or at most the stages left (1F1B)."""

    costs: _Costs
    cluster: Cluster
    batch: int
    chunks: int
    holds_all: bool
    optimizer: str
    replicate: bool
    uniform: bool
    communication: bool
    sync_each: bool = False  # replicas synchronise after every micro-batch (PipeDream)
    #: None: minimise the bottleneck; else minimise the fill under this bottleneck
    cap: float | None = None
    #: each stage() answer, shared with the capped searches (the same stages)
    stages_made: dict[tuple[int, int, int, int, int], StageChoice | None] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        self.micro = self.batch / self.chunks
        self.layers = len(self.costs.forward) - 1
        self.devices = self.cluster.devices
        self.table: dict[tuple[int, int, int, int], tuple[float, int, int]] = {}
        self._capped: dict[float, _Search] = {}

    def capped(self, cap: float) -> _Search:
        """The same search, for the cut whose one micro-batch takes the least time to
        cross every stage and link (the fill and drain) among those whose bottleneck is
        at most ``cap`` (one search per cap: its table answers every number of stages)."""
        if cap not in self._capped:
            self._capped[cap] = replace(self, cap=cap)
        return self._capped[cap]

    def replica_counts(self, free: int) -> list[int]:
        """The replica counts a stage may take: any, up to ``free`` devices and the
        micro-batches to deal among them (PipeDream's VGG-16 runs 15 and 1); with
        uniform replicas, those that deal them evenly (each replica of the pipeline
        takes as many)."""
        if not self.replicate:
            return [1]
        return [r for r in range(1, min(free, self.chunks) + 1)
                if not self.uniform or self.chunks % r == 0]

    def stage(self, i: int, j: int, replicas: int, device: int, remaining: int
              ) -> StageChoice | None:
        """Layers [i, j) on ``replicas`` devices from ``device``, with ``remaining``
        stages from it to the end; None if it does not fit."""
        key = (i, j, replicas, device, remaining)
        if key not in self.stages_made:
            self.stages_made[key] = self._stage(i, j, replicas, device, remaining)
        return self.stages_made[key]

    def _stage(self, i: int, j: int, replicas: int, device: int, remaining: int
               ) -> StageChoice | None:
        c, micro = self.costs, self.micro
        forward = micro * (c.forward[j] - c.forward[i])
        backward = micro * (c.backward[j] - c.backward[i])
        each = math.ceil(self.chunks / replicas)
        held = each if self.holds_all else min(each, remaining)
        kept, rebuilt = self.memory(i, j, held, 1)
        if kept <= self.cluster.memory:
            recompute, memory = False, kept
        elif rebuilt <= self.cluster.memory:
            recompute, memory = True, rebuilt
        else:
            return None
        devices = tuple(range(device, device + replicas))
        sync = self.cluster.all_reduce(c.parameter_bytes[j] - c.parameter_bytes[i], replicas,
                                       self.cluster.level_of(devices[0], devices[-1]))
        last = device + replicas
        send = 0.0 if j == self.layers or not self.communication else \
            self.cluster.transfer(micro * c.output[j], self.cluster.level_of(last - 1, last))
        return StageChoice((i, j - 1), devices, recompute, forward,
                           forward * (2 if recompute else 1) + backward,
                           sync if self.communication else 0.0, send, float(memory))

    def memory(self, i: int, j: int, held: int, rebuilt: int) -> tuple[float, float]:
        """Bytes a device of layers [i, j) needs holding ``held`` micro-batches at once:
        keeping their activations, and recomputing them (keeping each one's input and
        output, the last stage's input alone, and ``rebuilt`` ones' activations)."""
        c, micro, last = self.costs, self.micro, j == self.layers
        weights = (c.parameters[j] - c.parameters[i]) * OPTIMIZER_BYTES[self.optimizer]
        saved, boundary = c.saved[j] - c.saved[i], c.output[i] + (0 if last else c.output[j])
        return (weights + micro * held * (saved + c.output[j]),
                weights + micro * (held * boundary + rebuilt * saved))

    def bottleneck(self, cut: Sequence[StageChoice]) -> float:
        """The busiest stage's or link's seconds per step."""
        return max(max(self.load(stage, after.replicas if after else 1))
                   for stage, after in zip(cut, [*cut[1:], None]))

    def load(self, stage: StageChoice, next_replicas: int) -> tuple[float, float]:
        """The stage's busy seconds per step, and its outgoing link's: every micro-batch's
        activation one way and its gradient back, counted together (a schedule that
        flushes sends the ones in its forward phase and the others in its backward)."""
        each = math.ceil(self.chunks / stage.replicas)
        link = 2 * self.chunks * stage.send / max(1, min(stage.replicas, next_replicas))
        return each * stage.compute + (each if self.sync_each else 1) * stage.sync, link

    def best(self, stages: int) -> list[StageChoice] | None:
        """The cut into ``stages`` stages with the smallest bottleneck (None: none fits)."""
        found = self._best(stages, 0, 0, 0)
        if found is None:
            return None
        cut, i, device, width = [], 0, 0, 0
        for remaining in range(stages, 0, -1):
            _, j, replicas = self.table[(remaining, i, device, width)]
            cut.append(self.stage(i, j, replicas, device, remaining))
            i, device, width = j, device + replicas, (replicas if self.uniform else 0)
        return cut  # type: ignore[return-value]

    def _best(self, remaining: int, i: int, device: int, width: int) -> float | None:
        """The smallest bottleneck of layers [i, L) in ``remaining`` stages on devices
        from ``device`` (each stage ``width`` replicas, if not 0), or with a ``cap``
        the shortest fill; memoised with its choice in ``self.table``."""
        key = (remaining, i, device, width)
        if key in self.table:
            value = self.table[key][0]
            return None if value == math.inf else value
        best: tuple[float, int, int] = (math.inf, -1, -1)
        free = self.devices - device
        if remaining == 1:
            ends = [self.layers]
        else:
            ends = list(range(i + 1, self.layers - remaining + 2))
        counts = [width] if width else self.replica_counts(free - (remaining - 1))
        for replicas in counts:
            if replicas > free - (remaining - 1) * (width or 1):
                continue
            for j in ends:
                stage = self.stage(i, j, replicas, device, remaining)
                if stage is None:
                    continue
                own = self.load(stage, 1)[0]
                # Its load without recomputation only grows with its layers (the load may
                # not: more layers can end on a smaller output that fits without
                # recomputing): from here on none is better, or, capped, under the cap.
                least = own - (math.ceil(self.chunks / replicas) * stage.forward
                               if stage.recompute else 0.0)
                if least >= best[0] if self.cap is None else least > self.cap:
                    break
                if remaining == 1:
                    link, nxt = 0.0, 0.0
                else:
                    after = self._best(remaining - 1, j, device + replicas,
                                       replicas if self.uniform else 0)
                    if after is None:
                        continue
                    nxt = after
                    next_replicas = self.table[(remaining - 1, j, device + replicas,
                                                replicas if self.uniform else 0)][2]
                    link = self.load(stage, next_replicas)[1]
                if self.cap is None:
                    value = max(own, link, nxt)
                elif max(own, link) <= self.cap:  # the fill: one micro-batch there and back
                    value = stage.compute + 2 * stage.send + nxt
                else:
                    continue
                if value < best[0]:
                    best = (value, j, replicas)
        self.table[key] = best
        return None if best[0] == math.inf else best[0]


def evaluate(profile: ModelProfile, cluster: Cluster, *, batch: int, balance: Sequence[int],
             schedule: str, chunks: int, replicas: Sequence[int] | None = None,
             optimizer: str = "adam", sync_per_microbatch: bool = False) -> PipelinePlan:
    """What a given cut costs on ``cluster``: ``balance`` layers per stage (each with
    ``replicas``, default one), under ``schedule`` with ``chunks`` micro-batches, as
    :func:`solve` predicts its own (to weigh another cut, e.g. one balanced by compute
    alone, against the solver's).

    Raises:
        ConveyorError: the balance does not cover the profile's layers, the replicas
            need more devices than the cluster has, or a stage does not fit its memory.
    """
    replicas = list(replicas or [1] * len(balance))
    if sum(balance) != len(profile.layers) or min(balance) < 1 or \
            len(replicas) != len(balance):
        raise ConveyorError(f"balance {list(balance)} (replicas {replicas}) does not cut the "
                            f"{len(profile.layers)} layers of {profile.name} into stages")
    if sum(replicas) > cluster.devices:
        raise ConveyorError(f"replicas {replicas} need {sum(replicas)} devices; the cluster "
                            f"has {cluster.devices}")
    search = _Search(_Costs.of(profile), cluster, batch, chunks, schedule in _HOLDS_ALL,
                     optimizer, True, False, True, sync_per_microbatch)
    cut, first, device = [], 0, 0
    for k, (layers, count) in enumerate(zip(balance, replicas)):
        stage = search.stage(first, first + layers, count, device, len(balance) - k)
        if stage is None:
            raise ConveyorError(f"stage {k} (layers {first}-{first + layers - 1}) does not "
                                f"fit in {cluster.memory / 1e9:.3g} GB even recomputing")
        cut.append(stage)
        first, device = first + layers, device + count
    plan = _plan(profile, cluster, search, cut, schedule)
    if plan is None:
        raise ConveyorError(f"under {schedule} with {chunks} micro-batches a stage of "
                            f"{list(balance)} holds more than {cluster.memory / 1e9:.3g} GB "
                            "at its peak")
    return plan


def _plan(profile: ModelProfile, cluster: Cluster, search: _Search, cut: list[StageChoice],
          schedule: str) -> PipelinePlan | None:
    """The plan of a cut: its step simulated under ``schedule``, each device's memory at
    the peak the simulation shows, and its bottleneck. A stage that keeps its
    activations but holds more at that peak than fits recomputes instead (simulated
    again); None if a device still does not fit."""
    while True:
        simulated = simulate_cut(cut, schedule, search.chunks, sync_each=search.sync_each)
        cut = [replace(stage, memory=float(search.memory(
                   stage.layers[0], stage.layers[1] + 1, held, rebuilt)[stage.recompute]))
               for stage, held, rebuilt in zip(cut, simulated.held, simulated.rebuilt)]
        over = [k for k, stage in enumerate(cut) if stage.memory > cluster.memory]
        if not over:
            break
        if any(cut[k].recompute for k in over):
            return None
        cut = [replace(stage, recompute=True, compute=stage.compute + stage.forward)
               if k in over else stage for k, stage in enumerate(cut)]
    step = max(end + (0.0 if search.sync_each else stage.sync)
               for end, stage in zip(simulated.finish, cut))
    loads = []
    for k, stage in enumerate(cut):
        own, link = search.load(stage, cut[k + 1].replicas if k + 1 < len(cut) else 1)
        loads.append((own, f"stage {k} (layers {stage.layers[0]}-{stage.layers[1]}, "
                           f"{stage.replicas} replica{'s' * (stage.replicas > 1)}): "
                           f"{readable_time(own)} of compute and gradient sync per step"))
        if k + 1 < len(cut):
            level = cluster.levels[cluster.level_of(stage.devices[-1], stage.devices[-1] + 1)]
            loads.append((link, f"the link from stage {k} to {k + 1} ({level.name}): "
                                f"{readable_time(link)} of transfers per step, both ways"))
    worst = max(loads)
    busy = worst[0] / step if step else 1.0
    return PipelinePlan(profile.name, search.batch, schedule, search.chunks,
                        search.optimizer, tuple(cut), step,
                        f"{worst[1]}, busy {100 * busy:.0f}% of the step (the rest: "
                        "waiting on the others, as the schedule fills and drains)",
                        cluster.memory, profile.split_at)
