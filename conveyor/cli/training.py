"""``conveyor train`` as a command: its options read, the run started, and its errors
as one line on stderr with the documented exit code."""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from conveyor.distributed.faults.collective import exchange
from conveyor.distributed.watch import end_process_group
from conveyor.errors import ConfigError, ConveyorError
from conveyor.train import saving
from conveyor.train.loop import run
from conveyor.train.options import allowed_changes, from_arguments
from conveyor.train.progress import verbose

__all__: list[str] = []


def train_command(args: argparse.Namespace) -> int:
    """``conveyor train``: errors end it with one line on stderr and a non-zero code: 2
    for options or an ``--out`` that cannot be used (nothing written), 1 for a failure
    on the way (a stage, a peer, a save that the disk refused). Under torchrun the
    process group's teardown is bounded: a collective left inside the backend by a
    frozen rank does not hold the exit."""
    code = 1
    try:
        code = _run_command(args)
    finally:
        end_process_group(code)
    return code


def _after_rank_0_said_it(seconds: float = 5.0) -> None:
    """Waits (at most ``seconds``) until every rank, rank 0 among them, has reached the
    refusal: torchrun ends the others when one rank exits, and rank 0, which alone says
    why, must not be ended before it has."""
    try:
        exchange(None, group=dist.group.WORLD, what="the refusal", seconds=seconds)
    except (ConveyorError, RuntimeError):  # a rank that refused alone: nothing to wait for
        pass


def _run_command(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    try:
        with verbose(getattr(args, "verbose", False)):
            return run(from_arguments(args), resume=args.resume,
                       check=getattr(args, "check", False),
                       allow_change=allowed_changes(getattr(args, "allow_change", "")))
    except (ConfigError, saving.CheckpointError) as exc:
        # Once the group exists every rank has read the same options and checkpoint;
        # before it, a rank's own refusal (its --out) may be its alone: it says so.
        if rank == 0 or not dist.is_initialized():
            where = f" (rank {rank})" if rank else ""
            print(f"conveyor train: error{where}: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            _after_rank_0_said_it()
        return 2
    except ConveyorError as exc:
        where = f" (rank {rank})" if dist.is_initialized() else ""
        text = str(exc).replace("raise timeout=", "raise --timeout")  # the flag here
        print(f"conveyor train: error{where}: {text}", file=sys.stderr)
        report = getattr(exc, "where", None)  # where every rank stood, when a step failed
        if report:
            print(report, file=sys.stderr)
        return 1
