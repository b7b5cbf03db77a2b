"""Faults generated over launchers x faults x phases x ranks: no case may hang, and every
survivor must name the rank that failed.

A case is one combination (:class:`Case`): how the job is launched (threads in one
process; torchrun, whose agent hosts the store; env:// by hand with 2 or 3 processes,
rank 0 hosting the store; two torchrun agents; 3 processes holding 2 stages, the first
replicated), what goes wrong (a raise in forward,
backward, the loss or a collective; SIGKILL; SIGSTOP; an endless loop; a clean early
exit; a rank started with another configuration), when (the first step, a later one,
between two steps, during a checkpoint save) and on which rank (first, middle, last).
:func:`every_case` lists every combination that makes sense (a middle rank needs three,
the loss is the last stage's, a killed thread would kill the whole process...);
:func:`pick` draws one from a seed, :func:`sample` a fixed, varied few for CI.

:func:`run` launches a case (tests/faults/worker.py in each process) and
:func:`problems` lists what it did wrong: a survivor that did not exit non-zero within
the timeout + 10 s with a ``PeerFailure`` or ``StepTimeout`` naming the failed rank (and,
for a raise, its action and exception), a process left running, for ``conveyor train``
a last checkpoint that does not load. ``python -m tests.faults --seed N`` runs one,
``make faults`` every one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tests.support.launch import Outcome, launch
from tests.support.sampling import most_varied

#: launcher name: (how tests.support.launch starts it, processes)
LAUNCHERS = {"threads": ("threads", 3), "torchrun": ("torchrun", 3), "env2": ("env", 2),
             "env3": ("env", 3), "agents": ("agents", 2), "replicas": ("env", 3)}
#: the launcher whose 3 processes hold 2 stages, the first replicated (data_parallel=[2, 1])
REPLICATED = "replicas"
REPLICAS = (2, 1)


def stage_of(launcher: str, rank: int) -> int:
    """The stage process ``rank`` runs under ``launcher``."""
    return (0 if rank < REPLICAS[0] else 1) if launcher == REPLICATED else rank
FAULTS = ("raise", "kill", "freeze", "loop", "exit", "config")
PLACES = ("forward", "backward", "loss", "collective")
PHASES = ("first", "later", "between", "save")
TIMEOUT = 4.0  # Pipeline(timeout=...) of every case
GRACE = 10.0  # a survivor ends within the timeout and this


@dataclass(frozen=True)
class Case:
    """One combination; ``where`` is the place in the step (or "between", "save")."""

    launcher: str
    fault: str
    where: str
    phase: str
    rank: int
    app: str = "pipeline"
    #: "config": first, the same launch builds a pipeline that ``rank`` is given another
    #: configuration of (every rank must refuse it, naming ``rank``), then runs the case.
    prelude: str = ""

    @property
    def world(self) -> int:
        return LAUNCHERS[self.launcher][1]

    def __str__(self) -> str:
        first = f"{self.prelude} then " if self.prelude else ""
        return (f"{self.app} on {self.launcher} ({self.world} ranks): {first}{self.fault} in "
                f"{self.where}, {self.phase} phase, rank {self.rank}")


def every_case() -> list[Case]:
    """Every combination that makes sense, in a fixed order."""
    cases = []
    for launcher, (_, world) in LAUNCHERS.items():
        for fault in FAULTS:
            for phase in PHASES:
                for rank in range(world):
                    for where in _places(launcher, fault, phase, rank, world):
                        cases.append(Case(launcher, fault, where, phase, rank))
    for fault in ("raise", "kill", "freeze"):  # conveyor train, launched as SLURM does
        cases.append(Case("env2", fault, "loss", "later", 1, "train"))  # the last stage's
        for rank in (0, 1):
            cases.append(Case("env2", fault, "save", "save", rank, "train"))
    return cases


def _places(launcher: str, fault: str, phase: str, rank: int, world: int) -> list[str]:
    threads = launcher == "threads"
    if fault == "config":  # refused as the pipelines are built
        return ["build"] if phase == "first" and not threads else []
    if phase in ("between", "save"):
        if threads or fault == "loop" and phase == "save":
            return []
        return [phase]
    if threads:  # one process: a kill, a freeze or an exit ends every rank at once
        if fault not in ("raise", "loop"):
            return []
        places = ["forward", "backward", "loss"]
    else:
        places = list(PLACES)
    if fault == "exit":
        places = ["forward"]
    last = stage_of(launcher, rank) == stage_of(launcher, world - 1)
    return [p for p in places if p != "loss" or last]


def pick(seed: int) -> Case:
    """The case of ``seed``."""
    cases = every_case()
    return cases[random.Random(seed).randrange(len(cases))]


def sample(count: int, seed: int = 0) -> list[Case]:
    """``count`` cases from ``seed``, as varied as can be: each next one the case that
    adds the most launchers, faults, places, phases and ranks not yet drawn."""
    return most_varied(every_case(), count, seed, _traits)


def _traits(case: Case) -> set[tuple[str, Any]]:
    return {("launcher", case.launcher), ("fault", case.fault), ("where", case.where),
            ("phase", case.phase), ("rank", "first" if case.rank == 0 else
                                    "last" if case.rank == case.world - 1 else "middle"),
            ("app", case.app), ("fault@where", (case.fault, case.where))}


def run(case: Case, out: Path, *, timeout: float = 150.0) -> Outcome:
    """Launches ``case`` into ``out``; once every survivor has ended, ends the faulty
    rank if it is frozen or looping (nothing else is killed before ``timeout``)."""
    out.mkdir(parents=True, exist_ok=True)
    how, world = LAUNCHERS[case.launcher]
    env = {"CONVEYOR_FAULT": json.dumps({**asdict(case), "world": world,
                                          "timeout": TIMEOUT})}
    survivors = [r for r in range(world) if r != case.rank]
    if case.launcher == "threads":
        survivors = [0]
    barrier: dict[int, float] = {}  # an agent's pid in the exit barrier: since when

    def release() -> None:
        if all((out / f"rank{r}.json").exists() for r in survivors):
            (out / "release").touch()
            if case.launcher == "agents" and case.fault == "exit":
                _end_exit_barrier(out, barrier)
            fault = out / "fault.json"
            if case.fault == "freeze" and fault.exists():
                try:
                    os.kill(json.loads(fault.read_text())["pid"], signal.SIGKILL)
                except (ProcessLookupError, json.JSONDecodeError):
                    pass

    return launch("fault", 1 if how == "threads" else world, out, timeout=timeout, env=env,
                  launcher="file" if how == "threads" else how,
                  module="tests.faults.worker", args=[str(out)], watch=release)


#: torchrun's agent logs this when its workers all exited 0 (api.py, LOGLEVEL=INFO)
_BARRIER = "Waiting 300 seconds for other agents to finish"


_BARRIER_GRACE = 15.0  # seconds the barrier may end by itself (the failed agent's store gone)


def _end_exit_barrier(out: Path, since: dict[int, float]) -> None:
    """Ends the torchrun agent whose worker exited 0 (the fault) and that still waits,
    ``_BARRIER_GRACE`` s on, in torchrun's exit barrier for the other agent, which
    failed and never comes: 300 s, which torchrun's command line cannot change
    (pytorch/pytorch#157318). Not a hang of conveyor's: every worker has ended by
    then. Written down in ``exit-barrier``; ``since`` keeps when it was first seen."""
    for log in out.glob("agent*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if _BARRIER not in line:
                continue
            pid = int(line.split()[2])  # "I1125 19:43:52.993000 12117 file:line] ..."
            first = since.setdefault(pid, time.monotonic())
            if time.monotonic() - first < _BARRIER_GRACE or not Path(f"/proc/{pid}").exists():
                continue
            (out / "exit-barrier").write_text(f"{log.stem} (pid {pid}): {line}\n")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def problems(case: Case, out: Path, outcome: Outcome) -> list[str]:
    """What ``case`` did wrong, read from what its processes wrote; [] when nothing."""
    found: list[str] = []
    how, world = LAUNCHERS[case.launcher]
    fault_file = out / "fault.json"
    if case.fault != "config" and not fault_file.exists():
        return [f"the fault never fired ({case}); logs:\n{_logs(outcome)}"]
    fired = json.loads(fault_file.read_text())["time"] if fault_file.exists() else None
    if any(code is None for code in outcome.returncodes):
        found.append(f"still running after {outcome.seconds:.0f} s: a hang")
    if (out / "exit-barrier").exists() and not (case.launcher == "agents"
                                                and case.fault == "exit"):
        found.append("an agent waited in torchrun's exit barrier")
    survivors = [r for r in range(world) if r != case.rank]
    if how == "threads":
        survivors = [0]
    elif case.fault in ("raise", "config") and case.phase not in ("between",):
        survivors = list(range(world))  # the failing rank raises too
    for rank in survivors:
        found += _rank_problems(case, out, outcome, rank, fired)
    if case.prelude:
        found += _prelude_problems(case, out)
    if case.app == "train":
        found += _checkpoint_problems(out)
    frozen = _pid(out) if case.fault in ("freeze", "loop") else None
    left = [p for p in (outcome.left or []) if p.split()[0] != str(frozen)]
    if left:
        found.append(f"left running at the end: {left}")
    return [f"{case}: {p}" for p in found] + ([f"logs:\n{_logs(outcome)}"] if found else [])


def _rank_problems(case: Case, out: Path, outcome: Outcome, rank: int,
                   fired: float | None) -> list[str]:
    how, _ = LAUNCHERS[case.launcher]
    path = out / f"rank{rank}.json"
    if case.app == "train":
        return _train_rank_problems(case, out, outcome, rank, fired)
    if not path.exists():
        return [f"rank {rank} wrote nothing"]
    record = json.loads(path.read_text())
    error = record.get("error")
    if error is None:
        return [f"rank {rank} ended without an error: {record}"]
    if how in ("env", "file") and outcome.returncodes[rank] in (0, None):
        return [f"rank {rank} exited {outcome.returncodes[rank]}"]
    if error["type"] == "LauncherStop" and how in ("torchrun", "agents") and rank != case.rank \
            and (case.fault in ("kill", "exit", "raise") or _ended_before(out, case, rank, error)):
        return []  # torchrun's agent ended it once the failed rank's process, or another
        # survivor's with its error, had exited
    wanted = _wanted_types(case, rank)
    first = (error["text"].splitlines() or [""])[0]
    found = []
    if error["type"] not in wanted:
        found.append(f"rank {rank} raised {error['type']}, not {' or '.join(wanted)}: {first}")
    named = case.rank  # on threads, the stage of that rank
    stage = stage_of(case.launcher, case.rank)
    if rank == case.rank and case.fault == "raise":  # its own error: the exception
        if f"planted failure in {case.where}" not in error["text"]:
            found.append(f"rank {rank} ended with another error than its own: {first}")
    elif case.fault == "config":
        if f"on rank {named}" not in first and f"on rank {named}" not in error["text"]:
            found.append(f"rank {rank}'s error does not name rank {named}: {first}")
    elif f"rank {named}" not in first and f"stage {named}" not in first and not (
            how == "threads" and _marked(error.get("where") or "", named)):
        found.append(f"rank {rank}'s error does not name rank {named}: {first}")
    if rank == case.rank:
        pass
    elif case.fault == "raise" and f"planted failure in {case.where}" not in first:
        found.append(f"rank {rank}'s error does not carry the exception: {first}")
    if case.fault == "raise" and (
            case.where in ("forward", "backward") and not any(
                f"{stage}{kind}" in first for kind in "FB")
            or case.where == "loss" and rank != case.rank
            and "loss_fn failed on micro-batch" not in first):
        found.append(f"rank {rank}'s error does not name the action: {first}")
    if fired is not None and error["time"] - fired > TIMEOUT + GRACE:
        found.append(f"rank {rank} ended {error['time'] - fired:.1f} s after the fault "
                     f"(more than {TIMEOUT:g} + {GRACE:g} s)")
    return found


def _ended_before(out: Path, case: Case, rank: int, error: dict[str, Any]) -> bool:
    """Whether a survivor other than ``rank`` (which ended with ``error``) ended earlier
    with its own PeerFailure or StepTimeout (checked in its turn)."""
    for path in out.glob("rank*.json"):
        if path.stem in (f"rank{rank}", f"rank{case.rank}"):
            continue
        other = json.loads(path.read_text()).get("error")
        if other is not None and other["type"] in ("PeerFailure", "StepTimeout") \
                and other["time"] <= error["time"]:
            return True
    return False


def _prelude_problems(case: Case, out: Path) -> list[str]:
    """Every rank that wrote must have refused the prelude's pipeline, naming the rank."""
    found = []
    for path in sorted(out.glob("rank*.json")):
        refused = json.loads(path.read_text()).get("prelude")
        if refused is None or refused["type"] != "ConfigError" \
                or f"on rank {case.rank}" not in refused["text"]:
            found.append(f"{path.stem} did not refuse the prelude's pipeline: {refused}")
    return found


def _marked(report: str, rank: int) -> bool:
    """Whether the hang report marks ``rank`` as where the step failed or stuck (on
    threads the caller's error is the failing stage's own, which may not say its stage:
    a loss's)."""
    return any(line.startswith(f"  rank {rank} ") and ("<- failed here" in line
                                                       or "<- stuck" in line)
               for line in report.splitlines())


def _wanted_types(case: Case, rank: int) -> tuple[str, ...]:
    if case.fault == "config":
        return ("ConfigError",)
    if rank == case.rank and case.fault == "raise":
        return ("StageError", "ValueError", "ConveyorError")  # its own error
    if case.launcher == "threads":  # the caller raises the failing stage's own error
        return ("StageError", "ConveyorError") if case.fault == "raise" else ("StepTimeout",)
    return ("PeerFailure", "StepTimeout")


def _train_rank_problems(case: Case, out: Path, outcome: Outcome, rank: int,
                         fired: float | None) -> list[str]:
    output = outcome.outputs[rank]
    if outcome.returncodes[rank] in (0, None):
        return [f"rank {rank} exited {outcome.returncodes[rank]}"]
    error = [line for line in output.splitlines() if "conveyor train: error" in line]
    if not error:
        return [f"rank {rank} printed no error"]
    if f"rank {case.rank}" not in error[-1] and not (
            rank == case.rank and "planted failure" in error[-1]):
        return [f"rank {rank}'s error does not name rank {case.rank}: {error[-1]}"]
    ended = json.loads((out / f"rank{rank}.json").read_text())["error"]["time"]
    if fired is not None and ended - fired > 2 * TIMEOUT + GRACE:  # fitted: 2 x at most
        return [f"rank {rank} ended {ended - fired:.1f} s after the fault"]
    return []


def _checkpoint_problems(out: Path) -> list[str]:
    from conveyor.train import saving
    from conveyor.train.models import transformer_lm

    model = transformer_lm(2, 16, 32, 2, max_length=16, tie=True)  # tests.support.training
    try:
        model.load_state_dict(saving.load_weights(out / "run"))
    except Exception as exc:  # noqa: BLE001 - the problem to report
        return [f"the last checkpoint does not load: {type(exc).__name__}: {exc}"]
    return []


def _pid(out: Path) -> int | None:
    fault = out / "fault.json"
    return int(json.loads(fault.read_text())["pid"]) if fault.exists() else None


def _logs(outcome: Outcome) -> str:
    return "\n".join(f"--- process {i} (exit {code}):\n{text[-3000:]}"
                     for i, (code, text) in enumerate(zip(outcome.returncodes,
                                                          outcome.outputs)))


def check(case: Case, out: Path) -> tuple[list[str], float]:
    """Runs ``case`` and returns its problems and the seconds it took."""
    start = time.monotonic()
    outcome = run(case, out)
    return problems(case, out, outcome), time.monotonic() - start
