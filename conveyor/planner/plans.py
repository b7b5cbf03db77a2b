"""A plan: where each stage's layers and replicas go, the schedule and micro-batches,
and what the solver predicts for it; saved as JSON and run by ``Pipeline(plan=...)``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.errors import ConveyorError

__all__ = ["PipelinePlan", "StageChoice"]


@dataclass(frozen=True)
class StageChoice:
    """One stage of a plan.

    Attributes:
        layers: its first and last layer (inclusive), as the profile numbers them.
        devices: the devices that hold its replicas.
        recompute: whether it recomputes its forward in backward.
        forward: seconds of the forward of one micro-batch.
        compute: seconds of forward and backward (and recomputation) of one micro-batch.
        sync: seconds of the all-reduce of its gradients among its replicas, per step.
        send: seconds to move one micro-batch's output to the next stage (each way).
        memory: bytes each of its devices needs at its peak.
    """

    layers: tuple[int, int]
    devices: tuple[int, ...]
    recompute: bool
    forward: float
    compute: float
    sync: float
    send: float
    memory: float

    @property
    def replicas(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class PipelinePlan:
    """A cut, replicas per stage, schedule and micro-batches, with what they cost.

    Attributes:
        step_time: the predicted seconds of one training step.
        bottleneck: why it takes that long: the busiest stage or link.
        split_at: the submodules where stages 1.. begin, for a model cut by name (empty
            for an ``nn.Sequential``: see ``balance``).
    """

    model: str
    batch: int
    schedule: str
    chunks: int
    optimizer: str
    stages: tuple[StageChoice, ...]
    step_time: float
    bottleneck: str
    memory_cap: float
    split_at: tuple[str, ...] = ()

    @property
    def balance(self) -> list[int]:
        return [last - first + 1 for first, last in (s.layers for s in self.stages)]

    @property
    def replicas(self) -> list[int]:
        return [s.replicas for s in self.stages]

    @property
    def devices(self) -> int:
        return sum(self.replicas)

    @property
    def peak_memory(self) -> float:
        return max(s.memory for s in self.stages)

    @property
    def throughput(self) -> float:
        return self.batch / self.step_time

    def pipeline_options(self) -> dict[str, Any]:
        """What ``Pipeline(plan=self)`` passes on: the cut, schedule, micro-batches,
        recomputation and replicas. Uniform replicas make D replicas of the pipeline,
        each running M / D of the plan's M micro-batches on its share of the batch;
        uneven ones make one pipeline whose stage s has ``replicas[s]`` processes
        taking turns at the M micro-batches (``data_parallel=[...]``).
        """
        shared = {**self.cut(), "schedule": self.schedule, "recompute": self.recompute}
        if len(set(self.replicas)) > 1:
            return {**shared, "chunks": self.chunks, "data_parallel": self.replicas}
        replicas = self.replicas[0]  # each replica of the pipeline runs its share
        return {**shared, "chunks": self.chunks // replicas, "data_parallel": replicas}

    @property
    def recompute(self) -> str | list[str]:
        """The recompute mode as ``Pipeline`` takes it: one for all, or one per stage."""
        modes = {s.recompute for s in self.stages}
        if len(modes) == 1:
            return "always" if modes == {True} else "never"
        return ["always" if s.recompute else "never" for s in self.stages]

    def cut(self) -> dict[str, Any]:
        """Where the stages begin, as ``Pipeline`` takes it: ``split_at`` (the names of
        the submodules, for a model profiled by its blocks) or ``balance``."""
        if self.split_at:
            return {"split_at": [self.split_at[s.layers[0] - 1] for s in self.stages[1:]]}
        return {"balance": self.balance}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["balance"], data["replicas"] = self.balance, self.replicas
        data["peak_memory"] = self.peak_memory
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelinePlan:
        try:
            stages = tuple(
                StageChoice((int(s["layers"][0]), int(s["layers"][1])), tuple(s["devices"]),
                            bool(s["recompute"]), float(s["forward"]), float(s["compute"]),
                            float(s["sync"]), float(s["send"]), float(s["memory"]))
                for s in data["stages"])
            return cls(str(data["model"]), int(data["batch"]), str(data["schedule"]),
                       int(data["chunks"]), str(data["optimizer"]), stages,
                       float(data["step_time"]), str(data["bottleneck"]),
                       float(data["memory_cap"]), tuple(data.get("split_at", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConveyorError(f"cannot read the plan: {exc!r}; plans are written by "
                                "PipelinePlan.save (conveyor plan --save)") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PipelinePlan:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ConveyorError(f"cannot read the plan {path}: {exc}") from None

    def describe(self) -> str:
        """The plan as ``conveyor plan`` prints it."""
        lines = [f"{self.model}: {len(self.stages)} stages on {self.devices} devices, "
                 f"{self.schedule}, {self.chunks} micro-batches of {self.batch // self.chunks}"
                 f"; step {readable_time(self.step_time)} ({self.throughput:.4g} samples/s), "
                 f"peak {self.peak_memory / 1e9:.2f} GB per device of "
                 f"{self.memory_cap / 1e9:.2f}",
                 f"  bottleneck: {self.bottleneck}"]
        for k, s in enumerate(self.stages):
            lines.append(
                f"  stage {k}: layers {s.layers[0]}-{s.layers[1]} on devices "
                f"{_devices(s.devices)} ({s.replicas} replica{'s' * (s.replicas > 1)}), "
                f"{'recompute' if s.recompute else 'keeps activations'}, "
                f"{readable_time(s.compute)} per micro-batch, sync {readable_time(s.sync)}, "
                f"send {readable_time(s.send)}, {s.memory / 1e9:.2f} GB")
        return "\n".join(lines)


def readable_time(seconds: float) -> str:
    """Seconds as people read them: ``"12.3 ms"``, ``"2.08 s"``."""
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _devices(devices: Sequence[int]) -> str:
    return str(devices[0]) if len(devices) == 1 else f"{devices[0]}-{devices[-1]}"
