"""The simulator gives the textbook bubbles and memory, and catches deadlocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conveyor.errors import ScheduleError
from conveyor.schedules import Edge, Schedule, build, parse
from conveyor.schedules.simulate import CostModel, simulate
from conveyor.schedules.timeline import Event, Timeline

SIZES = [(k, m) for k in (1, 2, 3, 4, 8) for m in (1, 2, 4, 7, 8, 16, 32)]


@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_k_minus_1_over_m_plus_k_minus_1(
        name: str, stages: int, microbatches: int) -> None:
    result = simulate(build(name, stages, microbatches), CostModel.uniform(stages))
    assert result.makespan == pytest.approx(3 * (microbatches + stages - 1))
    assert result.bubble == pytest.approx((stages - 1) / (microbatches + stages - 1), rel=1e-12)


@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_1f1b_holds_k_micro_batches_where_gpipe_holds_m(stages: int, microbatches: int) -> None:
    costs = CostModel.uniform(stages, activation_bytes=10.0)
    gpipe = simulate(build("gpipe", stages, microbatches), costs)
    one_f_one_b = simulate(build("1f1b", stages, microbatches), costs)
    assert gpipe.peak_inflight == [microbatches] * stages
    assert one_f_one_b.peak_inflight == [min(stages - s, microbatches) for s in range(stages)]
    assert one_f_one_b.peak_bytes[0] == 10.0 * min(stages, microbatches)


@pytest.mark.parametrize("virtual", [2, 3, 4])
@pytest.mark.parametrize(("stages", "groups"), [(2, 1), (2, 4), (4, 2), (4, 8), (8, 4)])
def test_interleaving_divides_the_bubble_by_v(stages: int, groups: int, virtual: int) -> None:
    microbatches = stages * groups
    plain = simulate(build("1f1b", stages, microbatches), CostModel.uniform(stages))
    table = build("interleaved-1f1b", stages, microbatches, virtual_stages=virtual)
    interleaved = simulate(table, CostModel.per_rank(table))  # each stage 1/V of a rank
    work = 3 * microbatches
    assert interleaved.makespan - work == pytest.approx((plain.makespan - work) / virtual)


def test_per_rank_costs_give_each_of_v_stages_a_vth_of_the_ranks_work() -> None:
    table = build("interleaved-1f1b", 4, 8, virtual_stages=2)
    costs = CostModel.per_rank(table, forward=1.0, backward=2.0, weight=4.0,
                               activation_bytes=10.0, communication=0.25)
    assert costs.forward == (0.5,) * 8
    assert costs.backward == (1.0,) * 8
    assert costs.weight == (2.0,) * 8
    assert costs.activation_bytes == (5.0,) * 8
    assert costs.communication == (0.25,) * 7  # a boundary moves the same tensor
    assert costs.unit == "units"
    assert CostModel.per_rank(build("1f1b", 4, 8)) == CostModel.uniform(4)


def test_interleaving_the_same_model_is_faster_than_1f1b_and_holds_more() -> None:
    # 4 ranks, 8 micro-batches: the same layers as 4 stages, or as 8 stages of half.
    plain_table = build("1f1b", 4, 8)
    table = build("interleaved-1f1b", 4, 8, virtual_stages=2)
    plain = simulate(plain_table, CostModel.per_rank(plain_table))
    interleaved = simulate(table, CostModel.per_rank(table))
    assert plain.makespan == pytest.approx(33)  # 3 M + 3 (K - 1)
    assert interleaved.makespan == pytest.approx(28.5)  # 3 M + 3 (K - 1) / V
    assert interleaved.bubble == pytest.approx(3 / 19)  # (K - 1) / (V M + K - 1)
    assert plain.peak_bytes[0] == pytest.approx(4)  # K micro-batches of rank 0's layers
    assert interleaved.peak_bytes[0] == pytest.approx(5.5)  # 8 + 3 halves at once


@pytest.mark.parametrize(("stages", "microbatches"),
                         [(k, m) for k, m in SIZES if m >= k and k > 1])
def test_zero_bubble_h1_bubble_is_a_third_of_1f1b(stages: int, microbatches: int) -> None:
    costs = CostModel.uniform(stages)  # F = B = W
    one_f_one_b = simulate(build("1f1b", stages, microbatches), costs)
    zero_bubble = simulate(build("zero-bubble", stages, microbatches), costs)
    work = 3 * microbatches
    assert zero_bubble.makespan - work == pytest.approx((one_f_one_b.makespan - work) / 3)
    assert max(zero_bubble.peak_inflight) == max(one_f_one_b.peak_inflight) == stages


def test_each_action_is_charged_by_its_own_kind() -> None:
    # F = 1, I = 2, W = 3, so a full B = I + W = 5; the micro-batches mix B and I + W.
    table = parse("0F0 0F1 0F2 0I0 0W0 0B1 0B2\n"
                  "1F0 1B0 1F1 1I1 1F2 1W1 1B2")
    costs = CostModel((1.0, 1.0), (2.0, 2.0), (3.0, 3.0), (1.0, 10.0), (0.0,))
    result = simulate(table, costs)
    assert {e.label: (e.start, e.end) for e in result.timeline.events} == {
        "0F0": (0, 1), "0F1": (1, 2), "0F2": (2, 3),
        "1F0": (1, 2), "1B0": (2, 7), "1F1": (7, 8), "1I1": (8, 10), "1F2": (10, 11),
        "1W1": (11, 14), "1B2": (14, 19),
        "0I0": (7, 9), "0W0": (9, 12), "0B1": (12, 17), "0B2": (19, 24),
    }
    assert result.makespan == 24
    assert result.timeline.bubble(0) == result.timeline.bubble(1) == 6 / 24
    # Activations go with B, or with the W after I (not with I): stage 1 frees 1B0
    # before 1F1 and still holds micro-batch 1 after 1I1, so 1F2 makes two.
    assert result.peak_inflight == [3, 2]
    assert result.peak_bytes == [3.0, 20.0]


def test_costs_from_a_timeline_read_each_kind() -> None:
    events = [Event(0, 0, "F", 0, 0, 1), Event(0, 0, "B", 0, 1, 6),
              Event(0, 0, "F", 1, 6, 7), Event(0, 0, "B", 1, 7, 14),
              Event(1, 1, "F", 0, 1, 3), Event(1, 1, "I", 0, 3, 5), Event(1, 1, "W", 0, 5, 9),
              Event(1, 1, "F", 1, 9, 11), Event(1, 1, "B", 1, 11, 20, wait=1.0)]
    costs = CostModel.from_timeline(Timeline(2, events), 2)
    # Stage 0 ran full backwards only: all their time is "backward", so a B costs 6 as
    # measured. Stage 1 ran I and W: those give backward and weight; its B costs I + W.
    assert costs.forward == (1.0, 2.0)
    assert costs.backward == (6.0, 2.0)
    assert costs.weight == (0.0, 4.0)


def test_chrome_traces_say_what_each_kind_computes() -> None:
    trace = simulate(parse("0F0 0F1 0B0 0I1 0W1"), CostModel.uniform(1)).timeline.chrome_trace()
    assert {e["name"]: e["args"]["action"] for e in trace["traceEvents"] if e["ph"] == "X"} == {
        "0F0": "forward", "0F1": "forward", "0B0": "backward", "0I1": "input gradient",
        "0W1": "weight gradient"}


def test_communication_delays_every_hop() -> None:
    costs = CostModel.uniform(2, communication=0.25)
    assert simulate(build("gpipe", 2, 1), costs).makespan == pytest.approx(6 + 2 * 0.25)


def test_unequal_stages_make_the_slowest_stage_the_pace() -> None:
    costs = CostModel((1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (1.0, 1.0), (0.0,))
    result = simulate(build("1f1b", 2, 8), costs)
    assert result.makespan == pytest.approx(8 * 6 + 3)  # the slow stage, plus one fill
    breakdown = result.timeline.breakdown()
    assert breakdown[0]["imbalance"] == pytest.approx(24)


def test_a_deadlocking_table_is_reported_with_who_waits_for_whom() -> None:
    table = parse("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")
    with pytest.raises(ScheduleError, match=r"deadlocks at tick 1:\n  rank 0 waits at 0B0 for "
                                            r"1B0 \(rank 1\)\n  rank 1 waits at 1F1 for 0F1"):
        simulate(table, CostModel.uniform(2))


def test_cost_models_round_trip_and_must_fit_the_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    costs = CostModel((1.0, 2.0), (3.0, 4.0), (0.5, 0.5), (8.0, 8.0), (0.1,))
    path = tmp_path / "costs.json"
    import json

    path.write_text(json.dumps(costs.to_dict()))
    assert CostModel.load(path) == costs
    with pytest.raises(ScheduleError, match=r"must give 3 values per stage"):
        simulate(build("gpipe", 3, 2), costs)


@pytest.mark.parametrize(("field", "value"), [("forward", -1.0), ("backward", float("nan")),
                                              ("weight", float("inf")),
                                              ("activation_bytes", -2.0)])
def test_costs_must_be_finite_and_not_negative(field: str, value: float) -> None:
    values = CostModel.uniform(2).to_dict()
    values[field][1] = value
    with pytest.raises(ScheduleError, match=rf"the cost model's {field} of stage 1 is "
                                            rf"{value}; every cost must be a finite number "
                                            r"of at least 0"):
        simulate(build("gpipe", 2, 2), CostModel.from_dict(values))
    values = CostModel.uniform(2).to_dict()
    values["communication"][0] = -1.0
    with pytest.raises(ScheduleError, match=r"communication of boundary 0 is -1.0"):
        simulate(build("gpipe", 2, 2), CostModel.from_dict(values))


def test_timelines_keep_the_cost_models_unit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    abstract = simulate(build("1f1b", 2, 2), CostModel.uniform(2)).timeline
    assert abstract.unit == "units"
    seconds = CostModel((1e-3, 1e-3), (1e-3, 1e-3), (0.0, 0.0), (1.0, 1.0), (0.0,))
    measured = simulate(build("1f1b", 2, 2), seconds).timeline
    assert measured.unit == "s"
    assert CostModel.from_timeline(measured, 2).unit == "s"
    assert CostModel.from_timeline(abstract, 2).unit == "units"
    abstract.save(tmp_path / "t.json")
    assert Timeline.load(tmp_path / "t.json").unit == "units"
    assert Timeline.from_dict({"num_ranks": 1, "events": []}).unit == "s"  # older files


def test_a_cost_model_file_that_cannot_be_read_says_which_and_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "missing.json"
    with pytest.raises(ScheduleError, match=r"cannot read the cost model .*missing.json: "):
        CostModel.load(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"forward": [1.0]')
    with pytest.raises(ScheduleError, match=r"broken.json: .*not JSON"):
        CostModel.load(broken)
    partial = tmp_path / "partial.json"
    partial.write_text('{"forward": [1.0], "backward": [1.0]}')
    with pytest.raises(ScheduleError, match=r"partial.json: .*lacks 'weight', "
                                            r"'activation_bytes', 'communication'"):
        CostModel.load(partial)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"forward": ["fast"], "backward": [1], "weight": [1], '
                     '"activation_bytes": [1], "communication": []}')
    with pytest.raises(ScheduleError, match=r"wrong.json: forward must be a list of numbers"):
        CostModel.load(wrong)


def test_an_edge_is_a_dependency_with_its_own_transfer_time() -> None:
    # Three stages, one micro-batch: a neighbour's message takes 0.5, the edge 0->2 4.
    table = build("gpipe", 3, 1).with_edges([Edge(0, 2)])
    costs = replace(CostModel.uniform(3, communication=0.5), edge_communication=((0, 2, 4.0),))

    def starts(schedule: Schedule, model: CostModel) -> dict[str, float]:
        return {e.label: e.start for e in simulate(schedule, model).timeline.events}

    # 2F0 waits for stage 0's values (1 + 4), not only for stage 1's (2.5 + 0.5); 0B0
    # for the gradient from stage 2 (8 + 4), not only from stage 1 (10.5 + 0.5).
    assert starts(table, costs) == {"0F0": 0.0, "1F0": 1.5, "2F0": 5.0, "2B0": 6.0,
                                    "1B0": 8.5, "0B0": 12.0}
    assert starts(build("gpipe", 3, 1), costs)["2F0"] == 3.0  # no edge: the chain alone
    # An edge without a time of its own costs what its source's activation does.
    assert starts(table, CostModel.uniform(3, communication=0.5))["2F0"] == 3.0
    # Over an edge without gradients, nothing comes back: 0B0 waits for stage 1 alone.
    assert starts(table.with_edges([Edge(0, 2, gradient=False)]), costs)["0B0"] == 11.0


def test_a_simulated_timeline_keeps_the_edges_and_traces_their_messages() -> None:
    table = build("1f1b", 3, 2).with_edges([Edge(0, 2)])
    timeline = simulate(table, CostModel.uniform(3)).timeline
    assert Timeline.from_dict(timeline.to_dict()).edges == timeline.edges == [(0, 2, True)]
    flows = [e for e in timeline.chrome_trace()["traceEvents"] if e.get("cat") == "edge"]
    # Per micro-batch, the values 0 -> 2 and their gradient 2 -> 0: a start and a finish.
    assert [(e["name"], e["ph"], e["pid"]) for e in flows if e["id"] == 0] == [
        ("0->2", "s", 0), ("0->2", "f", 2)]
    assert [(e["name"], e["ph"], e["pid"]) for e in flows if e["id"] == 1] == [
        ("2->0 gradient", "s", 2), ("2->0 gradient", "f", 0)]
    assert len(flows) == 2 * 2 * 2
    sent = next(e for e in timeline.events if e.label == "0F0")
    assert flows[0]["ts"] == pytest.approx(sent.end * 1e6, abs=1e-2)  # as 0F0 ends


def test_edge_times_round_trip_and_must_name_an_edge(tmp_path) -> None:  # type: ignore[no-untyped-def]
    costs = replace(CostModel.uniform(4), edge_communication=((0, 2, 0.5), (1, 3, 2.0)))
    assert CostModel.from_dict(costs.to_dict()) == costs
    assert "edge_communication" not in CostModel.uniform(4).to_dict()
    assert (costs.edge_time(2, 0), costs.edge_time(1, 2), costs.edge_time(0, 3)) == (
        0.5, 0.0, 0.0)
    table = build("gpipe", 4, 2)
    for wrong, problem in [((0, 1, 1.0), "gives a time for edge 0->1, which is not an edge"),
                           ((0, 2, -1.0), "communication of edge 0->2 is -1.0")]:
        with pytest.raises(ScheduleError, match=problem):
            simulate(table, replace(costs, edge_communication=(wrong,)))
    with pytest.raises(ScheduleError, match=r"edge_communication must be a list of \[source, "):
        CostModel.from_dict({**costs.to_dict(), "edge_communication": [[0, 2]]})
