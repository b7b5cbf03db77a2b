"""One process of a run-level fault case: ``python -m tests.runs.worker OUT PHASE``.

Reads the case from CONVEYOR_RUN_CASE; in the "first" phase plants its fault, in
"again" resumes the run if it has a checkpoint (else starts it) with nothing planted.
Runs ``conveyor train`` into OUT/run; writes what it printed on stderr to
``rank<r>.err`` and, at its end, ``rank<r>.json`` (exit code, time).
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.cli import main
from conveyor.distributed.faults import collective
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.pipeline import Pipeline
from conveyor.train.user import model as built_model
from conveyor.train.checkpoints import dcpfiles
from tests.runs import READ_ONLY, TIMEOUT


class _Tee:
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


class Plant:
    """The case's fault, fired once in its step on its rank (one process: its stage)."""

    def __init__(self, case: dict[str, Any], rank: int, out: Path) -> None:
        self.case, self.rank, self.out = case, rank, out
        self.step = 0
        self.one = case["launcher"] == "one"

    def due(self, stage: int | None = None) -> bool:
        here = self.rank if stage is None else stage
        return self.step == self.case["step"] and here == self.case["rank"]

    def note(self) -> None:
        (self.out / "fault.json").write_text(json.dumps({"time": time.time(),
                                                         "pid": os.getpid()}))


class Poison(nn.Module):
    """NaN in its stage's activations in the fault's step; or slow (``slow``)."""

    def __init__(self, plant: Plant, stage: int) -> None:
        super().__init__()
        self.plant, self.stage = plant, stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plant, fault = self.plant, self.plant.case["fault"]
        if fault == "nan" and plant.due(self.stage):
            plant.note()
            return x * math.nan
        if fault == "slow" and plant.step >= plant.case["step"] and \
                self.stage == plant.case["rank"]:
            time.sleep(1.2)
        if fault == "freeze" and plant.one and plant.due(self.stage):
            plant.note()  # one process: a stage that never returns
            while not (plant.out / "ended").exists():
                time.sleep(0.05)
        return x


def with_poisons(chosen: Plant) -> None:
    """``conveyor train``'s model with a Poison layer after its embedding and one before
    its head (in every phase: a checkpoint has the same names)."""
    build = built_model.transformer_lm

    def poisoned(*args: Any, **kwargs: Any) -> nn.Sequential:
        model = build(*args, **kwargs)
        return nn.Sequential(model[0], Poison(chosen, 0), *model[1:-1], Poison(chosen, 1),
                             model[-1])

    built_model.transformer_lm = poisoned  # type: ignore[assignment]


def plant(case: dict[str, Any], rank: int, out: Path, flags: list[str]) -> None:
    """Plants the case's fault in this process (before ``conveyor train`` runs)."""
    fault = case["fault"]
    chosen = Plant(case, rank, out)
    with_poisons(chosen)
    stepping = Pipeline.step

    def step(self: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        chosen.step += 1
        if chosen.due() and not chosen.one and fault in ("kill", "freeze") \
                and case["variant"] != "tie":
            chosen.note()
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if chosen.due() and fault == "kill" and chosen.one:
            chosen.note()
            os.kill(os.getpid(), signal.SIGKILL)
        if chosen.due() and fault in ("bitflip", "truncate", "pointer", "drift"):
            chosen.note()
            signal.raise_signal(signal.SIGTERM)  # this step, then saved and stopped
        return stepping(self, inputs, targets)

    Pipeline.step = step  # type: ignore[method-assign]
    if fault == "disk_full":
        def full(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        if chosen.one:
            save = torch.save

            def torch_save(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
                if chosen.step == case["step"]:
                    chosen.note()
                    full()
                save(obj, file, *args, **kwargs)

            torch.save = torch_save  # type: ignore[assignment]
        else:
            write = dcpfiles._write

            def dcp_write(tensors: Any, target: Path) -> None:
                if chosen.due():
                    chosen.note()
                    full()
                write(tensors, target)

            dcpfiles._write = dcp_write  # type: ignore[assignment]
    if fault == "freeze" and case["variant"] == "tie":  # in the tied gradients' all-reduce
        reduce = collective.all_reduce

        def all_reduce(*args: Any, **kwargs: Any) -> None:
            if chosen.due() and "tied weights" in kwargs.get("what", ""):
                chosen.note()
                os.kill(os.getpid(), signal.SIGSTOP)
            reduce(*args, **kwargs)

        collective.all_reduce = all_reduce  # type: ignore[assignment]
    if fault == "options" and rank == case["rank"]:
        flags += {"seed": ["--seed", "1"], "lr": ["--lr", "0.001"],
                  "steps": ["--steps", "5"]}[case["variant"]]


def before_the_group(case: dict[str, Any], rank: int, out: Path, flags: list[str]) -> None:
    """Faults before the process group exists, on the case's rank: its store's port
    answered by a listener that never replies (``silent``), or an ``--out`` on a
    read-only file system (``refusal``)."""
    if rank != case["rank"] or case["fault"] not in ("silent", "refusal"):
        return
    Plant(case, rank, out).note()
    if case["fault"] == "silent":
        os.environ["MASTER_PORT"] = os.environ["CONVEYOR_RUN_SILENT_PORT"]
    else:
        flags += ["--out", READ_ONLY]


def run() -> int:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    case = json.loads(os.environ["CONVEYOR_RUN_CASE"])
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    # Fitted timeouts of TIMEOUT s (twice that for start-up and the first two steps).
    Deadlines.floor = 2.0 if case["fault"] == "slow" else TIMEOUT
    Deadlines.first = 2 * Deadlines.floor
    from tests.runs import Case

    flags = [*Case(**case).flags(), "--out", str(out / "run")]
    if phase == "first":
        plant(case, rank, out, flags)
        before_the_group(case, rank, out, flags)
    else:  # nothing fires: no step is the fault's
        with_poisons(Plant({**case, "step": -1}, rank, out))
        flags += ["--resume", "auto"]
        if case["fault"] == "drift":  # another model on the same checkpoint
            flags += ["--heads", "4"]
    errors = open(out / f"rank{rank}.{phase}.err", "w")
    sys.stderr = _Tee(sys.__stderr__, errors)  # type: ignore[assignment]
    code = 1
    try:
        code = main(["train", *flags])
    finally:
        (out / f"rank{rank}.{phase}.json").write_text(json.dumps({"code": code,
                                                                  "time": time.time()}))
        (out / "ended").touch()
    return code


if __name__ == "__main__":
    from conveyor.cli.main import end_command

    end_command(run())  # as the conveyor command ends its process
