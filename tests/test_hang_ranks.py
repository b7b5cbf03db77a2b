"""Never hang, always explain, across processes: a raise and a shape change are reported
by every rank with the report of where every rank stood (gathered from the others), and
the next steps run right. The scenarios are in tests/support/scenarios/hang.py (fitted
timeouts with a 3 s floor; steps 1 and 2 warm up). Frozen, killed, looping and exiting
ranks under every launcher are generated cases: tests/test_faults.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch import Outcome, launch


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
        assert f"stage {last}, layer {3 * last + 2} (Trap) failed on micro-batch 2 ({last}F2): " \
               "ValueError: planted failure" in raised["error"], raised["error"]
        lines = lines_of(raised["where"])
        assert set(lines) == set(range(world)), raised["where"]  # every rank answered
        assert f"failed in {last}F2" in lines[last] and "<- failed here" in lines[last]
        assert "step 2 of '1f1b'" in raised["where"] and f">{last}F2" in raised["where"]
        assert "stage 1, layer 3 (Linear) failed on micro-batch 0 (1F0): RuntimeError: mat1 and " \
               "mat2 shapes cannot be multiplied" in narrowed["error"], narrowed["error"]
        lines = lines_of(narrowed["where"])
        assert "finished nothing yet; failed in 1F0" in lines[1] and "failed here" in lines[1]
        assert re.search(r"stopped (in 0B0 after waiting [\d.]+ s for the gradient of "
                         r"micro-batch 0 from stage 1 \(rank 1\)|before its next action)",
                         lines[0]), lines[0]


@pytest.mark.timeout(200)
def test_a_slow_rank_is_waited_for_as_long_as_it_makes_progress(tmp_path: Path) -> None:
    # Rank 0 waits ~4 s for its first gradient, against a 2 s timeout: before, it gave
    # the last rank up as stuck (a wait's length), though it was computing all along.
    outcome = launch("slow_rank", 2, tmp_path, timeout=150, launcher="env")
    assert outcome.returncodes == [0, 0], "\n".join(o[-2000:] for o in outcome.outputs)
    losses = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
