"""Schedules are tables: literal text, one validator, a clock picture."""

from __future__ import annotations

import pytest

from conveyor.errors import ScheduleError
from conveyor.schedules import (
    Action,
    Edge,
    Kind,
    build,
    dependencies,
    gpipe,
    interleaved_1f1b,
    layout_clock,
    one_f_one_b,
    parse,
    render_clock,
    validate,
    zero_bubble_h1,
)


def test_gpipe_table_is_fill_drain() -> None:
    assert gpipe(3, 4).to_text() == (
        "0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0\n"
        "1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0\n"
        "2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0"
    )
    assert gpipe(1, 1).to_text() == "0F0 0B0"


def test_gpipe_clock_is_the_paper_picture() -> None:
    assert render_clock(layout_clock(gpipe(3, 2))) == (
        "        0   1   2   3   4   5   6   7\n"
        "rank 0  0F0 0F1 .   .   .   .   0B1 0B0\n"
        "rank 1  .   1F0 1F1 .   .   1B1 1B0 .\n"
        "rank 2  .   .   2F0 2F1 2B1 2B0 .   ."
    )


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 16, 32])
def test_gpipe_tables_are_valid_and_take_the_bubble_bound(stages: int, microbatches: int) -> None:
    schedule = gpipe(stages, microbatches)
    validate(schedule)
    # Unit-time clock: forward and backward each fill M + K - 1 ticks.
    assert len(layout_clock(schedule)[0]) == 2 * (microbatches + stages - 1)


def test_text_round_trips() -> None:
    table = gpipe(4, 3)
    assert parse(table.to_text(), name="gpipe") == table
    assert str(parse("0F0 0B0\n-")) == "0F0 0B0\n-"
    split = zero_bubble_h1(3, 4)
    assert parse(split.to_text(), name="zero-bubble") == split


def test_input_gradient_has_its_own_kind() -> None:
    table = parse("0F0 0F1 0I0 0B1 0W0")
    assert table.columns[0][2] == Action(0, Kind.INPUT, 0)
    assert table.columns[0][3] == Action(0, Kind.BACKWARD, 1)
    assert str(table) == "0F0 0F1 0I0 0B1 0W0"
    assert str(Action(3, Kind.INPUT, 11)) == "3I11"


def test_actions_print_compactly_and_order_by_stage() -> None:
    assert str(Action(12, Kind.WEIGHT, 3)) == "12W3"
    assert dependencies(Action(1, Kind.BACKWARD, 2), gpipe(3, 3)) == (
        Action(1, Kind.FORWARD, 2), Action(2, Kind.BACKWARD, 2))
    assert dependencies(Action(0, Kind.FORWARD, 0), gpipe(3, 3)) == ()


def test_a_backward_waits_for_whichever_backward_the_next_stage_runs() -> None:
    # Micro-batch 0 is split on stage 1 and full on stage 0; micro-batch 1 the other way.
    table = parse("0F0 0F1 0B0 0I1 0W1\n"
                  "1F0 1F1 1I0 1B1 1W0")
    assert dependencies(Action(0, Kind.BACKWARD, 0), table) == (
        Action(0, Kind.FORWARD, 0), Action(1, Kind.INPUT, 0))
    assert dependencies(Action(0, Kind.INPUT, 1), table) == (
        Action(0, Kind.FORWARD, 1), Action(1, Kind.BACKWARD, 1))
    assert dependencies(Action(1, Kind.WEIGHT, 0), table) == (Action(1, Kind.INPUT, 0),)
    validate(table)
    assert render_clock(layout_clock(table)) == (
        "        0   1   2   3   4   5   6\n"
        "rank 0  0F0 0F1 .   .   0B0 0I1 0W1\n"
        "rank 1  .   1F0 1F1 1I0 1B1 1W0 ."
    )


def test_stage_ranks_follow_the_table() -> None:
    table = parse("0F0 2F0 2B0 0B0\n1F0 1B0")
    assert table.stage_ranks == (0, 1, 0)
    assert table.stages_of(0) == (0, 2)
    validate(table)


def test_duplicate_action_is_shown_in_the_table() -> None:
    with pytest.raises(ScheduleError) as caught:
        validate(parse("0F0 0F1 0B1 0B0\n1F0 1F1 1F1 1B1 1B0"))
    assert str(caught.value) == (
        "schedule 'custom', rank 1, step 2: 1F1 appears twice (first at rank 1, step 1)\n"
        "  rank 0: 0F0 0F1 0B1 0B0\n"
        "  rank 1: 1F0 1F1 [1F1] 1B1 1B0"
    )


def test_missing_actions_are_listed() -> None:
    with pytest.raises(ScheduleError, match=r"incomplete: 1 actions missing \(1B0\)"):
        validate(parse("0F0 0B0 0F1 0B1\n1F0 1F1 1B1"))


def test_backward_before_forward_on_a_rank() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0, step 0: 0B0 comes before 0F0 on its own "
                                            r"rank\n  rank 0: \[0B0\] 0F0"):
        validate(parse("0B0 0F0"))


def test_stage_split_over_two_ranks() -> None:
    with pytest.raises(ScheduleError, match=r"stage 0 runs on rank 0 and rank 1"):
        validate(parse("0F0 0B0\n0F1 0B1"))


def test_deadlock_shows_the_clock_and_who_waits_for_whom() -> None:
    with pytest.raises(ScheduleError) as caught:
        validate(parse("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1"))
    assert str(caught.value) == (
        "schedule 'custom' deadlocks at tick 1:\n"
        "  rank 0 waits at 0B0 for 1B0 (rank 1)\n"
        "  rank 1 waits at 1F1 for 0F1 (rank 0)\n"
        "        0    1\n"
        "rank 0  0F0  >0B0\n"
        "rank 1  .    >1F1"
    )


def test_an_input_gradient_needs_its_weight_gradient() -> None:
    with pytest.raises(ScheduleError) as caught:
        validate(parse("0F0 0F1 0I0 0W0 0I1"))
    assert str(caught.value) == (
        "schedule 'custom', rank 0, step 4: 0I1 computes only the input gradient and no "
        "0W1 follows with the weight gradient: add 0W1 after it, or write 0B1 (full "
        "backward) instead\n"
        "  rank 0: 0F0 0F1 0I0 0W0 [0I1]"
    )
    validate(parse("0F0 0F1 0I0 0W0 0I1 0W1"))


def test_a_weight_gradient_needs_its_input_gradient() -> None:
    with pytest.raises(ScheduleError) as caught:
        validate(parse("0F0 0W0"))
    assert str(caught.value) == (
        "schedule 'custom', rank 0, step 1: 0W0 has no 0I0 to take the weight gradient "
        "from; add 0I0 before it, or write 0B0 (full backward) instead\n"
        "  rank 0: 0F0 [0W0]"
    )
    # B already computes the weight gradient: a W beside it is no longer read as "B's".
    with pytest.raises(ScheduleError, match=r"rank 0, step 2: 0W0 has no 0I0 to take the "
                                            r"weight gradient from; 0B0 already computes "
                                            r"the weight gradient: drop 0W0, or split 0B0 "
                                            r"into 0I0 and 0W0\n  rank 0: 0F0 0B0 \[0W0\]"):
        validate(parse("0F0 0B0 0W0"))


def test_a_weight_gradient_before_its_input_gradient() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0, step 1: 0W0 comes before 0I0 on its "
                                            r"own rank\n  rank 0: 0F0 \[0W0\] 0I0"):
        validate(parse("0F0 0W0 0I0"))


def test_full_and_split_backward_of_one_microbatch() -> None:
    with pytest.raises(ScheduleError) as caught:
        validate(parse("0F0 0F1 0B1 0B0\n1F0 1F1 1B1 1I0 1W0 1B0"))
    assert str(caught.value) == (
        "schedule 'custom', rank 1, step 5: 1B0 and 1I0 both run the backward of stage 1, "
        "micro-batch 0: keep 1B0 (full backward) or 1I0 followed by 1W0 (split backward), "
        "not both\n"
        "  rank 0: 0F0 0F1 0B1 0B0\n"
        "  rank 1: 1F0 1F1 1B1 1I0 1W0 [1B0]"
    )
    with pytest.raises(ScheduleError, match=r"step 3: 0I0 and 0B0 both run the backward of "
                                            r"stage 0, micro-batch 0"):
        validate(parse("0F0 0B0 0W0 0I0"))


@pytest.mark.parametrize(
    ("text", "message"),
    [("0F0 0X1", r"rank 0: '0X1' is not an action"),
     ("", r"at least one action"),
     ("0F0 0B0 0F2 0B2", r"incomplete: 2 actions missing \(0F1 0B1\)")],
)
def test_malformed_tables(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(parse(text))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_sizes_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ScheduleError, match=r"must be a positive integer"):
        gpipe(bad, 2)  # type: ignore[arg-type]




def test_1f1b_table() -> None:
    assert one_f_one_b(3, 4).to_text() == (
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )
    assert one_f_one_b(3, 1).to_text() == "0F0 0B0\n1F0 1B0\n2F0 2B0"


def test_interleaved_table_puts_stage_s_on_rank_s_mod_k() -> None:
    table = interleaved_1f1b(2, 4, virtual_stages=2)
    assert table.to_text() == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
    assert table.stage_ranks == (0, 1, 0, 1)
    assert table.num_stages == 4


def test_zero_bubble_table_defers_weight_gradients_by_the_stage_index() -> None:
    assert zero_bubble_h1(3, 4).to_text() == (
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3\n"
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3\n"
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"
    )


def _peak_in_flight(column: tuple[Action, ...]) -> int:
    """Micro-batches held from F to B, or from F to the W after I."""
    held = peak = 0
    for action in column:
        if action.kind is Kind.FORWARD:
            held += 1
        elif action.kind in (Kind.BACKWARD, Kind.WEIGHT):
            held -= 1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("microbatches", range(1, 33))
def test_every_generated_table_is_valid(stages: int, microbatches: int) -> None:
    for name in ("gpipe", "1f1b", "zero-bubble"):
        validate(build(name, stages, microbatches))
    for virtual in (1, 2, 3, 4):
        if virtual == 1 or microbatches % stages == 0:
            validate(build("interleaved-1f1b", stages, microbatches, virtual_stages=virtual))
    # Memory: GPipe holds M micro-batches, 1F1B at most K - k, ZB-H1 at most K (1F1B's peak).
    for k, column in enumerate(build("1f1b", stages, microbatches).columns):
        assert _peak_in_flight(column) == min(stages - k, microbatches)
    zero_bubble = build("zero-bubble", stages, microbatches)
    assert max(_peak_in_flight(c) for c in zero_bubble.columns) == min(
        stages, microbatches)


def test_schedule_names_and_their_errors() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule 'pipedream'; choose one of "
                                            r"'gpipe', '1f1b', 'interleaved-1f1b', "
                                            r"'zero-bubble'"):
        build("pipedream", 2, 4)
    with pytest.raises(ScheduleError, match=r"needs a multiple of 4 micro-batches \(one group "
                                            r"per rank\); got 6: use chunks=4 or 8"):
        build("interleaved-1f1b", 4, 6, virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"'1f1b' has one stage per rank; virtual_stages=2 "
                                            r"needs 'interleaved-1f1b'"):
        build("1f1b", 2, 4, virtual_stages=2)


# ---------------------------------------------------------------- edges

FOUR = "0F0 0B0\n1F0 1B0\n2F0 2B0\n3F0 3B0"


def test_edges_are_part_of_the_table_and_of_its_text() -> None:
    table = parse(FOUR + "\nedges: 0~>3 0->2")
    assert table.edges == (Edge(0, 2), Edge(0, 3, gradient=False))  # kept in order
    assert table.to_text() == FOUR + "\nedges: 0->2 0~>3"
    assert parse(table.to_text()) == table
    assert gpipe(4, 1).with_edges(reversed(table.edges)).edges == table.edges
    with pytest.raises(ScheduleError, match=r"edges: '0=>2' is not an edge; write 0->2 "):
        parse(FOUR + "\nedges: 0=>2")


def test_what_an_action_sends_and_waits_for_follows_the_edges() -> None:
    table = gpipe(4, 2).with_edges([Edge(1, 3), Edge(0, 2), Edge(0, 3, gradient=False)])

    def sends(text: str) -> list[str]:
        return [f"{m.kind[0]} {m.source}->{m.destination} #{m.microbatch}"
                for m in table.messages(parse(text).columns[0][0])]

    assert sends("0F1") == ["a 0->1 #1", "a 0->2 #1", "a 0->3 #1"]
    assert sends("3B0") == ["g 3->2 #0", "g 3->1 #0"]  # none to 0: 0~>3 has no gradient
    assert sends("2I0") == ["g 2->1 #0", "g 2->0 #0"]  # I sends what B would
    assert sends("2W0") == sends("3F0") == []
    assert str(table.messages(Action(2, Kind.BACKWARD, 1))[1]) == (
        "gradient of micro-batch 1 from stage 2 to stage 0")
    forward, backward = Kind.FORWARD, Kind.BACKWARD
    assert dependencies(Action(3, forward, 1), table) == (
        Action(2, forward, 1), Action(0, forward, 1), Action(1, forward, 1))
    assert dependencies(Action(0, backward, 1), table) == (
        Action(0, forward, 1), Action(1, backward, 1), Action(2, backward, 1))


@pytest.mark.parametrize(("name", "virtual"), [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1),
                                               ("interleaved-1f1b", 2)])
def test_every_built_in_schedule_stays_valid_with_any_edges(name: str, virtual: int) -> None:
    for ranks in (3, 4, 5):
        table = build(name, ranks, 2 * ranks, virtual_stages=virtual)
        stages = table.num_stages
        edges = [Edge(i, j, gradient=(i + j) % 2 == 0)
                 for i in range(stages) for j in range(i + 2, stages)]
        with_edges = table.with_edges(edges)
        validate(with_edges)
        # An edge's order follows from the neighbours' already: the same clock.
        assert layout_clock(with_edges) == layout_clock(table)


@pytest.mark.parametrize(("edges", "problem"), [
    ("0->1", "edge 0->1 must go from a stage to a later one past the next"),
    ("2->0", "edge 2->0 must go from a stage to a later one past the next"),
    ("0->5", "edge 0->5 names a stage outside the table's 4 stages"),
    ("0~>2 0->2", "edge 0->2 is listed twice"),
])
def test_an_edge_must_join_a_stage_to_one_past_the_next(edges: str, problem: str) -> None:
    with pytest.raises(ScheduleError, match=rf"schedule 'custom': {problem}.*\n  rank 0: "
                                            rf"0F0 0B0\n(.*\n)*  edges: "):
        validate(parse(f"{FOUR}\nedges: {edges}"))


def test_a_table_that_runs_an_edges_destination_first_names_the_edge() -> None:
    # Stages 0 and 2 on rank 0 (interleaved): stage 2 uses stage 0's values.
    with pytest.raises(ScheduleError, match=r"rank 0, step 0: 2F0 comes before 0F0 on its "
                                            r"own rank \(edge 0->2\)\n  rank 0: \[2F0\] 0F0"):
        validate(parse("2F0 0F0 0B0 2B0\n1F0 1B0\nedges: 0->2"))
    # Across ranks, the deadlock says which wait is over the edge.
    with pytest.raises(ScheduleError, match=r"rank 0 waits at 0B0 for 1B0 \(rank 1\), 2B0 "
                                            r"\(rank 2, over edge 0->2\)\n(.*\n)*  rank 2 "
                                            r"waits at 2F1 for 1F1 \(rank 1\), 0F1 \(rank 0, "
                                            r"over edge 0->2\)"):
        validate(parse("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1\n2F0 2F1 2B0 2B1\nedges: 0->2"))
