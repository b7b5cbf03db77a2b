"""examples/train.py runs unchanged on threads and under torchrun, with the same losses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(command: list[str]) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("step")]


@pytest.mark.timeout(300)
def test_threads_and_torchrun_print_the_same_losses() -> None:
    script = ["examples/train.py", "--steps", "3"]
    threads = run([sys.executable, *script])
    processes = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", *script])
    assert len(threads) == 2 and threads == processes


@pytest.mark.timeout(300)
def test_the_digits_example_learns() -> None:
    pytest.importorskip("sklearn")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "examples/digits.py", "--epochs", "2"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(result.stdout.strip().splitlines()[-1].split()[-1].rstrip("%"))
    assert accuracy > 80, result.stdout  # chance: 10%
