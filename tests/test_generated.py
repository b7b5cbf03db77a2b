"""Generated models against the plain model (tests/generated): a fixed sample in CI.

``make fuzz`` runs thousands of seeds (see the README); a failure here prints the line
that reruns its case, and ``python -m tests.generated --seed N`` shrinks it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.generated.cases import draw_case, draw_cases
from tests.generated.running import run_cases
from tests.generated.shrink import shrink
from tests.support.launch import launch

#: The CI sample: 40 seeds on threads, each a model and four ways to run it.
THREAD_SEEDS = range(40)
#: Seeds run compiled (``compile=True``; a first compile takes seconds): the CI sample of
#: ``make fuzz-compile`` (seed 1: four cases, 14 s with inductor's cache cold).
COMPILED_SEEDS = [1]
#: Seeds run again on two processes, two cases each, as two ranks.
PROCESS_SEEDS = [1000 + i for i in range(5)]


@pytest.mark.parametrize("seed", THREAD_SEEDS)
def test_generated_cases_match_the_plain_model(seed: int) -> None:
    cases = draw_cases(seed)
    failed = [f"{case}\n  {result}" for case, result in zip(cases, run_cases(cases))
              if not result.ok]
    assert not failed, ("\n".join(failed) + "\nreproduce (and shrink): "
                        f"python -m tests.generated --seed {seed}")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("seed", COMPILED_SEEDS)
def test_generated_cases_compiled_match_the_plain_model(seed: int) -> None:
    cases = draw_cases(seed, compiled=True)
    failed = [f"{case}\n  {result}" for case, result in zip(cases, run_cases(cases))
              if not result.ok]
    assert not failed, ("\n".join(failed) + "\nreproduce (and shrink): "
                        f"python -m tests.generated --seed {seed} --compile")


def test_generated_cases_on_two_processes(tmp_path: Path) -> None:
    (tmp_path / "seeds.json").write_text(json.dumps(PROCESS_SEEDS))
    outcome = launch("generated", 2, tmp_path, timeout=300)
    assert outcome.returncodes == [0, 0], "\n".join(o[-3000:] for o in outcome.outputs)
    for rank in range(2):
        results = json.loads((tmp_path / f"generated{rank}.json").read_text())
        assert sorted(results) == sorted(f"{s}.{v}" for s in PROCESS_SEEDS for v in (0, 1))
        failed = {seed: r for seed, r in results.items() if not r["ok"]}
        assert not failed, f"rank {rank}: {failed}"


def test_cases_found_on_processes(tmp_path: Path) -> None:
    from tests.generated.cases import FOUND_ON_PROCESSES
    from tests.generated.running import run_case

    assert all(run_case(case).ok for case in FOUND_ON_PROCESSES)  # on threads: exact
    outcome = launch("generated_found", 2, tmp_path, timeout=300)
    assert outcome.returncodes == [0, 0], "\n".join(o[-3000:] for o in outcome.outputs)
    for rank in range(2):
        results = json.loads((tmp_path / f"found{rank}.json").read_text())
        assert all(text.startswith("error") and float(text.split()[1]) <= 1e-10
                   for text in results.values()), f"rank {rank}: {results}"


def test_the_shrinker_finds_a_smaller_failing_case() -> None:
    """A planted failure (any model whose blocks include a layer norm "fails") shrinks
    to a case with that block alone, one stage and one micro-batch."""
    case = next(c for c in map(draw_case, range(100))
                if "layernorm" in c.spec.blocks and len(c.spec.blocks) >= 4 and c.chunks > 2)

    def planted(candidate):  # type: ignore[no-untyped-def]
        from tests.generated.cases import Result
        failing = "layernorm" in candidate.spec.blocks
        return Result(1.0 if failing else 0.0, "planted")

    smallest, failure = shrink(case, planted(case), run=planted)
    assert failure.error == 1.0
    assert smallest.spec.blocks == ("layernorm",)
    assert smallest.chunks < case.chunks and not smallest.train
