"""Elastic restarts at a new size: two torchrun agents (``--nnodes 1:2 --max-restarts 3``)
on 127.0.0.1 train with a stage on each; one node is killed, the other restarts alone
with one stage from the newest checkpoint; the node comes back and the job grows to two
stages again. The losses are those of a run never interrupted.

The run steps behind a gate (tests/support/elastic_worker.py) so that the test, not the
speed of this machine, decides at which step a node leaves or joins::

    world 2:  steps 1-4, checkpoints 2, 4        kill agent B; step 5 fails on A
    world 1:  resumes at 4: steps 5-8, saves 6, 8      start agent B'
    world 2:  (A's worker takes SIGTERM: step 9, saves 9) resumes at 9: steps 10-12, done
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from conveyor.cli import main
from conveyor.errors import ConfigError
from conveyor.train.elastic import describe_replan, plan_layout
from conveyor.train.options import TrainConfig
from tests.support.launch import ROOT
from tests.support.training import TINY

STEPS = 12
FLAGS = [*TINY, "--steps", str(STEPS), "--save-every", "2", "--eval-every", str(STEPS),
         "--sample-bytes", "0"]
# Rendezvous settings for a quick test: a dead agent is noticed after 5 missed heartbeats
# of 1 s (torch's default: 3 of 5 s), and a rendezvous with fewer than 2 nodes closes
# 6 s after its first one joined (default 30 s).
RDZV = "keep_alive_interval=1,keep_alive_max_attempt=5,last_call_timeout=6"


# -- the plan for a world (no processes) ---------------------------------------------


def planned(world: int, given: Collection[str] = (), **values: Any) -> dict[str, Any]:
    layout = plan_layout({**asdict(TrainConfig()), **values}, given=set(given), world=world)
    return {k: layout[k] for k in ("stages", "data_parallel", "chunks")}


def test_the_layout_not_given_follows_the_world() -> None:
    # A resumed run's own stages give way: one rank per stage.
    assert planned(1, stages=2) == {"stages": 1, "data_parallel": 1, "chunks": 8}
    assert planned(4, stages=2) == {"stages": 4, "data_parallel": 1, "chunks": 8}
    # Replicas stay while they divide the world, else there is one pipeline.
    assert planned(4, stages=1, data_parallel=2) == {"stages": 2, "data_parallel": 2,
                                                      "chunks": 8}
    assert planned(3, stages=2, data_parallel=2) == {"stages": 3, "data_parallel": 1,
                                                      "chunks": 8}
    # Micro-batches grow only where the schedule needs more for the new stages.
    assert planned(4, {"chunks"}, schedule="interleaved-1f1b", virtual_stages=2,
                   chunks=2) == {"stages": 4, "data_parallel": 1, "chunks": 4}
    assert planned(2, schedule="dualpipe-v", chunks=2)["chunks"] == 4


def test_a_given_layout_that_does_not_fit_the_world_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--data-parallel 2 does not divide the 3 processes "
                                          r"torchrun started; use a divisor of 3"):
        planned(3, {"data_parallel"}, data_parallel=2)
    with pytest.raises(ConfigError, match=r"--stages 2 x --data-parallel 1 needs 2 processes but "
                                          r"torchrun started 3; leave out --stages .*\(3 stages\)"):
        planned(3, {"stages"}, stages=2)
    with pytest.raises(ConfigError, match=r"--stages 2 x --data-parallel 1 needs 2 processes but "
                                          r"torchrun started 1;"):
        planned(1, {"stages"}, stages=2)
    assert planned(2, {"stages"}, stages=2)["stages"] == 2


def test_a_resume_at_another_layout_says_what_changed() -> None:
    config = TrainConfig(stages=1)
    saved = {"config": asdict(TrainConfig(stages=2)), "world": 2, "balance": [3, 4]}
    assert describe_replan(saved, config, balance=[7]) == (
        "world 2 -> 1: 2 stages -> 1, balance [3, 4] -> [7]")
    assert describe_replan({"config": asdict(config), "world": 1, "balance": [7]}, config,
                           balance=[7]) is None
    # A checkpoint from before elastic runs: its world is its stages x replicas.
    older = {"config": asdict(TrainConfig(stages=2, data_parallel=2, chunks=4))}
    assert describe_replan(older, config, balance=[7]) == (
        "world 4 -> 1: 2 stages -> 1, 2 replicas -> 1, 4 micro-batches -> 8")


def test_resume_auto_starts_a_run_or_continues_it(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*TINY, "--steps", "4", "--save-every", "2", "--resume", "auto",
             "--out", str(tmp_path)]
    assert main(["train", *flags, "--time-limit", "0.001"]) == 0  # stops after a step
    assert "resuming" not in capsys.readouterr().out
    assert main(["train", *flags, "--time-limit", "600"]) == 0
    assert "resuming at step 1" in capsys.readouterr().out
    assert len(losses(tmp_path)) == 4
    with pytest.raises(SystemExit):
        main(["train", *flags[:-3], "--resume", "later", "--out", str(tmp_path)])
    assert "--resume takes no value or 'auto', got 'later'" in capsys.readouterr().err


# -- two agents ------------------------------------------------------------------------


class Agents:
    """The torchrun agents of one job, each in its own process group, logging to a file."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *, host: bool) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "CONVEYOR_TEST_GATE": str(self.folder / "gate"),
               # torch 2.13: with the store shared, a rank-0 agent that stays rank 0 does
               # not publish the workers' store in a later round, and a joining node
               # waits for it until the 60 s timeout (the README says so too).
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                   "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "elastic", "--local-addr", "127.0.0.1",
                   # The store lives with agent A, which stays: B may die.
                   "--rdzv-conf", f"{RDZV},is_host={int(host)}",
                   "-m", "tests.support.elastic_worker", *FLAGS, "--out", str(self.folder / "run"),
                   "--resume", "auto"]
        with open(self.folder / f"{name}.log", "wb") as log:
            self.running[name] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT,
                                                  start_new_session=True)

    def kill(self, name: str) -> None:
        """SIGKILL to the agent and its workers at once, as a lost machine. torchrun starts
        each worker in a session of its own: killing the agent's group leaves them."""
        process = self.running[name]
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # each is its group's leader
        process.wait()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.folder.glob("*.log")))

    def wait_for(self, what: str, condition: Callable[[], bool], seconds: float) -> float:
        """Seconds until ``condition`` held; fails with the logs after ``seconds``."""
        start = time.monotonic()
        while not condition():
            if time.monotonic() - start > seconds:
                pytest.fail(f"no {what} after {seconds} s; logs:\n{self.logs()}")
            time.sleep(0.2)
        return time.monotonic() - start


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (read from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (name) state ppid ...": the name may hold spaces, not a ")"+space.
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    below, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        below += children
        frontier = children
    return below


def newest_checkpoint(run: Path) -> tuple[int, int]:
    """The step of the ``latest`` checkpoint and the number of ranks that wrote it."""
    latest = run / "checkpoint" / "latest"
    if not latest.exists():
        return 0, 0
    folder = run / "checkpoint" / latest.read_text().strip()
    return int(folder.name.split("-")[1]), len(list(folder.glob("*.distcp")))


def losses(run: Path) -> list[float]:
    return [e["loss"] for e in json.loads((run / "summary.json").read_text())["history"]]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.timeout(240)
def test_a_node_leaves_and_comes_back_and_the_run_goes_on(tmp_path: Path,
                                                          free_port: int) -> None:
    assert main(["train", *FLAGS, "--out", str(tmp_path / "reference")]) == 0  # threads
    gate, run = tmp_path / "gate", tmp_path / "run"
    gate.write_text("4")
    agents = Agents(tmp_path, free_port)
    try:
        agents.start("a", host=True)
        agents.start("b", host=False)
        agents.wait_for("checkpoint of step 4 from two ranks",
                        lambda: newest_checkpoint(run) == (4, 2), 120)

        # A node leaves: its agent and worker die at once; A's next step fails.
        agents.kill("b")
        killed = time.monotonic()
        gate.write_text("8")
        agents.wait_for("checkpoint of step 8 from one rank",
                        lambda: newest_checkpoint(run) == (8, 1), 120)
        logs = agents.logs()
        assert ("re-planned (restart 1 of torchrun: world 2 -> 1: 2 stages -> 1, balance "
                "[2, 3] -> [5]); resuming from the checkpoint of step 4") in logs, logs
        assert "1f1b, 1 stage, 2 micro-batches, balance [5]" in logs
        shrunk = time.monotonic() - killed

        # The node comes back: A's worker stops after its step in flight (9), saves,
        # and both restart with a stage each.
        agents.start("b2", host=False)
        grown = agents.wait_for(
            "re-planned layout for two ranks",
            lambda: "world 1 -> 2: 1 stage -> 2, balance [5] -> [2, 3]); resuming from the "
                    "checkpoint of step 9" in agents.logs(), 120)
        gate.write_text(str(STEPS))
        for name in ("a", "b2"):
            agents.running[name].wait(timeout=120)
        codes = {n: agents.running[n].returncode for n in ("a", "b2")}
        assert codes == {"a": 0, "b2": 0}, agents.logs()
    finally:
        for name in agents.running:
            agents.kill(name)
    print(f"\nnode lost -> training again at world 1: {shrunk:.1f} s; node back -> world 2: "
          f"{grown:.1f} s")
    # One entry per step, each the loss of the uninterrupted run (the batches follow the
    # step, the optimizer and schedule come back with the checkpoint): only step 5 was
    # taken twice, and the curve shows no seam where the world changed.
    reference = losses(tmp_path / "reference")
    assert len(reference) == STEPS
    assert losses(run) == pytest.approx(reference, rel=1e-6)  # measured: 5e-8
    assert newest_checkpoint(run) == (STEPS, 2)
