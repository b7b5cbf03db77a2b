"""The benchmark scripts' own logic, and that they start (not their timings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture()
def pipeline1(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import pipeline1_gpu

    return pipeline1_gpu


@pytest.mark.parametrize("largest", [0, 1, 2, 3, 7, 8, 9, 100, 4096])
def test_search_finds_the_largest_fitting_size(pipeline1, largest: int) -> None:  # type: ignore[no-untyped-def]
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= largest

    assert pipeline1.largest_fitting(fits) == largest
    assert len(tried) <= 2 * 13  # doubling then bisection: logarithmic


def test_pipeline1_script_runs_a_step_of_each_kind() -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "pipeline1_gpu.py"), "--smoke"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "naive and Pipeline-1 steps ran" in result.stdout
