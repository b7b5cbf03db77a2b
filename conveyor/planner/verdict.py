"""Whether to pipeline at all: the best mesh with a pipeline against the best without
one, which schedule and why, and the bandwidth of the slowest links at which the
answer would change (the crossover)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from conveyor.planner.machines import Cluster
from conveyor.planner.mesh import MeshCandidate, bound_at
from conveyor.planner.plans import readable_time
from conveyor.planner.profiles import ModelProfile

__all__ = ["Verdict", "decide"]

#: Where the crossover is looked for: bytes per second of the slowest links.
_SLOWEST, _FASTEST = 1e6, 1e13


@dataclass(frozen=True)
class Verdict:
    """What to run and why.

    Attributes:
        best: the fastest candidate.
        flat: the fastest without a pipeline (None: none fits).
        piped: the fastest with one (None: none fits, or the cluster has one device).
        speedup: the other kind's step over the best's (None: only one kind fits).
        level: the links whose bandwidth decides (the outermost level's name).
        crossover: the bandwidth of those links at which the other kind becomes as
            fast (None: not between 1 MB/s and 10 TB/s).
        reasons: the sentences the planner prints.
    """

    best: MeshCandidate
    flat: MeshCandidate | None
    piped: MeshCandidate | None
    speedup: float | None
    level: str
    bandwidth: float
    crossover: float | None
    reasons: tuple[str, ...]

    @property
    def pipeline(self) -> bool:
        return self.best.pipelined

    def headline(self) -> str:
        """One line: ``pipeline: PP + FSDP, PP=2 x TP=1 x DP=8 (fsdp), 1f1b, ...``."""
        what = "pipeline" if self.pipeline else "no pipeline"
        return f"{what}: {self.best.shape.kind}, {self.best.describe()}"

    def to_dict(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "kind": self.best.shape.kind,
                "schedule": self.best.schedule if self.pipeline else "none",
                "headline": self.headline(), "reasons": list(self.reasons),
                "best": self.best.to_dict(),
                "best_without_pipeline": self.flat.to_dict() if self.flat else None,
                "best_with_pipeline": self.piped.to_dict() if self.piped else None,
                "speedup": self.speedup, "deciding_links": self.level,
                "deciding_bandwidth_bytes_s": self.bandwidth,
                "crossover_bandwidth_bytes_s": self.crossover}


def decide(profile: ModelProfile, cluster: Cluster, candidates: Sequence[MeshCandidate],
           *, batch: int, optimizer: str = "adam") -> Verdict | None:
    """The verdict on ``candidates`` (fastest first, as
    :func:`conveyor.planner.meshsearch.search_mesh` gives them); None if none fits."""
    if not candidates:
        return None
    best = candidates[0]
    flat = next((c for c in candidates if not c.pipelined), None)
    piped = next((c for c in candidates if c.pipelined), None)
    other = piped if not best.pipelined else flat
    speedup = other.predicted_step_s / best.predicted_step_s if other else None
    level = cluster.levels[-1]
    crossover = None
    if flat is not None and piped is not None:
        crossover = _crossover(profile, cluster, candidates, batch=batch,
                               optimizer=optimizer)
    reasons = [_why_kind(best, other, speedup, level.name, level.bandwidth, crossover),
               *_why_schedule(best, candidates), _where_time_goes(best)]
    return Verdict(best, flat, piped, speedup, level.name, level.bandwidth, crossover,
                   tuple(r for r in reasons if r))


def _bandwidth(value: float) -> str:
    """Bytes per second as people write links: ``400 Gb/s (50 GB/s)``."""
    bits, nbytes = value * 8 / 1e9, value / 1e9
    return (f"{bits:.0f} Gb/s" if bits >= 100 else f"{bits:.3g} Gb/s") + \
        (f" ({nbytes:.0f} GB/s)" if nbytes >= 100 else f" ({nbytes:.3g} GB/s)")


def _why_kind(best: MeshCandidate, other: MeshCandidate | None, speedup: float | None,
              level: str, bandwidth: float, crossover: float | None) -> str:
    if other is None or speedup is None:
        alone = "no shape without a pipeline fits the memory" if best.pipelined else \
            "no pipeline fits (or there is nothing to pipeline over)"
        return f"{best.shape.kind}: {alone}"
    text = (f"{best.shape.kind} is {speedup:.2f}x faster than the best "
            f"{'without a pipeline' if best.pipelined else 'pipeline'} ({other.shape.kind}, "
            f"{other.describe()}, {readable_time(other.predicted_step_s)}) on these "
            f"{_bandwidth(bandwidth)} {level} links")
    if crossover is None:
        return text + "; it stays so at any bandwidth of them from 1 MB/s to 10 TB/s"
    if best.pipelined:
        return text + f"; do not pipeline when they are above {_bandwidth(crossover)}"
    return text + f"; pipeline when they are below {_bandwidth(crossover)}"


def _why_schedule(best: MeshCandidate, candidates: Sequence[MeshCandidate]) -> list[str]:
    if not best.pipelined:
        return []
    rivals = [c for c in candidates if c.shape == best.shape and c is not best]
    said = [f"{c.schedule} {c.predicted_step_s / best.predicted_step_s:.2f}x slower"
            f" ({readable_time(c.idle_s)} idle)" for c in rivals]
    return [f"{best.schedule} with {best.chunks} micro-batches: "
            + "; ".join(said or ["the only schedule that fits this shape"])]


def _where_time_goes(best: MeshCandidate) -> str:
    step = best.predicted_step_s
    parts = [("compute", best.compute_s - best.tp_comm_s), ("TP collectives", best.tp_comm_s),
             ("data-parallel sync", best.dp_comm_s), ("the runtime's step", best.runtime_s),
             ("pipeline fill and drain", best.idle_s)]
    shown = ", ".join(f"{name} {100 * seconds / step:.0f}%" for name, seconds in parts
                      if seconds > 0.005 * step)
    return (f"its step {readable_time(step)}: {shown}; peak "
            f"{best.peak_memory_bytes / 1e9:.3g} GB per rank"
            f"{', recomputing' if best.recompute else ''}")


def _crossover(profile: ModelProfile, cluster: Cluster,
               candidates: Sequence[MeshCandidate], *, batch: int,
               optimizer: str) -> float | None:
    """The outermost links' bandwidth at which the fastest of ``candidates`` without a
    pipeline and the fastest with one take as long (each costed by
    :func:`conveyor.planner.mesh.bound_at`), by bisection on its logarithm; None if
    one kind stays faster from 1 MB/s to 10 TB/s."""
    def gap(bandwidth: float) -> float:
        levels = (*cluster.levels[:-1], replace(cluster.levels[-1], bandwidth=bandwidth))
        there = replace(cluster, levels=levels)
        steps = {True: math.inf, False: math.inf}
        for c in candidates:
            step = bound_at(profile, there, c, batch=batch, optimizer=optimizer)
            steps[c.pipelined] = min(steps[c.pipelined], step)
        return math.log(steps[True] / steps[False])

    low, high = math.log(_SLOWEST), math.log(_FASTEST)
    at_low, at_high = gap(math.exp(low)), gap(math.exp(high))
    if (at_low > 0) == (at_high > 0):
        return None
    for _ in range(20):
        middle = (low + high) / 2
        at_middle = gap(math.exp(middle))
        if (at_middle > 0) == (at_low > 0):
            low, at_low = middle, at_middle
        else:
            high = middle
    return math.exp((low + high) / 2)
