"""Re-balancing while training: measuring the stages, agreeing on a move, making it.

A pipeline built with ``rebalance=conveyor.Rebalance(...)`` (a *policy*, see
:mod:`conveyor.runtime.rebalance.policy`) measures, over a window of steps, each stage's mean
forward, backward and weight-gradient time per micro-batch (compute only: the time
spent waiting for a neighbour or sending is left out) and each layer's forward time.
At the start of the step after the window, the policy proposes a balance; if it moves
layers, :mod:`conveyor.runtime.rebalance.moves` moves them, with their optimizer state,
before the step runs::

    step   1      2 .. 1+window        next                  next+1
           warm   measured             check, maybe move     warm (new stages) ...

Under torchrun every rank measures its own stages; the figures are summed over the
pipeline (and the replicas), so every rank holds the same ones; pipeline rank 0 asks
the policy and broadcasts its answer, so every rank takes the same decision.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from conveyor.runtime.rebalance.moves import move_layers, share_bytes
from conveyor.runtime.runtime import Runtime
from conveyor.engine.recorder import Recorder
from conveyor.errors import ConfigError
from conveyor.graph.skipcut import skips_of
from conveyor.schedules import Kind, Schedule


__all__: list[str] = []

logger = logging.getLogger("conveyor")

_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.INPUT, Kind.WEIGHT)


@dataclass(frozen=True)
class StageTimes:
    """What a window of steps measured.

    Attributes:
        forward: per stage, the mean forward of one micro-batch (seconds of compute).
        backward: per stage, the mean input-gradient pass ``I``, or the mean full
            backward ``B`` where the stage ran no ``I``.
        weight: per stage, the mean weight-gradient pass ``W`` (0 without ``I``/``W``).
        layer_forward: per layer of the model, its forward time summed over the window
            (recomputations included): how a stage's time divides among its layers.
        communication: the mean time of sending one message to another stage.
        steps: the number of steps measured.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    layer_forward: tuple[float, ...]
    communication: float
    steps: int


class Proposal(NamedTuple):
    """A policy's answer: the balance to run, whether it is a move, and why."""

    balance: list[int]
    move: bool
    reason: str


class BalancePolicy(Protocol):
    """Decides from measured times whether to move layers (``conveyor.Rebalance``)."""

    @property
    def window(self) -> int: ...  # steps measured before each decision

    @property
    def warmup(self) -> int: ...  # steps left unmeasured after a start or a move

    def propose(self, times: StageTimes, balance: Sequence[int],
                schedule: Schedule) -> Proposal: ...


def check_rebalance(runtime: Runtime, policy: Any, *, sharded: bool) -> None:
    """Refuses a policy that is not one, and a pipeline whose layers cannot move yet.

    Raises:
        ConfigError: ``policy`` is not a policy (``True``, say), the model is traced (``split_at=``, or skips that cross stages),
            sharded with FSDP, has skip connections, or ties weights of layers other
            than the first and the last.
    """
    if not callable(getattr(policy, "propose", None)):
        raise ConfigError(f"rebalance={policy!r}: give a policy, rebalance=conveyor.Rebalance() "
                          "(or Rebalance(window=10, threshold=0.1)), or None to keep the "
                          "balance")
    source = runtime.layout.source
    if runtime.layout.split_at is not None or source is None:
        raise ConfigError("rebalance= moves layers of an nn.Sequential (or a layer builder) "
                          "cut by balance; a model cut at split_at= (traced) cannot be "
                          "re-balanced yet: drop rebalance=, or give the model as an "
                          "nn.Sequential")
    if sharded:
        raise ConfigError("rebalance= with sharding='fsdp' is not supported yet: use "
                          "sharding='replicate', or drop rebalance=")
    if skips_of(source.layers_if_known()):
        raise ConfigError("rebalance= with skip connections (conveyor.skip.skippable) is not "
                          "supported yet: a move could make a skip cross stages; drop "
                          "rebalance=")
    ends = {source.names[0], source.names[-1]}
    for tie in runtime.layout.ties:
        inner = sorted({name.split(".")[0] for name in tie.names} - ends)
        if inner:
            raise ConfigError(
                f"rebalance= with the weight {' = '.join(tie.names)} tied across layers "
                f"{inner} is not supported yet (only ties of the first and last layers, "
                "which never move, are); drop rebalance= or untie the weight")


class Rebalancing:
    """A pipeline's measurements and moves, driven from ``Pipeline.step``.

    Args:
        policy: what decides (``conveyor.Rebalance``).
        num_layers: the model's number of layers.
    """

    def __init__(self, policy: BalancePolicy, num_layers: int) -> None:
        self.policy = policy
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0  # steps the pipeline has run
        self.moves = 0
        self._num_layers = num_layers
        self._since = 0  # steps since the start, or the last decision
        self._measured = 0
        self._sums: dict[tuple[int, Kind], list[float]] = {}  # [seconds, count]
        self._layers = [0.0] * num_layers
        self._transfers = [0.0, 0.0]
        self._recorder: Recorder | None = None
        self._own = False
        self._first = 0
        self._hooks: list[RemovableHandle] = []

    def before_step(self, runtime: Runtime, owner: nn.Module) -> Runtime:
        """At the start of a step: decides (and moves) when the window is full, then
        starts measuring unless the step is a warm-up one. Returns the runtime to run
        the step with: ``runtime``, or after a move the one that replaces it (the moved
        layers registered on ``owner``, the pipeline module)."""
        if getattr(runtime.transport, "broken", None) or runtime.executor.abandoned:
            return runtime  # the step refuses to run, and says why: no collective first
        if self._measured >= self.policy.window and self.policy.window > 0:
            runtime = self._decide(runtime, owner)
        self._since += 1
        if self._since > self.policy.warmup:
            self._start(runtime)
        return runtime

    def after_step(self, runtime: Runtime, *, completed: bool) -> None:
        """At the end of a step: stops measuring; a completed step joins the window."""
        self.steps += 1
        if self._recorder is None:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        records = self._recorder.records[self._first:]
        if self._own:
            runtime.executor.recorder = None
        self._recorder = None
        if not completed:
            return
        self._measured += 1
        for r in records:
            cell = self._sums.setdefault((r.action.stage, r.action.kind), [0.0, 0.0])
            cell[0] += max(0.0, r.end - r.start - r.wait - r.transfer)
            cell[1] += 1
            if r.transfer > 0:
                self._transfers[0] += r.transfer
                self._transfers[1] += 1

    # ------------------------------------------------------------------ measuring

    def _start(self, runtime: Runtime) -> None:
        executor = runtime.executor
        self._own = executor.recorder is None  # conveyor.record() may be recording
        if self._own:
            executor.recorder = Recorder()
        self._recorder = executor.recorder
        assert self._recorder is not None
        self._first = len(self._recorder.records)
        for stage in runtime.stages.values():
            for j, layer in enumerate(stage.layers):
                self._hooks += _time_forward(layer, stage.first_layer + j, self._layers)

    def _times(self, runtime: Runtime) -> StageTimes:
        """The window's figures, summed over every rank of the pipeline (and replica)."""
        count = runtime.schedule.num_stages
        flat = torch.zeros(count * 8 + self._num_layers + 2, dtype=torch.float64)
        for (stage, kind), (seconds, n) in self._sums.items():
            slot = stage * 8 + 2 * _KINDS.index(kind)
            flat[slot], flat[slot + 1] = seconds, n
        flat[count * 8:count * 8 + self._num_layers] = torch.tensor(self._layers,
                                                                     dtype=torch.float64)
        flat[-2:] = torch.tensor(self._transfers, dtype=torch.float64)
        topology = runtime.topology
        if topology.distributed:
            shared = flat.to(runtime.device)
            runtime.all_reduce(shared, topology.pipeline_group, "the re-balance's timings",
                               seconds=runtime.deadlines.opening)
            if topology.data_size > 1:
                runtime.all_reduce(shared, topology.data_group, "the re-balance's timings",
                                   seconds=runtime.deadlines.opening)
            flat = shared.cpu()
        values = flat.tolist()

        def mean(stage: int, kind: Kind) -> float | None:
            slot = stage * 8 + 2 * _KINDS.index(kind)
            return values[slot] / values[slot + 1] if values[slot + 1] else None

        def backward(stage: int) -> float:
            split = mean(stage, Kind.INPUT)
            return split if split is not None else mean(stage, Kind.BACKWARD) or 0.0

        return StageTimes(
            forward=tuple(mean(s, Kind.FORWARD) or 0.0 for s in range(count)),
            backward=tuple(backward(s) for s in range(count)),
            weight=tuple(mean(s, Kind.WEIGHT) or 0.0 for s in range(count)),
            layer_forward=tuple(values[count * 8:count * 8 + self._num_layers]),
            communication=values[-2] / values[-1] if values[-1] else 0.0,
            steps=self._measured)

    # ------------------------------------------------------------------ deciding

    def _decide(self, runtime: Runtime, owner: nn.Module) -> Runtime:
        times = self._times(runtime)
        self._since = self._measured = 0
        self._sums, self._layers = {}, [0.0] * self._num_layers
        self._transfers = [0.0, 0.0]
        proposal = self._agreed(runtime, times)
        if not proposal.move:
            logger.debug("no re-balance after step %d: %s", self.steps, proposal.reason)
            return runtime
        devices = {runtime.stage_device(s) for s in range(runtime.schedule.num_stages)}
        if self.optimizer is None and (runtime.topology.distributed or len(devices) > 1):
            raise ConfigError(
                f"the re-balance after step {self.steps} moves layers "
                f"({runtime.layout.balance} -> {proposal.balance}) to other devices or processes, and their optimizer "
                "state must go with them: call pipe.attach_optimizer(optimizer) once the "
                "optimizer is built")
        moved = move_layers(runtime, owner, proposal.balance, self.optimizer)
        self.moves += 1
        logger.info("rebalanced after step %d: %s", self.steps, proposal.reason)
        return moved

    def _agreed(self, runtime: Runtime, times: StageTimes) -> Proposal:
        """The policy's proposal as pipeline rank 0 makes it, on every rank."""
        topology = runtime.topology
        if not topology.distributed:
            return self.policy.propose(times, runtime.layout.balance, runtime.schedule)
        data = b""
        if topology.pipeline_rank == 0:
            data = pickle.dumps(tuple(self.policy.propose(times, runtime.layout.balance, runtime.schedule)))
        data = share_bytes(runtime, data, 0, "the re-balance's decision")
        balance, move, reason = pickle.loads(data)
        return Proposal(list(balance), bool(move), str(reason))


def _time_forward(layer: nn.Module, index: int, sums: list[float]) -> list[RemovableHandle]:
    """Hooks adding each forward call of ``layer`` (one thread at a time) to
    ``sums[index]``."""
    started: dict[int, float] = {}

    def before(module: nn.Module, args: Any) -> None:
        started[threading.get_ident()] = time.perf_counter()

    def after(module: nn.Module, args: Any, output: Any) -> None:
        start = started.pop(threading.get_ident(), None)
        if start is not None:
            sums[index] += time.perf_counter() - start

    return [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]

