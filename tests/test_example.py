"""The examples run unchanged: train.py on threads and under torchrun, with the same
losses; digits.py learns."""

from __future__ import annotations

import sys

import pytest

from tests.support.extras import require
from tests.support.launch import run_command


def run(command: list[str]) -> list[str]:
    result = run_command(command)
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
    require("sklearn")
    result = run_command([sys.executable, "examples/digits.py", "--epochs", "2"])
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(result.stdout.strip().splitlines()[-1].split()[-1].rstrip("%"))
    assert accuracy > 80, result.stdout  # chance: 10%


@pytest.mark.timeout(300)
def test_the_hugging_face_example_runs_on_threads_and_under_torchrun() -> None:
    require("transformers")
    script = ["examples/huggingface.py", "--model", "llama", "--layers", "2", "--steps", "2"]
    threads = run([sys.executable, *script])
    processes = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", *script])
    assert len(threads) == 2 and threads == processes
