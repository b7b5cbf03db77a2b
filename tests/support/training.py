"""``conveyor train`` in a test: a tiny run's flags, the command on them, its checkpoint,
and the one line it prints for bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.cli import main
from conveyor.train.checkpoints import manifest

# T(2, 32, 2), width 16, on 4 sequences of 16 bytes: a step takes milliseconds. No
# warm-up: the full learning rate from the first step, so that a few steps learn.
TINY = ["--layers", "2", "--width", "16", "--hidden", "32", "--heads", "2", "--length", "16",
        "--batch", "4", "--chunks", "2", "--eval-every", "3", "--eval-batches", "1",
        "--save-every", "3", "--sample-bytes", "4", "--warmup", "1"]


def train(out: Path, *flags: str) -> int:
    return main(["train", *TINY, "--out", str(out), *flags])


def latest_checkpoint(out: Path) -> Path:
    """The directory of the newest checkpoint in ``out``."""
    return out / "checkpoint" / (out / "checkpoint" / "latest").read_text().strip()


def checkpoint_state(out: Path) -> dict[str, Any]:
    """The newest one-process checkpoint in ``out``: its weights, its optimizer's tensors
    by parameter name, and its ``extra`` (the step, the history, the random state)."""
    target = latest_checkpoint(out)
    found = manifest.read(target)
    tensors = torch.load(target / "state.pt", weights_only=True)
    return {"model": tensors["model"], "optimizer": tensors["optimizer"],
            "extra": manifest.from_json(found["meta"])["extra"]}


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The single line ``conveyor train`` wrote to stderr, an error."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("conveyor train: error: ")
    return err[0]
