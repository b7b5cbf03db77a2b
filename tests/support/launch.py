"""Runs commands from the repository root, and a scenario in several processes (gloo on
127.0.0.1), collecting what they wrote.

The parent calls :func:`launch`; each child runs ``python -m tests.support.scenarios
SCENARIO OUT_DIR`` (or another module) with RANK and WORLD_SIZE set and exits (see
tests/support/scenarios/__main__.py). How the processes find each other is the
*launcher*:

* ``file``: a process group through a file (no store host: nothing can freeze it);
* ``env``: env:// by hand, as SLURM's ``srun`` jobs do: MASTER_ADDR=127.0.0.1 and a free
  MASTER_PORT, so rank 0's process hosts the c10d store;
* ``torchrun``: one torchrun agent (``--standalone``), which hosts the store;
* ``agents``: two torchrun agents (``--nnodes 2``, c10d rendezvous; whichever starts
  first hosts the store).

Under torchrun the agent stops the other workers once one exits non-zero (SIGTERM,
then SIGKILL); ``returncodes`` are then the agents'. Whatever is still running below the
processes started when they end or time out (``left``) is killed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("file", "env", "torchrun", "agents")


@dataclass
class Outcome:
    """Each process's exit code (None: still running at the timeout, then killed), its
    output, and the seconds the launch took. Under torchrun the processes are the
    agents, and ``left`` the workers still running when the agents ended."""

    returncodes: list[int | None]
    outputs: list[str]
    seconds: float
    left: list[str] | None = None  # "pid state" of each process still there at the end


def run_command(command: list[str], *, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs a command from the repository root (one thread per process), capturing output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(scenario: str, world: int, out_dir: Path, *, timeout: float = 120.0,
           env: dict[str, str] | None = None, launcher: str = "file",
           module: str = "tests.support.scenarios", args: list[str] | None = None,
           watch: Callable[[], None] | None = None) -> Outcome:
    """Starts ``world`` processes for ``scenario`` by ``launcher``; kills any still
    running at ``timeout``. ``module`` and ``args`` replace what each process runs
    (``python -m MODULE ARGS``; by default the scenario and ``out_dir``); ``watch`` is
    called while they run, twenty times a second."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    argv = ["-m", module, *(args if args is not None else [scenario, str(out_dir)])]
    base = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    base.pop("CONVEYOR_INIT_FILE", None)
    if launcher in ("torchrun", "agents"):
        commands, envs, logs = _agents(launcher, world, argv, base, out_dir)
    else:
        commands, envs = _by_hand(launcher, world, argv, base, out_dir)
        logs = [out_dir / f"rank{r}.log" for r in range(world)]
    processes = []
    start = time.monotonic()
    for command, child_env, path in zip(commands, envs, logs):
        with open(path, "w") as log:
            processes.append(subprocess.Popen(command, cwd=ROOT, env=child_env, stdout=log,
                                              stderr=subprocess.STDOUT))
    codes: list[int | None] = [None] * len(processes)
    below: set[int] = set()  # every process seen below those started (torchrun's workers)
    rounds = 0
    while time.monotonic() - start < timeout and any(c is None for c in codes):
        codes = [p.poll() for p in processes]
        if watch is not None:
            watch()
        if rounds % 10 == 0:
            below |= _descendants([p.pid for p in processes])
        rounds += 1
        time.sleep(0.05)
    left = [f"{pid} {state}" for pid in sorted(below | {p.pid for p in processes})
            if (state := _state(pid)) not in (None, "Z", "X")]
    for pid in below | {p.pid for p in processes}:
        try:
            os.kill(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
    for process in processes:
        process.wait()
    return Outcome(codes, [log.read_text() for log in logs], time.monotonic() - start, left)


def _by_hand(launcher: str, world: int, argv: list[str], base: dict[str, str],
             out_dir: Path) -> tuple[list[list[str]], list[dict[str, str]]]:
    """One process per rank: through a file, or env:// with rank 0 hosting the store."""
    if launcher == "file":
        init_file = out_dir / "rendezvous"
        init_file.unlink(missing_ok=True)
        where = {"CONVEYOR_INIT_FILE": str(init_file)}
    else:
        where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    envs = [{**base, **where, "RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)} for r in range(world)]
    return [[sys.executable, *argv] for _ in range(world)], envs


def _agents(launcher: str, world: int, argv: list[str], base: dict[str, str],
            out_dir: Path) -> tuple[list[list[str]], list[dict[str, str]], list[Path]]:
    """torchrun: one agent with every worker, or two agents sharing them out."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if launcher == "torchrun":
        return ([[*run, "--standalone", "--nproc-per-node", str(world), *argv]], [base],
                [out_dir / "agent.log"])
    endpoint = f"127.0.0.1:{free_port()}"
    sizes = [world - world // 2, world // 2]
    commands = [[*run, "--nnodes", "2", "--nproc-per-node", str(sizes[node]), "--node-rank",
                 str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", f"faults-{os.getpid()}", *argv] for node in range(2)]
    logged = {**base, "LOGLEVEL": "INFO"}  # the agents say when they wait in their exit barrier
    return commands, [logged, logged], [out_dir / f"agent{node}.log" for node in range(2)]


def _stat(path: Path) -> list[str] | None:
    """A /proc/PID/stat's fields after the name: state, ppid, ... (None: gone)."""
    try:
        return path.read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def _state(pid: int) -> str | None:
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return None if fields is None else fields[0]


def _descendants(roots: list[int]) -> set[int]:
    """The processes below ``roots`` now (read from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(stat)
        if fields is not None:
            parents[int(stat.parent.name)] = int(fields[1])
    below, frontier = set(), set(roots)
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return below


def problems_two_at_a_time(check: Callable[[Any, Path], tuple[list[str], float]],
                           cases: Sequence[Any], out: Path) -> dict[Any, list[str]]:
    """What ``check(case, folder)`` found for each case, two cases at a time, each in a
    folder of its own under ``out``: a launched fault case spends much of its time
    waiting on a timeout or a restart, so two at once take about 60-80% of the time of
    one after the other (tried also with another process busy on one of two cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = pool.map(lambda numbered: check(numbered[1], out / f"case{numbered[0]}")[0],
                         enumerate(cases))
        return dict(zip(cases, found))


def collect(out: Path, pattern: str, world: int) -> tuple[list[float], dict[str, torch.Tensor],
                                                           list[dict[str, object]]]:
    """What each of ``world`` ranks wrote (``pattern`` with ``{rank}``): its loss, the
    gradients of them all by name, and each rank's whole record."""
    results = [torch.load(out / pattern.format(rank=r)) for r in range(world)]
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        grads.update(result["grads"])
    return [float(r.get("loss", "nan")) for r in results], grads, results
