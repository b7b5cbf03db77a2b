"""Runs a scenario in several processes (gloo on 127.0.0.1) and collects what they wrote.

The parent calls :func:`launch`; each child runs ``python -m tests.multiprocess
SCENARIO OUT_DIR`` with RANK and WORLD_SIZE set, joins a process group through a file
(no fixed port), runs ``scenario_SCENARIO(rank, world, out_dir)`` and exits.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Outcome:
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
                [sys.executable, "-m", "tests.multiprocess", scenario, str(out_dir)],
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


def _main() -> None:
    import torch
    import torch.distributed as dist

    from tests import hang_scenarios, rebalance_scenarios, scenarios

    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['CONVEYOR_INIT_FILE']}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    module = (hang_scenarios if scenario.startswith("hang_")
              else rebalance_scenarios if scenario.startswith("rebalance_") else scenarios)
    getattr(module, f"scenario_{scenario}")(rank, world, out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
