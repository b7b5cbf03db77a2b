"""Checkpoints under torchrun: torch.distributed.checkpoint, bounded, verified, and read
without running code.

Each rank writes the tensors of its own stages (a sharded one, its shards; a
tensor-parallel one, its parts of whole tensors: :mod:`.tensorshards`) with
``torch.distributed.checkpoint`` (DCP), and a ``rank-<r>.json`` of their checksums and
of its optimizer's values that are not tensors; once every rank has written, rank 0
hashes the files into the manifest and moves the ``latest`` pointer.

DCP's reader unpickles its index (``.metadata``) with ``pickle.load`` and reads objects
that are not tensors with ``torch.load(weights_only=False)``: both would run code from a
forged checkpoint. Here the index is read with an unpickler that builds only DCP's own
index classes, and nothing but tensors is ever written or read.

Every collective of a save waits at most the pipeline's opening timeout: a rank killed
or frozen in a save is named, not waited for for 30 minutes.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import pickle
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.train.checkpoints import durable, folder, manifest, tensorshards
from conveyor.train.errors import CheckpointError

__all__: list[str] = []

_INDEX = ".metadata"  # DCP's index file


def _rank_file(rank: int) -> str:
    return f"rank-{rank}.json"


def save(root: Path, tensors: dict[str, Any], meta: Any, model: nn.Module, step: int) -> Path:
    """Writes this rank's part of the checkpoint of ``step``; rank 0 makes it the newest
    once every rank has written. Returns its directory.

    Raises:
        OSError: a write failed (on this rank or, gathered by DCP, another).
        PeerFailure: another rank failed or went silent during the save.
    """
    rank = dist.get_rank()
    tensors = tensorshards.as_whole(tensors, model)  # a shard: its part of the whole
    # Every rank names it from the folder before any writes into it: they agree.
    suffix = torch.tensor([manifest.new_name(root, step)[1]])
    _all_reduce(model, suffix, "the agreement on a checkpoint's name", dist.ReduceOp.MAX)
    name = manifest.name_of(step, int(suffix))
    target = root / name  # never an existing name: a save never writes into another
    try:
        barrier(model, "the barrier before a checkpoint's writes")
        _bounded(lambda: _write(tensors, target), model, f"the checkpoint {name}")
        own = {"tensors": manifest.digests(tensors),
               "values": meta["optimizer"]["values"]}
        durable.write_bytes(target / _rank_file(rank), json.dumps(own).encode())
        barrier(model, "the barrier after a checkpoint's writes")
    except Exception as exc:
        _discard(target, rank)
        _failed_save(exc, model, name)
        raise
    if rank == 0:
        manifest.write(target, step=step, finite=True, meta=meta, tensors={})
        folder.point_to(root, name)
    return target


def _discard(target: Path, rank: int) -> None:
    """What a failed save of this rank leaves: rank 0 removes the folder (it has no
    manifest: never a checkpoint); any other rank removes its own files (dcp's
    ``__<rank>_*.distcp`` and its digests), then the folder if that empties it. Rank 0
    may have removed the folder, and exited, while this rank's writes went on into it.
    Nothing is removed from a folder that has a manifest: a rank whose barrier gave up
    as rank 0's completed must not take a committed checkpoint apart."""
    if (target / manifest.MANIFEST).exists():
        return
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        return
    for path in [*target.glob(f"__{rank}_*.distcp"), target / _rank_file(rank)]:
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: another rank's files remain
        target.rmdir()


def _write(tensors: dict[str, Any], target: Path) -> None:
    dcp.save(tensors, checkpoint_id=str(target))


def load(target: Path, found: dict[str, Any], model: nn.Module,
         optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's tensors of the checkpoint in ``target`` (its stages' weights, and the
    optimizer's state by parameter name), and the optimizer's other values, verified.

    Raises:
        CheckpointError: it is damaged, cannot be read, or does not fit the model.
    """
    damaged = manifest.check_files(target, found)
    digests, values = _rank_files(target)
    index = _read_index(target)
    # Each rank holds only its stages' weights: it checks those (the same files for all
    # ranks, so they all raise or none does, and no rank waits in dcp.load alone).
    manifest.check_fits({k[len("model."):]: v.size for k, v in index.items()
                         if k.startswith("model.") and hasattr(v, "size")}, model, target,
                        partial=True)
    template: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        if not optimizer.state:
            _materialize_optimizer_state(optimizer)
        template["optimizer"] = {  # what was saved (none before the first step)
            name: kept for name, state in manifest.optimizer_tensors(model, optimizer).items()
            if (kept := {key: t for key, t in state.items()
                         if f"optimizer.{name}.{key}" in index})}
    template = tensorshards.as_whole(template, model)  # a shard reads its part
    try:
        dcp.load(template, storage_reader=_Reader(str(target)), planner=_Planner())
    except (Exception, dcp.api.CheckpointException) as exc:  # the latter is a BaseException
        if damaged:
            manifest.check_tensors(target, {}, digests, damaged)
        raise CheckpointError(f"cannot load the checkpoint {target}: "
                              f"{manifest.first_line(exc)}") from exc
    manifest.check_tensors(target, template, digests, damaged)
    return tensorshards.as_local(template, model), values


def load_whole(target: Path, found: dict[str, Any], part: str) -> dict[str, Any]:
    """One part of the checkpoint in ``target`` (``"model"``: the weights by name;
    ``"optimizer"``: the optimizer's tensors by parameter name, then by their own key),
    every tensor whole, read and verified in this one process."""
    damaged = manifest.check_files(target, found)
    digests, _ = _rank_files(target)
    metadata = _Reader(str(target)).read_metadata()
    template: dict[str, Any] = {part: {}}
    for key, entry in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(key, tuple(key.split(".", 1)))
        if path[0] != part or not hasattr(entry, "size"):
            continue
        place = template
        for step in path[:-1]:
            place = place.setdefault(step, {})
        place[path[-1]] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(template, storage_reader=_Reader(str(target)), planner=_Planner(),
                     no_dist=True)
    except (Exception, dcp.api.CheckpointException) as exc:
        if damaged:
            manifest.check_tensors(target, {}, digests, damaged)
        raise CheckpointError(f"cannot load the checkpoint {target}: "
                              f"{manifest.first_line(exc)}") from exc
    manifest.check_tensors(target, template, digests, damaged)
    whole: dict[str, Any] = template[part]
    return whole


def _rank_files(target: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The ranks' checksums of their tensors, and their optimizers' values, merged
    (replicas wrote the same)."""
    digests: dict[str, str] = {}
    values: dict[str, Any] = {}
    for path in sorted(target.glob("rank-*.json")):
        own = json.loads(path.read_text())
        digests.update(own["tensors"])
        values.update(manifest.from_json(own["values"]))
    return digests, values


# ------------------------------------------------------------------ reading no code

#: What DCP's index may hold: its own classes, torch's sizes, types and layouts, paths.
_INDEX_CLASSES = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata",)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INDEX_CLASSES or module in _INDEX_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"the checkpoint's index asks for {module}.{name}, which a "
                              "checkpoint's index never holds; it was not written by "
                              "torch.distributed.checkpoint (forged?), and is not loaded")


def _read_index(target: Path) -> dict[str, Any]:
    """DCP's index of the checkpoint in ``target``: each key's size and type."""
    metadata = _Reader(str(target)).read_metadata()
    return dict(metadata.state_dict_metadata)


class _Reader(FileSystemReader):
    """DCP's file reader, whose index is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / _INDEX
        try:
            metadata = _IndexUnpickler(io.BytesIO(path.read_bytes())).load()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read the checkpoint's index {path}: "
                                  f"{manifest.first_line(exc)}") from exc
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Planner(DefaultLoadPlanner):
    """DCP's planner, refusing objects that are not tensors (it would unpickle them
    with ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"the checkpoint holds an object at {read_item.dest_index.fqn}, "
                              "where conveyor writes only tensors; it is not loaded "
                              "(unpickling it could run code)")


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's state (moments, steps) so that loading has a template:
    one step on zero gradients at zero learning rate, which changes no weight."""
    rates = [group["lr"] for group in optimizer.param_groups]
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p, _ in grads:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    for p, grad in grads:
        p.grad = grad


# ------------------------------------------------------------------ bounded waits

def poisoned_anywhere(poisoned: list[str], model: nn.Module) -> list[str]:
    """``poisoned`` (this rank's tensors that are not finite), or, if another rank found
    some, a line saying so: every rank refuses the save alike."""
    flag = torch.tensor([float(bool(poisoned))])
    _all_reduce(model, flag, "the agreement that a checkpoint's weights are finite",
                dist.ReduceOp.MAX)
    return poisoned or (["weights of another rank"] if float(flag) else [])


def barrier(model: nn.Module, what: str) -> None:
    """Every process here before any goes on, waiting at most the pipeline's opening
    timeout (a rank killed or frozen in a save is named, not waited for 30 minutes)."""
    _all_reduce(model, torch.zeros(1), what, dist.ReduceOp.SUM)


def _all_reduce(model: nn.Module, tensor: torch.Tensor, what: str, op: Any) -> None:
    """A bounded all-reduce over every rank: the pipeline's opening deadline, or (a model
    of another kind) every pipeline's first."""
    from conveyor.distributed.faults import collective

    timeouts = getattr(model, "timeouts", None)
    seconds = timeouts.opening if timeouts is not None else Deadlines.first
    collective.all_reduce(tensor, group=None, what=what, seconds=seconds, op=op)


_stuck: list[threading.Thread] = []  # saves that never came back (a rank froze in one)


def _bounded(write: Any, model: nn.Module, what: str) -> None:
    """``write()`` (dcp's save, whose collectives wait as long as the process group's
    timeout) on a thread, waited for at most the pipeline's opening timeout.

    Raises:
        RuntimeError: it did not end in time (a rank froze in the save).
    """
    timeouts = getattr(model, "timeouts", None)
    if timeouts is None:
        write()
        return
    failed: list[BaseException] = []

    def run() -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True, name="conveyor-save")
    thread.start()
    thread.join(timeouts.opening)
    if thread.is_alive():
        _stuck.append(thread)
        # Not a TimeoutError: that is an OSError, which a caller takes for a failed write.
        raise RuntimeError(f"{what} timed out after {timeouts.opening:g} s")
    if failed:
        raise failed[0]


@atexit.register
def _exit_past_a_stuck_save() -> None:
    """A save left inside gloo would come back into a finalized interpreter and abort
    the process: end it now, with 1 (its error was printed)."""
    if any(thread.is_alive() for thread in _stuck):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _failed_save(exc: Exception, model: nn.Module, name: str) -> None:
    """Names the rank behind a distributed save that failed on this rank: the failure a
    rank announced, else the rank that no longer answers (killed, frozen); this rank's
    own error is announced for the others. A write that failed (an OSError) is left to
    the caller.

    Raises:
        PeerFailure: another rank failed or went silent during the save.
        ConveyorError: this rank's own error (its cause), once announced.
    """
    from conveyor.distributed.faults.explain import own_report
    from conveyor.distributed.faults.peerfailure import first_line, reported, timed_out
    from conveyor.errors import ConveyorError, PeerFailure

    runtime = getattr(model, "runtime", None)
    whereabouts = getattr(getattr(runtime, "wiring", None), "whereabouts", None)  # ranks
    if whereabouts is None or _write_failure_of(exc):
        return
    rank, step = dist.get_rank(), runtime.transport.step  # type: ignore[union-attr]
    notice = whereabouts.notice(step)
    if notice is not None and notice["rank"] != rank:
        raise reported(notice, rank, f"stopped in the checkpoint {name}") from exc
    lost = isinstance(exc, PeerFailure) or timed_out(exc) or any(
        word in str(exc) for word in ("Connection", "closed", "reset"))
    if not lost:  # this rank's own error: tell the others first
        whereabouts.announce(step, own_report(exc, rank))
        raise ConveyorError(f"the checkpoint {name} failed on rank {rank}: "
                            f"{type(exc).__name__}: {first_line(exc)}; the previous "
                            "checkpoint is intact") from exc
    snapshots = whereabouts.gather(runtime.executor.runs, 3.0, set())  # type: ignore[union-attr]
    silent = [r for r, snapshot in snapshots.items() if snapshot is None]
    named = (f"rank {silent[0]} did not answer (killed, frozen, or stuck outside Python)"
             if silent else "no rank said why")
    failure = PeerFailure(f"rank {rank} could not finish the checkpoint {name}: {named} "
                          f"({first_line(exc)}); the previous checkpoint is intact",
                          stage=-1, microbatch=-1, action="save")
    failure.report = {"rank": silent[0] if silent else None, "stage": -1, "microbatch": -1,
                      "action": "save", "silent": "closed", "error": first_line(exc)}
    raise failure from exc


def _write_failure_of(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write (an OSError, or dcp's gathered errors)."""
    if isinstance(exc, OSError):
        return True
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return False
    return isinstance(exc, CheckpointException)
