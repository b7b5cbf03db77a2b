"""Never hang, always explain, across processes: each case ends within the timeout plus
a few seconds, every surviving rank exits non-zero, and its error carries the report of
where every rank stood (gathered from the others), naming the right rank, action and
awaited message. The scenarios are in tests/support/scenarios/hang.py (fitted timeouts
with a 3 s floor; steps 1 and 2 warm up)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch import Outcome, launch
from tests.support.scenarios.hang import FLOOR

# After the timeout: asking a silent peer whether it has reached the step (1.5 s), a
# settle of the posted receives (at most 3 s here) and the gather of the others' places
# (1.5 s for a silent rank); then a margin for a busy machine.
WITHIN = FLOOR + 1.5 + 3.0 + 1.5 + 5.0


def steps_of(tmp_path: Path, rank: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads((tmp_path / f"rank{rank}.json").read_text())
    return found


def lines_of(report: str) -> dict[int, str]:
    """The report's line of each rank."""
    return {int(line.split()[1]): line for line in report.splitlines()
            if line.startswith("  rank ")}


def assert_exits(outcome: Outcome, survivors: list[int]) -> None:
    for rank in survivors:
        assert outcome.returncodes[rank] == 1, (rank, outcome.returncodes,
                                                outcome.outputs[rank][-3000:])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_a_raise_and_a_shape_change_are_reported_and_the_next_steps_are_right(
        tmp_path: Path, world: int) -> None:
    outcome = launch("hang_recover", world, tmp_path, timeout=240)
    assert_exits(outcome, list(range(world)))  # each raises step 4's error at the end
    last = world - 1
    for rank in range(world):
        steps = steps_of(tmp_path, rank)
        assert len(steps) == 5
        for good in (0, 2, 4):  # after a failed step the pipeline goes on, right
            assert steps[good]["loss"] == pytest.approx(steps[good]["plain"], rel=1e-12)
            assert steps[good]["gradient_error"] < 1e-10, (rank, good, steps[good])
        raised, narrowed = steps[1], steps[3]
        assert f"stage {last}, layer {3 * last + 2} (Trap) failed on micro-batch 2: " \
               "ValueError: planted failure" in raised["error"], raised["error"]
        lines = lines_of(raised["where"])
        assert set(lines) == set(range(world)), raised["where"]  # every rank answered
        assert f"failed in {last}F2" in lines[last] and "<- failed here" in lines[last]
        assert "step 2 of '1f1b'" in raised["where"] and f">{last}F2" in raised["where"]
        assert "stage 1, layer 3 (Linear) failed on micro-batch 0: RuntimeError: mat1 and " \
               "mat2 shapes cannot be multiplied" in narrowed["error"], narrowed["error"]
        lines = lines_of(narrowed["where"])
        assert "finished nothing yet; failed in 1F0" in lines[1] and "failed here" in lines[1]
        assert re.search(r"stopped (in 0B0 after waiting [\d.]+ s for the gradient of "
                         r"micro-batch 0 from stage 1 \(rank 1\)|before its next action)",
                         lines[0]), lines[0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("scenario", "world", "frozen"), [("hang_freeze_middle", 3, 1)])
def test_a_frozen_rank_is_named_by_every_survivor_in_time(
        tmp_path: Path, scenario: str, world: int, frozen: int) -> None:
    outcome = launch(scenario, world, tmp_path, timeout=150)
    survivors = [r for r in range(world) if r != frozen]
    assert_exits(outcome, survivors)
    for rank in survivors:
        failed = steps_of(tmp_path, rank)[2]  # step 3: the frozen rank's 1F1
        assert failed["seconds"] < WITHIN, failed
        lines = lines_of(failed["where"])
        assert lines[frozen].endswith(
            "no answer  <- did not answer: frozen, dead, or stuck outside Python"), lines
        assert "timed out after 3 s waiting for" in failed["error"] or \
               f"rank {frozen} failed (no answer within 3 s)" in failed["error"], failed
    # It froze in 1F1: the last stage after 1B0, a middle one before its first backward.
    # (A frozen last rank of two: test_a_rank_frozen_in_the_tied_weights_all_reduce...)
    awaited = 1 if frozen == world - 1 else 0
    before = lines_of(steps_of(tmp_path, frozen - 1)[2]["where"])[frozen - 1]
    assert f"for the gradient of micro-batch {awaited} from stage {frozen} " \
           f"(rank {frozen})" in before, before
    if frozen + 1 < world:
        after = lines_of(steps_of(tmp_path, frozen + 1)[2]["where"])[frozen + 1]
        assert f"for the activation of micro-batch 1 from stage {frozen} " \
               f"(rank {frozen})" in after, after


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("scenario", "world"), [("hang_kill_last", 2), ("hang_kill_middle", 3)])
def test_a_killed_rank_is_named_as_dead(tmp_path: Path, scenario: str, world: int) -> None:
    outcome = launch(scenario, world, tmp_path, timeout=150)
    assert outcome.returncodes[1] == -9
    survivors = [r for r in range(world) if r != 1]
    assert_exits(outcome, survivors)
    for rank in survivors:
        failed = steps_of(tmp_path, rank)[2]
        assert failed["seconds"] < WITHIN, failed
        lines = lines_of(failed["where"])
        assert lines[1].endswith("no answer  <- its connection closed: the process died"), \
            lines


@pytest.mark.timeout(200)
def test_a_rank_stuck_in_a_loop_answers_where_it_is(tmp_path: Path) -> None:
    outcome = launch("hang_loop", 2, tmp_path, timeout=150)
    assert_exits(outcome, [0, 1])  # rank 1 ends its loop once rank 0 is done, and stops
    failed = steps_of(tmp_path, 0)[2]
    assert failed["seconds"] < WITHIN, failed
    assert "rank 0 timed out after 3 s waiting for the gradient of micro-batch 1 from " \
           "stage 1 (rank 1)" in failed["error"]
    lines = lines_of(failed["where"])
    assert "finished 1B0; in 1F1, computing for" in lines[1] and "<- stuck" in lines[1], lines
    assert ">1F1" in failed["where"]


@pytest.mark.timeout(200)
def test_a_rank_frozen_in_the_tied_weights_all_reduce_is_reported_like_a_receive(
        tmp_path: Path) -> None:
    outcome = launch("hang_freeze_in_tie", 2, tmp_path, timeout=150)
    assert_exits(outcome, [0])
    failed = steps_of(tmp_path, 0)[2]
    assert failed["type"] == "PeerFailure", failed
    assert failed["error"].startswith(
        "rank 0 waited 3 s in the all-reduce of the tied weights' gradients: a rank of it "
        "failed, froze or never came to it"), failed["error"]
    assert failed["seconds"] < WITHIN, failed
    lines = lines_of(failed["where"])
    assert "done with its actions; stopped in the all-reduce of the tied weights' " \
           "gradients after 3." in lines[0], lines[0]
    assert lines[1].endswith("no answer  <- did not answer: frozen, dead, or stuck outside "
                             "Python"), lines[1]
