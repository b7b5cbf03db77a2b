"""Faults of whole ``conveyor train`` runs (tests/runs), a fixed sample: what a fault
leaves on disk, and that the run goes on from there to the state of a run without it.
``make chaos`` runs every case (the count and time are in the README)."""

from __future__ import annotations

import pytest

from tests.runs import FAULTS, LAUNCHERS, Case, check, every_case
from tests.support.launch import problems_two_at_a_time
from tests.support.tiers import whole_suite

#: What the issue reported, then one case of each other fault; two launches of a run
#: without a fault (one process, tied; env://, tied) are the references.
SAMPLE = [Case("torchrun", True, "freeze", 3, 0, "tie"),  # frozen in the tie all-reduce
          Case("one", True, "nan", 3, 1),
          Case("one", True, "disk_full", 4, 0),
          Case("env", True, "kill", 3, 1),
          Case("env", True, "options", 1, 1, "seed"),
          Case("torchrun", False, "bitflip", 4, 1),
          # issue 49: an empty pointer, a silent store, a refusal before the group
          Case("one", True, "pointer", 4, 0, "empty"),
          Case("env", True, "silent", 0, 1),
          Case("torchrun", True, "refusal", 0, 1)]


#: What ``make test`` (CI) launches: the data loss the issue found (an empty pointer) and
#: a refusal before the process group under torchrun; ``make test-all`` the whole sample.
QUICK = [SAMPLE[6], SAMPLE[8]]


@pytest.fixture(scope="module")
def problems(tmp_path_factory: pytest.TempPathFactory) -> dict[Case, list[str]]:
    """Each kind of reference run is launched once and shared by the cases (tests.runs
    ``reference``)."""
    cases = SAMPLE if whole_suite() else QUICK
    return problems_two_at_a_time(check, cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.timeout(800)  # the first one waits for every case
@pytest.mark.parametrize("case", [case if case in QUICK else pytest.param(
    case, marks=pytest.mark.long) for case in SAMPLE], ids=str)
def test_a_faulty_run_leaves_good_data_and_resumes_to_the_same_state(
        case: Case, problems: dict[Case, list[str]]) -> None:
    assert not problems[case], "\n".join(problems[case])


def test_the_cases_cover_every_launcher_and_fault() -> None:
    cases = every_case()
    assert {c.launcher for c in cases} == set(LAUNCHERS)
    assert {c.fault for c in cases} == set(FAULTS)
    assert {c.launcher for c in SAMPLE} == set(LAUNCHERS)
