"""Faults of whole ``conveyor train`` runs, generated: what happens to the data.

tests/faults asks whether every survivor of a fault names it in time. This asks what a
fault leaves on disk, and whether the run can go on from there. A case
(:class:`Case`) is a whole run of ``conveyor train`` (6 steps, a checkpoint every 2)
launched as one process (stages on threads), under torchrun, or by hand under env://
(2 processes), with a tied or an untied head, and one fault at a drawn step and rank:

=========  ================================================  =========================
fault      what                                              the oracle
=========  ================================================  =========================
none       nothing                                           the reference run's state
kill       SIGKILL in the step                               named error (survivors) in
freeze     SIGSTOP in the step, or in the all-reduce of the  time, newest checkpoint
           tied weights' gradients (one process: a layer     intact; resumed: the
           that never returns)
nan        NaN in one stage's activations                    reference state, bit for
disk_full  the save of the step fails (ENOSPC)               bit
options    one rank started with another --seed, --lr or     every rank refuses, naming
           --steps                                           it; nothing written
bitflip,   SIGTERM at the step (saved, stopped), then bytes  the resume refuses, naming
truncate   of the newest checkpoint flipped or cut           the file; nothing changed
slow       one stage 1.2 s per forward from the step on,     the reference state
           against a 2 s timeout, under GPipe
pointer    SIGTERM at the step (saved), then ``latest``      the resume says so and
           emptied, naming a folder outside, or stale        ends as the reference
drift      SIGTERM at the step (saved), then resumed with    every rank refuses (2),
           ``--heads 4`` (same shapes, another model)        naming both; nothing changed
silent     before the process group: the rank's store port   every rank ends in time
           held by a listener that never answers             (1), naming the address
refusal    before the process group: the rank's ``--out``    that rank exits 2 (not
           on a read-only file system                        killed), nothing written
=========  ================================================  =========================

The reference is the same launch without a fault (bit equality holds within one kind
of launch). ``python -m tests.runs`` runs every case, ``--seed N`` one; tests/test_runs.py
a fixed sample.

What it does not draw: more than one fault per run, faults during a resume (but a
damaged pointer and another model before it), data-parallel replicas and FSDP, GPUs, two torchrun agents, a fault in the
evaluation or the final sample, a disk that fills up slowly, clocks.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tests.support.launch import Outcome, launch
from tests.support.sampling import most_varied

LAUNCHERS = ("one", "torchrun", "env")
FAULTS = ("none", "kill", "freeze", "nan", "disk_full", "options", "bitflip", "truncate",
          "slow", "pointer", "drift", "silent", "refusal")
READ_ONLY = "/proc/sys/conveyor/run"  # an --out that cannot be created (read-only)
STEPS, SAVE_EVERY = 6, 2
TIMEOUT = 4.0  # the fitted timeouts' floor; the first two steps get twice it
GRACE = 10.0  # a survivor ends within the timeout and this
FLAGS = ["--layers", "2", "--width", "16", "--hidden", "32", "--heads", "2", "--length", "16",
         "--batch", "4", "--chunks", "2", "--eval-every", str(STEPS), "--eval-batches", "1",
         "--save-every", str(SAVE_EVERY), "--sample-bytes", "0", "--warmup", "1",
         "--steps", str(STEPS), "--stages", "2"]


@dataclass(frozen=True)
class Case:
    """One run and its fault; ``variant`` says which option differs (``options``), or
    where a process freezes (``freeze``: at the start of the step, or in the tie
    all-reduce)."""

    launcher: str
    tie: bool
    fault: str
    step: int
    rank: int
    variant: str = ""

    def __str__(self) -> str:
        what = f"{self.fault}{f' ({self.variant})' if self.variant else ''}"
        return (f"train on {self.launcher}, {'tied' if self.tie else 'untied'}: {what} at step "
                f"{self.step}, {'stage' if self.launcher == 'one' else 'rank'} {self.rank}")

    def flags(self) -> list[str]:
        schedule = ["--schedule", "gpipe"] if self.fault == "slow" else []
        return [*FLAGS, *schedule, *([] if self.tie else ["--no-tie"])]


def every_case() -> list[Case]:
    """Every combination that makes sense, in a fixed order."""
    cases = []
    for launcher in LAUNCHERS:
        for tie in (True, False):
            for fault in FAULTS:
                if fault in ("options", "silent") and launcher == "one":
                    continue  # one process reads one command line, joins no group
                steps = {"none": [STEPS], "disk_full": [2, 4], "slow": [3], "options": [1],
                         "bitflip": [4], "truncate": [4], "pointer": [4], "drift": [4],
                         "silent": [0], "refusal": [0]}.get(fault, [1, 3, STEPS])
                variants = {"options": ("seed", "lr", "steps"),
                            "pointer": ("empty", "outside", "stale"),
                            "freeze": ("step", "tie") if tie and launcher != "one"
                            else ("step",)}.get(fault, ("",))
                # A whole-process fault in one process has no rank to choose; a damaged
                # folder and another model are every rank's.
                whole = fault in ("none", "pointer", "drift") or launcher == "one" and \
                    fault in ("kill", "disk_full", "bitflip", "truncate", "refusal")
                for step in steps:
                    for rank in (0,) if whole else (0, 1):
                        for variant in variants:
                            cases.append(Case(launcher, tie, fault, step, rank, variant))
    return cases


def pick(seed: int) -> Case:
    cases = every_case()
    return cases[random.Random(seed).randrange(len(cases))]


def sample(count: int, seed: int = 0) -> list[Case]:
    """``count`` cases, each next one adding the most launchers, faults, ties and ranks
    not yet drawn."""
    return most_varied(every_case(), count, seed, _traits)


def _traits(case: Case) -> set[tuple[str, Any]]:
    return {("launcher", case.launcher), ("fault", case.fault), ("tie", case.tie),
            ("rank", case.rank), ("fault@launcher", (case.fault, case.launcher))}


# ------------------------------------------------------------------ running a case

def launch_run(case: Case, out: Path, phase: str, *, timeout: float = 180.0,
               silent_port: int | None = None) -> Outcome:
    """One launch of the case's run (``phase``: "first", with the fault planted, or
    "resume"); a frozen process is killed once the others have ended. ``silent_port``:
    a port that accepts and never answers (the ``silent`` fault's)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"CONVEYOR_RUN_CASE": json.dumps(asdict(case))}
    if silent_port is not None:
        env["CONVEYOR_RUN_SILENT_PORT"] = str(silent_port)
    world = 1 if case.launcher == "one" else 2

    def release() -> None:
        fault = out / "fault.json"
        if case.fault == "freeze" and fault.exists() and (out / "ended").exists():
            try:
                os.kill(json.loads(fault.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, json.JSONDecodeError):
                pass

    return launch("run", world, out, timeout=timeout, env=env,
                  launcher={"one": "file", "torchrun": "torchrun", "env": "env"}[case.launcher],
                  module="tests.runs.worker", args=[str(out), phase], watch=release)


_references: dict[tuple[str, bool, bool], dict[str, torch.Tensor]] = {}


def reference(case: Case, out: Path) -> dict[str, torch.Tensor]:
    """The final weights of the case's run without a fault (launched once per kind)."""
    key = (case.launcher, case.tie, case.fault == "slow")  # slow: under GPipe
    if key not in _references:
        plain = replace(case, fault="none", step=STEPS, variant="")
        where = out / f"reference-{'-'.join(map(str, key))}"
        outcome = launch_run(plain, where, "first")
        assert all(code == 0 for code in outcome.returncodes), logs(outcome)
        _references[key] = _weights(where / "run")
    return _references[key]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from conveyor.train import saving

    return saving.load_weights(run)


def check(case: Case, out: Path) -> tuple[list[str], float]:
    """Runs ``case`` (and its reference, and its resume); its problems and seconds."""
    from tests.runs.oracle import problems

    start = time.monotonic()
    found = problems(case, out / "case", lambda: reference(case, out))
    return [f"{case}: {p}" for p in found], time.monotonic() - start


def logs(outcome: Outcome) -> str:
    return "\n".join(f"--- process {i} (exit {code}):\n{text[-3000:]}"
                     for i, (code, text) in enumerate(zip(outcome.returncodes,
                                                          outcome.outputs)))
