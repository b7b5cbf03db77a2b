"""Gantt charts say what they show: the unit of time, only the kinds drawn, idle time,
the messages of the schedule's edges."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.schedules.simulate import CostModel, simulate
from conveyor.schedules.timeline import (
    Event,
    Timeline,
    _draw_arrows,
    _legend,
    _time_scale,
    plot_timelines,
)
from conveyor.schedules import Edge, build


def simulated(name: str, costs: CostModel | None = None, *, virtual: int = 1) -> Timeline:
    table = build(name, 4, 8, virtual_stages=virtual)
    return simulate(table, costs or CostModel.per_rank(table)).timeline


def labels(timelines: list[Timeline]) -> list[str]:
    return [label for label, *_ in _legend(timelines)]


def test_abstract_costs_are_drawn_in_their_units_and_seconds_in_ms_or_s() -> None:
    assert _time_scale(simulated("1f1b")) == (1.0, "units")
    seconds = CostModel.uniform(4, forward=0.01, backward=0.01, weight=0.01, unit="s")
    assert _time_scale(simulated("1f1b", seconds)) == (1e3, "ms")  # a 0.33 s step
    slow = CostModel.uniform(4, forward=1.0, backward=1.0, weight=1.0, unit="s")
    assert _time_scale(simulated("1f1b", slow)) == (1.0, "s")  # a 33 s step


def test_the_legend_names_only_the_kinds_drawn_and_idle_time() -> None:
    assert labels([simulated("1f1b")]) == ["F: forward", "B: backward", "idle (bubble)"]
    assert labels([simulated("zero-bubble")]) == [
        "F: forward", "I: input gradient", "W: weight gradient", "idle (bubble)"]
    assert labels([simulated("1f1b"), simulated("zero-bubble")]) == [
        "F: forward", "B: backward", "I: input gradient", "W: weight gradient",
        "idle (bubble)"]


def test_the_legend_shows_waiting_when_a_measured_action_waited_and_idle_only_if_any() -> None:
    busy = Timeline(1, [Event(0, 0, "F", 0, 0.0, 1.0), Event(0, 0, "B", 0, 1.0, 3.0)])
    assert labels([busy]) == ["F: forward", "B: backward"]  # never idle, never waited
    waited = Timeline(2, [Event(0, 0, "F", 0, 0.0, 1.0),
                          Event(1, 1, "F", 0, 0.0, 2.0, wait=1.0)])
    assert labels([waited]) == ["F: forward", "idle (bubble)", "waiting for a neighbour"]


@pytest.mark.parametrize(("name", "virtual"), [("gpipe", 1), ("1f1b", 1),
                                               ("interleaved-1f1b", 2), ("zero-bubble", 1)])
def test_every_schedule_draws(tmp_path: Path, name: str, virtual: int) -> None:
    path = tmp_path / f"{name}.png"
    plot_timelines([simulated(name, virtual=virtual)], path, xlabel="time (units of F)")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_the_edges_messages_are_drawn_as_arrows_named_in_the_legend(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = build("1f1b", 4, 8).with_edges([Edge(0, 2), Edge(1, 3, gradient=False)])
    timeline = simulate(table, CostModel.per_rank(table)).timeline
    assert labels([timeline])[-2:] == ["values sent past the next stage", "their gradients"]
    one_way = simulate(table.with_edges([Edge(1, 3, gradient=False)]),
                       CostModel.per_rank(table)).timeline
    assert labels([one_way])[-1] == "values sent past the next stage"
    assert "their gradients" not in labels([one_way])
    assert "values sent past the next stage" not in labels([simulated("1f1b")])
    # One arrow per message: 0 -> 2 and back, 1 -> 3 one way, for 8 micro-batches.
    figure, axis = plt.subplots()
    _draw_arrows(axis, timeline, 1.0)
    assert len(axis.texts) == len(timeline.edge_messages()) == 8 * 3
    plt.close(figure)
    path = tmp_path / "edges.png"
    plot_timelines([timeline], path)
    assert path.read_bytes()[:4] == b"\x89PNG"
