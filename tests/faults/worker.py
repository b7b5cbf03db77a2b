"""One process of a fault case: ``python -m tests.faults.worker OUT_DIR``, the case as JSON
in ``CONVEYOR_FAULT`` (see tests/faults/__init__.py).

``app == "pipeline"``: a tied Transformer language model (embedding and head one
Parameter, on the first and the last stage), one stage per rank under 1F1B with two
micro-batches, ``Pipeline(timeout=T)``, three steps and, in the ``save`` phase, a
distributed checkpoint after step 2. ``app == "train"``: ``conveyor train`` itself on
the same model, checkpoints every step. Either way the fault is planted on one rank at
one place: forward (before a layer of its stage), backward (a gradient arriving at its
stage), the loss, a collective (before joining it), during a checkpoint save, or between
two steps. Each process writes ``rank{r}.json``: its steps, and the error it ended with
and when (wall clock); the faulty rank writes ``fault.json`` just before the fault. A
process ends as a user's script would: its error raised (exit 1).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import conveyor
from conveyor.distributed.faults import collective
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.train import saving
from conveyor.train.checkpoints import dcpfiles
from conveyor.train.language import summed_next_token_loss
from conveyor.train.models import transformer_lm
from tests.faults import REPLICAS, REPLICATED, stage_of

STEPS = 3


class Plant:
    """Where and when the fault fires: ``at(where, stage)`` is called at each place a
    fault may be planted; it fires once, on the case's rank, in the case's step."""

    def __init__(self, case: dict[str, Any], out: Path, rank: int) -> None:
        self.case, self.out = case, out
        self.rank = rank  # this process's (on threads, 0: every stage is here)
        self.stage = stage_of(case["launcher"], case["rank"])  # the faulty rank's
        self.step = 0  # the step running now, counted from 1
        self.fired = False
        self.fault_step = 1 if case["phase"] == "first" else 3

    def at(self, where: str, stage: int) -> None:
        here = self.case["launcher"] == "threads" or self.rank == self.case["rank"]
        if (not self.fired and where == self.case["where"] and stage == self.stage and here
                and self.step == self.fault_step):
            self.fire(where)

    def note(self, where: str) -> None:
        """Writes when and where the fault fires, and in which process."""
        self.fired = True
        (self.out / "fault.json").write_text(json.dumps(
            {"time": time.time(), "pid": os.getpid(), "where": where, "step": self.step}))

    def fire(self, where: str) -> None:
        self.note(where)
        fault = self.case["fault"]
        if fault == "raise":
            raise ValueError(f"planted failure in {where}")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault == "loop":
            end = time.monotonic() + 120
            while not (self.out / "release").exists() and time.monotonic() < end:
                sum(range(1000))
        if fault == "exit":  # a library's exit, or a user's, in the middle of it all
            os._exit(0)


def balance(world: int, launcher: str = "") -> list[int]:
    """Embedding and block 1 | a block per middle stage | the last block, norm and head;
    replicated: the first half of the layers | the second."""
    if launcher == REPLICATED:
        return [world, 3]
    return [2] + [1] * (world - 2) + [3]


def plant_layers(model: nn.Sequential, layout: list[int], plant: Plant) -> None:
    """Forward and backward fault points on each layer, knowing its stage."""
    stages = [s for s, n in enumerate(layout) for _ in range(n)]
    for index, layer in enumerate(model):
        stage = stages[index]

        def before(module: nn.Module, args: Any, stage: int = stage) -> None:
            if not conveyor.is_recomputing():
                plant.at("forward", stage)

        def after(module: nn.Module, args: Any, output: Any, stage: int = stage) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: (plant.at("backward", stage), grad)[1])

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)


def plant_collectives(rank: int, plant: Plant) -> None:
    """The collective fault point: before this rank joins any of the step's collectives."""
    for name in ("all_reduce", "broadcast"):
        original = getattr(collective, name)

        def join(*args: Any, original: Any = original, **options: Any) -> None:
            plant.at("collective", stage_of(plant.case["launcher"], rank))
            original(*args, **options)

        setattr(collective, name, join)


def run_pipeline(case: dict[str, Any], rank: int, world: int, out: Path,
                 record: dict[str, Any]) -> None:
    plant = Plant(case, out, rank)
    threads = case["launcher"] == "threads"
    torch.manual_seed(0)
    model = transformer_lm(world, 16, 32, 2, max_length=8, tie=True)
    layout = balance(world, case["launcher"])
    replicated = {"data_parallel": list(REPLICAS)} if case["launcher"] == REPLICATED else {}
    plant_layers(model, layout, plant)
    plant_collectives(rank, plant)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        plant.at("loss", len(layout) - 1)
        return summed_next_token_loss(logits, targets)

    if case.get("prelude") == "config":  # refused by every rank; then the case itself
        try:
            conveyor.Pipeline(copy.deepcopy(model), chunks=4 if rank == case["rank"] else 2,
                              schedule="1f1b", balance=layout, loss_fn=loss_fn,
                              timeout=case["timeout"], **replicated)
        except conveyor.ConfigError as exc:
            record["prelude"] = {"type": type(exc).__name__, "text": str(exc)}
    chunks = 4 if case["fault"] == "config" and rank == case["rank"] else 2
    pipe = conveyor.Pipeline(model, chunks=chunks, schedule="1f1b", balance=layout,
                             loss_fn=loss_fn, timeout=case["timeout"], **replicated,
                             **({"stages": world} if threads else {}))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for plant.step in range(1, STEPS + 1):
        if plant.step == plant.fault_step and case["phase"] == "between" \
                and rank == case["rank"]:
            if case["fault"] == "exit":
                plant.note("between")
                return  # a clean early exit: the process group destroyed, exit 0
            plant.fire("between")
        tokens = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(plant.step))
        loss = pipe.step(tokens, tokens)
        optimizer.step()
        pipe.zero_grad()
        record["steps"].append(float(loss))
        if plant.step == 2 and case["phase"] == "save":
            original = dcpfiles._write

            def write(tensors: dict[str, Any], target: Path) -> None:
                if rank == case["rank"]:
                    plant.fire("save")
                original(tensors, target)

            dcpfiles._write = write  # type: ignore[assignment]
            saving.save(out / "run", model=pipe, optimizer=optimizer, extra={"step": 2})


def run_train(case: dict[str, Any], rank: int, out: Path) -> None:
    """``conveyor train``, with the fault in its loss or in a save, in step 3."""
    from conveyor.cli import main
    from conveyor.pipeline import Pipeline
    from conveyor.train import setup
    from tests.support.training import TINY

    plant = Plant(case, out, rank)
    Deadlines.floor = case["timeout"]  # the fitted timeout of later steps, at least
    Deadlines.first = 2 * case["timeout"]  # start-up, steps 1-2
    stepping = Pipeline.step

    def step(self: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        plant.step += 1
        return stepping(self, inputs, targets)

    Pipeline.step = step  # type: ignore[method-assign]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        plant.at("loss", rank)
        return summed_next_token_loss(logits, targets)

    setup.summed_next_token_loss = loss_fn  # type: ignore[assignment]
    original = dcpfiles._write

    def write(tensors: dict[str, Any], target: Path) -> None:
        if case["where"] == "save" and plant.step == plant.fault_step and rank == case["rank"]:
            plant.fire("save")
        original(tensors, target)

    dcpfiles._write = write  # type: ignore[assignment]
    code = main(["train", *TINY, "--steps", "5", "--save-every", "1", "--eval-every", "5",
                 "--sample-bytes", "0", "--out", str(out / "run")])
    if code != 0:
        raise SystemExit(code)


class LauncherStop(BaseException):  # noqa: N818 - what happened, not an error of ours
    """torchrun's agent ended this worker (SIGTERM) once another worker had exited."""


def _stopped_by_launcher(number: int, frame: Any) -> None:
    raise LauncherStop(f"signal {number}")


def main() -> None:
    out = Path(sys.argv[1])
    signal.signal(signal.SIGTERM, _stopped_by_launcher)
    case: dict[str, Any] = json.loads(os.environ["CONVEYOR_FAULT"])
    torch.set_num_threads(1)
    threads = case["launcher"] == "threads"
    if threads:  # one process, every rank a thread: no process group
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)
    if not threads and case["app"] == "pipeline":
        init_file = os.environ.get("CONVEYOR_INIT_FILE")  # else env://, the group's
        dist.init_process_group("gloo", init_method=f"file://{init_file}" if init_file
                                else "env://")  # default timeout: 30 minutes, as users'
    rank = 0 if threads else int(os.environ["RANK"])
    world = case["world"]
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "steps": []}
    try:
        if case["app"] == "train":
            run_train(case, rank, out)
        else:
            run_pipeline(case, rank, world, out, record)
    except BaseException as exc:
        record["error"] = {"type": type(exc).__name__, "text": str(exc),
                           "where": getattr(exc, "where", None), "time": time.time()}
        raise
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
