"""Faults of whole ``conveyor train`` runs (tests/runs), a fixed sample: what a fault
leaves on disk, and that the run goes on from there to the state of a run without it.
``make chaos`` runs every case (the count and time are in the README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runs import FAULTS, LAUNCHERS, Case, check, every_case

#: What the issue reported, then one case of each other fault; two launches of a run
#: without a fault (one process, tied; env://, tied) are the references.
SAMPLE = [Case("torchrun", True, "freeze", 3, 0, "tie"),  # frozen in the tie all-reduce
          Case("one", True, "nan", 3, 1),
          Case("one", True, "disk_full", 4, 0),
          Case("env", True, "kill", 3, 1),
          Case("env", True, "options", 1, 1, "seed"),
          Case("torchrun", False, "bitflip", 4, 1)]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")  # the references are shared by the cases


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", SAMPLE, ids=str)
def test_a_faulty_run_leaves_good_data_and_resumes_to_the_same_state(
        case: Case, scratch: Path) -> None:
    found, _ = check(case, scratch)
    assert not found, "\n".join(found)


def test_the_cases_cover_every_launcher_and_fault() -> None:
    cases = every_case()
    assert {c.launcher for c in cases} == set(LAUNCHERS)
    assert {c.fault for c in cases} == set(FAULTS)
    assert {c.launcher for c in SAMPLE} == set(LAUNCHERS)
