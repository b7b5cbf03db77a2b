"""Runs commands from the repository root, and a scenario in several processes (gloo on
127.0.0.1), collecting what they wrote.

The parent calls :func:`launch`; each child runs ``python -m tests.support.scenarios
SCENARIO OUT_DIR`` with RANK and WORLD_SIZE set, joins a process group through a file
(no fixed port), runs the scenario registered under that name and exits (see
tests/support/scenarios/__main__.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """Each process's exit code (None: still running at the timeout, then killed), its
    output, and the seconds the launch took."""

    returncodes: list[int | None]
    outputs: list[str]
    seconds: float


def run_command(command: list[str], *, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs a command from the repository root (one thread per process), capturing output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def launch(scenario: str, world: int, out_dir: Path, *, timeout: float = 120.0,
           env: dict[str, str] | None = None) -> Outcome:
    """Starts ``world`` processes for ``scenario``; kills any still running at ``timeout``."""
    init_file = out_dir / "rendezvous"
    init_file.unlink(missing_ok=True)
    logs = [out_dir / f"rank{r}.log" for r in range(world)]
    processes = []
    start = time.monotonic()
    for rank in range(world):
        child_env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world),
                     "CONVEYOR_INIT_FILE": str(init_file), "OMP_NUM_THREADS": "1",
                     "PYTHONPATH": str(ROOT)}
        with open(logs[rank], "w") as log:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "tests.support.scenarios", scenario, str(out_dir)],
                cwd=ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT))
    codes: list[int | None] = [None] * world
    while time.monotonic() - start < timeout and any(c is None for c in codes):
        codes = [p.poll() for p in processes]
        time.sleep(0.05)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    return Outcome(codes, [log.read_text() for log in logs], time.monotonic() - start)

