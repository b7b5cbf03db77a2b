"""Timelines: what each rank did when, simulated or measured, and ways to look at them.

A :class:`Timeline` is a list of :class:`Event` (rank, stage, kind, micro-batch, start,
end; measured events also say how long they waited for a neighbour and moved tensors),
with its unit of time: seconds when measured, or a simulator's cost units, and the
schedule's edges (values sent from stage i straight to a later stage j), whose messages
it shows as arrows: in Chrome traces as flow events, in Gantt charts drawn over the bars.
The simulator and the runtime's recorder produce the same record, so predicted and
measured steps can be compared, exported to Chrome's trace format (open in Perfetto or
chrome://tracing) and drawn as Gantt charts one above the other. Pure Python;
matplotlib is needed only to draw.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Event", "Timeline", "peak_open", "plot_timelines"]

_COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#8172B3", "W": "#DD8452"}
#: What each kind of action computes, in the legend and in Chrome traces.
_WORDS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


@dataclass(frozen=True)
class Event:
    """One action of one rank, in the timeline's unit (seconds when measured).

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
        unit: the unit of every time: ``"s"`` (seconds: measured, or simulated from
            seconds), or the name of a simulator's abstract unit (``"units"``).
        edges: the schedule's edges as ``(source, destination, gradient)``: stage
            ``source``'s forward sends values straight to stage ``destination``'s (and,
            with ``gradient``, the destination's backward sends their gradient back).
        compiled_graphs: how many graphs torch.compile made in this process while the
            steps ran (``compile=True``): after the first steps, any is a
            recompilation in the middle of training.
    """

    num_ranks: int
    events: list[Event] = field(default_factory=list)
    source: str = "measured"
    name: str = ""
    unit: str = "s"
    edges: list[tuple[int, int, bool]] = field(default_factory=list)
    compiled_graphs: int = 0

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
        """The time rank ``rank`` spent computing."""
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

    def edge_messages(self) -> list[tuple[Event, Event, str]]:
        """The messages of the edges, as (sending event, receiving event, ``"activation"``
        or ``"gradient"``): per edge i -> j and micro-batch m, from ``iFm`` to ``jFm``,
        and (for an edge with gradients) from j's backward of m (``B`` or ``I``) to
        i's. Pairs with an event missing (a partial timeline) are left out."""
        found: dict[tuple[int, str, int], Event] = {}
        for e in self.events:
            kind = "F" if e.kind == "F" else "B" if e.kind in ("B", "I") else ""
            if kind:
                found[(e.stage, kind, e.microbatch)] = e
        microbatches = sorted({e.microbatch for e in self.events})
        messages = []
        for source, destination, gradient in self.edges:
            for m in microbatches:
                sent = found.get((source, "F", m)), found.get((destination, "F", m))
                if sent[0] is not None and sent[1] is not None:
                    messages.append((sent[0], sent[1], "activation"))
                back = found.get((destination, "B", m)), found.get((source, "B", m))
                if gradient and back[0] is not None and back[1] is not None:
                    messages.append((back[0], back[1], "gradient"))
        return messages

    # ------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        data = {"num_ranks": self.num_ranks, "source": self.source, "name": self.name,
                "unit": self.unit, "events": [asdict(e) for e in self.events]}
        if self.edges:
            data["edges"] = [list(edge) for edge in self.edges]
        if self.compiled_graphs:
            data["compiled_graphs"] = self.compiled_graphs
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        return cls(num_ranks=data["num_ranks"], source=data.get("source", "measured"),
                   name=data.get("name", ""), unit=data.get("unit", "s"),
                   events=[Event(**e) for e in data["events"]],
                   edges=[(int(i), int(j), bool(g)) for i, j, g in data.get("edges", ())],
                   compiled_graphs=int(data.get("compiled_graphs", 0)))

    def save(self, path: str | Path) -> None:
        """Writes the timeline as JSON (``Timeline.load`` reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome trace event format: a process per rank, times in microseconds (of
        a timeline in abstract units, one unit is drawn as a second); each message of
        an edge is a flow event, drawn as an arrow between its two actions."""
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
        for number, (sent, received, kind) in enumerate(self.edge_messages()):
            # The arrow leaves the sending action just before its end (a flow's start
            # binds to the slice that encloses it) and enters the receiving one.
            leaves = sent.end - min(1e-3 * (sent.end - sent.start), 1e-9)
            name = f"{sent.stage}->{received.stage}" if kind == "activation" else \
                f"{sent.stage}->{received.stage} gradient"
            common = {"name": name, "cat": "edge", "id": number}
            trace.append({**common, "ph": "s", "pid": sent.rank, "tid": sent.stage,
                          "ts": (leaves - origin) * 1e6})
            trace.append({**common, "ph": "f", "bp": "e", "pid": received.rank,
                          "tid": received.stage, "ts": (received.start - origin) * 1e6})
        return {"traceEvents": trace, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "schedule": self.name,
                              "unit": self.unit}}

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()) + "\n")


_IDLE = "#E6E6E6"  # the band behind a rank's actions: what shows through is idle time
_ARROW = "arrow"  # in a legend entry, in place of an edge colour: drawn as a line
_EDGE_COLOUR = "#C44E52"


def plot_timelines(timelines: Sequence[Timeline], path: str | Path, *,
                   titles: Sequence[str] | None = None, xlabel: str | None = None) -> None:
    """Draws Gantt charts, one above the other on the same time axis, to a PNG.

    A rank is a row of actions on a grey band as long as the step, so its idle time
    (the bubble) shows grey; waiting for a neighbour within a measured action is
    hatched; the messages of the schedule's edges are arrows from the action that sends
    to the one that receives (dashed: gradients). Each action is labelled where the label fits, and the legend names only
    what is drawn. Seconds are shown as ms or s; another unit by its name, or as
    ``xlabel`` says (``conveyor simulate`` says what its unit is).

    Raises:
        ImportError: matplotlib is not installed (``pip install conveyor[plots]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("drawing timelines needs matplotlib: pip install "
                          "'conveyor[plots]'") from exc
    scales = [_time_scale(t) for t in timelines]
    shared = len(set(scales)) == 1  # one axis only for one unit
    legend_in, rows_in = 0.3, sum(max(1, t.num_ranks) * 0.45 + 0.9 for t in timelines)
    height = max(2.5, rows_in + legend_in)
    figure, axes = plt.subplots(len(timelines), 1, figsize=(_width(timelines), height),
                                sharex=shared, squeeze=False)
    longest = max(t.makespan * scale for t, (scale, _) in zip(timelines, scales, strict=True))
    for index, (timeline, axis) in enumerate(zip(timelines, axes[:, 0], strict=True)):
        scale, unit = scales[index]
        _draw_bars(axis, timeline, scale)
        axis.set_xlim(0, max(longest if shared else timeline.makespan * scale, 1e-12))
        title = titles[index] if titles else f"{timeline.source} {timeline.name}"
        axis.set_title(f"{title}: {timeline.makespan * scale:.4g} {unit}, "
                       f"bubble {100 * timeline.mean_bubble:.1f}%", fontsize=10, loc="left")
        if not shared or index == len(timelines) - 1:
            axis.set_xlabel(xlabel or f"time ({unit})")
    handles: list[Any] = [
        Line2D([], [], color=colour, linestyle="--" if hatch == "--" else "-", label=label)
        if edge == _ARROW
        else Patch(facecolor=colour, edgecolor=edge, hatch=hatch, label=label)
        for label, colour, edge, hatch in _legend(timelines)]
    figure.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, legend_in / height, 1, 1))
    for timeline, axis, (scale, _) in zip(timelines, axes[:, 0], scales, strict=True):
        _draw_labels(axis, timeline, scale)  # once the layout says how wide a bar is
        _draw_arrows(axis, timeline, scale)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _time_scale(timeline: Timeline) -> tuple[float, str]:
    """The factor and the name of the unit a timeline is drawn in: ms or s for seconds,
    an abstract unit as it is."""
    if timeline.unit != "s":
        return 1.0, timeline.unit
    return (1e3, "ms") if timeline.makespan < 10 else (1.0, "s")


def _width(timelines: Sequence[Timeline]) -> float:
    """Inches wide enough for a short action's label (12 to 20)."""
    spans = [(e.end - e.start) / t.makespan for t in timelines for e in t.events
             if t.makespan > 0 and e.end > e.start]
    if not spans:
        return 12.0
    short = sorted(spans)[len(spans) // 10]  # most actions are at least this long
    return min(20.0, max(12.0, 0.24 / short + 1.5))


def _legend(timelines: Sequence[Timeline]) -> list[tuple[str, str, str, str | None]]:
    """(label, colour, edge colour, hatch) of what the charts show, in drawing order:
    the kinds of action present, idle time where a rank has some, waiting within an
    action where a measured one waited, and the edges' messages (edge colour
    ``_ARROW``: a line, whose style is in place of the hatch)."""
    drawn = {e.kind for t in timelines for e in t.events}
    entries: list[tuple[str, str, str, str | None]] = [
        (f"{k}: {_WORDS[k]}", c, c, None) for k, c in _COLOURS.items() if k in drawn]
    entries += [(f"{k}: {k}", "grey", "grey", None) for k in sorted(drawn - set(_COLOURS))]
    if any(t.bubble(r) > 1e-9 for t in timelines for r in range(t.num_ranks)):
        entries.append(("idle (bubble)", _IDLE, _IDLE, None))
    if any(e.wait > 0 for t in timelines for e in t.events):
        entries.append(("waiting for a neighbour", "white", "grey", "///"))
    kinds = {kind for t in timelines for _, _, kind in t.edge_messages()}
    if "activation" in kinds:
        entries.append(("values sent past the next stage", _EDGE_COLOUR, _ARROW, "-"))
    if "gradient" in kinds:
        entries.append(("their gradients", _EDGE_COLOUR, _ARROW, "--"))
    return entries


def _draw_bars(axis: Any, timeline: Timeline, scale: float) -> None:
    """One row per rank: the step's grey band, each action, its waiting hatched."""
    origin = timeline.origin
    for rank in range(timeline.num_ranks):
        axis.barh(timeline.num_ranks - 1 - rank, timeline.makespan * scale, left=0,
                  height=0.8, color=_IDLE, linewidth=0)
    for e in timeline.events:
        y = timeline.num_ranks - 1 - e.rank
        left, width = (e.start - origin) * scale, (e.end - e.start) * scale
        axis.barh(y, width, left=left, height=0.8, color=_COLOURS.get(e.kind, "grey"),
                  edgecolor="white", linewidth=0.5)
        if e.wait > 0:
            axis.barh(y, e.wait * scale, left=left, height=0.8, color="white",
                      alpha=0.6, hatch="///", edgecolor="grey", linewidth=0)
    axis.set_yticks(range(timeline.num_ranks))
    axis.set_yticklabels([f"rank {r}" for r in reversed(range(timeline.num_ranks))])


def _draw_labels(axis: Any, timeline: Timeline, scale: float) -> None:
    """Writes each action's label (``1F3``) in its bar, in the largest font that fits
    (7 to 5 points), or not at all."""
    from matplotlib.textpath import TextPath

    left, right = axis.get_xlim()
    pixels = axis.get_window_extent().width / (right - left)  # per unit of time
    points = 72 / axis.figure.dpi
    origin = timeline.origin
    for e in timeline.events:
        width = (e.end - e.start) * scale
        for size in (7, 6, 5):
            text = TextPath((0, 0), e.label, size=size).get_extents().width / points
            if text + 4 <= width * pixels:
                axis.text((e.start - origin) * scale + width / 2,
                          timeline.num_ranks - 1 - e.rank, e.label, ha="center",
                          va="center", fontsize=size, color="white")
                break


def _draw_arrows(axis: Any, timeline: Timeline, scale: float) -> None:
    """An arrow per message of an edge, from the end of the action that sends it to the
    start of the one that receives it; gradients dashed."""
    origin = timeline.origin
    for sent, received, kind in timeline.edge_messages():
        axis.annotate(
            "", xy=((received.start - origin) * scale, timeline.num_ranks - 1 - received.rank),
            xytext=((sent.end - origin) * scale, timeline.num_ranks - 1 - sent.rank),
            arrowprops={"arrowstyle": "->", "color": _EDGE_COLOUR, "linewidth": 0.8,
                        "linestyle": "--" if kind == "gradient" else "-",
                        "shrinkA": 0, "shrinkB": 0})


def peak_open(events: Sequence[Event], opens: str, closes: Collection[str],
              key: Callable[[Event], int], size: int) -> list[int]:
    """Per ``key`` (0 .. size-1: a stage, a rank), the most micro-batches open at once,
    from the start of an ``opens`` action to the end of a ``closes`` one (an end and a
    start at the same time: the end first)."""
    changes = sorted((e.start, 1, key(e), 1) if e.kind == opens else (e.end, 0, key(e), -1)
                     for e in events if e.kind == opens or e.kind in closes)
    open_now, peak = [0] * size, [0] * size
    for _, _, which, delta in changes:
        open_now[which] += delta
        peak[which] = max(peak[which], open_now[which])
    return peak
