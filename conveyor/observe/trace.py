"""Timelines: what each rank did when, simulated or measured, and ways to look at them.

A :class:`Timeline` is a list of :class:`Event` (rank, stage, kind, micro-batch, start,
end; measured events also say how long they waited for a neighbour and moved tensors).
The simulator and the runtime's recorder produce the same record, so predicted and
measured steps can be compared, exported to Chrome's trace format (open in Perfetto or
chrome://tracing) and drawn as Gantt charts one above the other. Pure Python;
matplotlib is needed only to draw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Event", "Timeline", "plot_timelines"]

_COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#8172B3", "W": "#DD8452"}
#: What each kind of action computes, in the legend and in Chrome traces.
_WORDS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


@dataclass(frozen=True)
class Event:
    """One action of one rank, in seconds from the start of the step.

    Attributes:
        wait: of the duration, the time spent waiting for a neighbour's message.
        transfer: of the duration, the time spent moving tensors out.
    """

    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    wait: float = 0.0
    transfer: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def compute(self) -> float:
        return self.end - self.start - self.wait - self.transfer


@dataclass
class Timeline:
    """The events of one step on ``num_ranks`` ranks.

    Attributes:
        source: "simulated" or "measured".
        name: the schedule's name.
    """

    num_ranks: int
    events: list[Event] = field(default_factory=list)
    source: str = "measured"
    name: str = ""

    @property
    def origin(self) -> float:
        """When the first action started (0 without events)."""
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """From the first start to the last end."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - self.origin

    def busy(self, rank: int) -> float:
        """Seconds rank ``rank`` spent computing."""
        return sum(e.compute for e in self.events if e.rank == rank)

    def bubble(self, rank: int) -> float:
        """The fraction of the step rank ``rank`` did not compute."""
        return 1.0 - self.busy(rank) / self.makespan if self.makespan else 0.0

    @property
    def mean_bubble(self) -> float:
        """The mean over ranks of the fraction of the step spent not computing."""
        return sum(self.bubble(r) for r in range(self.num_ranks)) / max(1, self.num_ranks)

    def breakdown(self) -> list[dict[str, float]]:
        """Per rank, where the step went: computing, moving tensors, waiting for a
        neighbour, and between actions; ``imbalance`` is how much more the busiest rank
        computed, the part of this rank's idle time that no schedule could remove."""
        busiest = max((self.busy(r) for r in range(self.num_ranks)), default=0.0)
        makespan = self.makespan
        rows = []
        for rank in range(self.num_ranks):
            mine = [e for e in self.events if e.rank == rank]
            compute = sum(e.compute for e in mine)
            rows.append({
                "compute": compute,
                "transfer": sum(e.transfer for e in mine),
                "waiting": sum(e.wait for e in mine),
                "between": makespan - sum(e.end - e.start for e in mine),
                "imbalance": busiest - compute,
            })
        return rows

    # ------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        return {"num_ranks": self.num_ranks, "source": self.source, "name": self.name,
                "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        return cls(num_ranks=data["num_ranks"], source=data.get("source", "measured"),
                   name=data.get("name", ""),
                   events=[Event(**e) for e in data["events"]])

    def save(self, path: str | Path) -> None:
        """Writes the timeline as JSON (``Timeline.load`` reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome trace event format: a process per rank, times in microseconds."""
        origin = self.origin
        trace = [{"name": "process_name", "ph": "M", "pid": rank,
                  "args": {"name": f"rank {rank}"}} for rank in range(self.num_ranks)]
        for e in self.events:
            trace.append({
                "name": e.label, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": e.stage,
                "ts": (e.start - origin) * 1e6, "dur": (e.end - e.start) * 1e6,
                "args": {"action": _WORDS.get(e.kind, e.kind), "stage": e.stage,
                         "microbatch": e.microbatch,
                         "wait_us": e.wait * 1e6, "transfer_us": e.transfer * 1e6},
            })
        return {"traceEvents": trace, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "schedule": self.name}}

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()) + "\n")


def plot_timelines(timelines: Sequence[Timeline], path: str | Path, *,
                   titles: Sequence[str] | None = None) -> None:
    """Draws Gantt charts, one above the other on the same time axis, to a PNG.

    Waiting within an action is drawn hatched. Needs matplotlib.

    Raises:
        ImportError: matplotlib is not installed (``pip install conveyor[plots]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("drawing timelines needs matplotlib: pip install "
                          "'conveyor[plots]'") from exc
    span = max(t.makespan for t in timelines) or 1.0
    scale, unit = (1e3, "ms") if span < 10 else (1.0, "s")
    height = sum(max(1, t.num_ranks) * 0.45 + 0.9 for t in timelines)
    figure, axes = plt.subplots(len(timelines), 1, figsize=(12, max(2.5, height)),
                                sharex=True, squeeze=False)
    for index, (timeline, axis) in enumerate(zip(timelines, axes[:, 0])):
        origin = timeline.origin
        for e in timeline.events:
            y = timeline.num_ranks - 1 - e.rank
            left, width = (e.start - origin) * scale, (e.end - e.start) * scale
            axis.barh(y, width, left=left, height=0.8, color=_COLOURS.get(e.kind, "grey"),
                      edgecolor="white", linewidth=0.5)
            if e.wait > 0:
                axis.barh(y, e.wait * scale, left=left, height=0.8, color="white",
                          alpha=0.6, hatch="///", edgecolor="grey", linewidth=0)
            if width > span * scale / 60:
                axis.text(left + width / 2, y, e.label, ha="center", va="center",
                          fontsize=7, color="white")
        axis.set_yticks(range(timeline.num_ranks))
        axis.set_yticklabels([f"rank {r}" for r in reversed(range(timeline.num_ranks))])
        title = titles[index] if titles else f"{timeline.source} {timeline.name}"
        axis.set_title(f"{title}: {timeline.makespan * scale:.1f} {unit}, "
                       f"bubble {100 * timeline.mean_bubble:.1f}%", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel(f"time ({unit})")
    drawn = {e.kind for t in timelines for e in t.events}
    handles = [Patch(color=c, label=f"{k}: {_WORDS[k]}")
               for k, c in _COLOURS.items() if k in drawn]
    figure.legend(handles=handles, loc="upper right", fontsize=8, ncol=4, frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    figure.savefig(path, dpi=120)
    plt.close(figure)
