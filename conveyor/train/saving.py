"""Saving and resuming training: weights, optimizer, step, random state, data position.

Checkpoints use the plain model's parameter names (a pipeline's state dict has exactly
those keys), and the optimizer's state is stored by parameter name rather than by
position, so a checkpoint written by 2 stages resumes on 4, or loads into the plain
model. A checkpoint is a directory of its own, ``checkpoint/step-00000012``, named the
newest by the pointer ``checkpoint/latest``::

    checkpoint/
      latest                 "step-00000012", replaced in one move once all is written
      step-00000008/         kept: the one before the newest
      step-00000012/
        state.pt             one process: the tensors (torch.save, read back with
                             weights_only=True); under torchrun, torch.distributed.checkpoint
                             files, read with a reader that unpickles nothing but its index
        manifest.json        checksums of every file and tensor, the metadata as JSON

Three promises, each kept by mechanism:

* **a save loses nothing**: it is written beside the newest and becomes the newest only
  once complete (a crash mid-write leaves the previous one as it was; a process killed
  mid-write also leaves a temporary, which :func:`remove_temporaries` clears); every
  file and the pointer are flushed to disk with their folder; the newest checkpoint is
  the newest verified step folder, whatever ``latest`` says
  (:mod:`~conveyor.train.checkpoints.folder`); retention keeps the newest two verified,
  and the newest with finite weights, and deletes nothing while the pointer disagrees
  with the folders; a state whose weights are not finite is refused, never written;
* **a damaged checkpoint is refused**: loading verifies the manifest, every file and
  every tensor, and names what changed;
* **loading runs no code**: tensors are read with ``weights_only=True``, metadata is
  JSON, and the distributed checkpoint's index is unpickled with an allow-list.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.train.checkpoints import dcpfiles, durable, folder, manifest
from conveyor.train.errors import CheckpointError, SaveError

__all__ = ["CheckpointError", "exists", "load", "load_optimizer_state", "load_weights",
           "pointer_note", "remove_temporaries", "save"]

_DIRECTORY = "checkpoint"
_STATE = "state.pt"
_KEEP = 2  # the newest checkpoints kept (and the newest finite one, if older)
# A save writes beside its final name first: "checkpoint/.step-<random>.tmp" in one
# process, "checkpoint/.latest.tmp" (the pointer) under either.
_TEMPORARY = (".step-", ".tmp")
_LEGACY = "checkpoint.pt"  # conveyor's first format: one pickled file


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def exists(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint (of any format conveyor wrote), or a step
    folder with a manifest (a damaged one is refused on resume, never started over)."""
    directory = Path(directory)
    root = directory / _DIRECTORY
    return (directory / _LEGACY).exists() or any(
        (p / manifest.MANIFEST).exists() for p in root.glob("step-*")
        if folder.is_name(p.name))


def pointer_note(directory: str | Path) -> str | None:
    """One line where ``checkpoint/latest`` in ``directory`` disagrees with the verified
    checkpoints (empty, damaged, outside the folder, stale), else None."""
    root = Path(directory) / _DIRECTORY
    if not root.is_dir():
        return None
    found = folder.newest(root)
    return found.note if found.name is not None else None


def save(directory: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any]) -> Path:
    """Writes a checkpoint of ``model`` and ``optimizer`` (and ``extra``, plain values
    and tensors) into ``directory``; it becomes the newest once wholly written.

    Returns:
        The checkpoint's directory.

    Raises:
        SaveError: the weights or the optimizer's state are not finite (or a buffer holds
            NaN): nothing is written, the previous checkpoint is intact.
        OSError: the checkpoint could not be written (a full disk, ...); the previous
            one is intact, and no temporary file is left behind.
    """
    directory = Path(directory)
    root = directory / _DIRECTORY
    root.mkdir(parents=True, exist_ok=True)
    tensors, meta = _state(model, optimizer, extra)
    step = int(extra.get("step", 0))
    poisoned = manifest.not_finite(tensors, {name for name, _ in model.named_buffers()})
    if _distributed():
        poisoned = dcpfiles.poisoned_anywhere(poisoned, model)
    if poisoned:
        raise SaveError(f"refusing to save the checkpoint of step {step}: "
                        f"{', '.join(poisoned[:3])}{' ...' if len(poisoned) > 3 else ''} "
                        "not finite; the previous checkpoint is intact")
    if _distributed():
        target = dcpfiles.save(root, tensors, meta, model, step)
    else:
        target = _save_file(root, step, tensors, meta)
    if not _distributed() or dist.get_rank() == 0:
        _retain(root)
    if _distributed():
        dcpfiles.barrier(model, "the barrier after a checkpoint's pointer")
    return target


def _save_file(root: Path, step: int, tensors: dict[str, Any], meta: Any) -> Path:
    prefix, suffix = _TEMPORARY
    temporary = Path(tempfile.mkdtemp(dir=root, prefix=prefix, suffix=suffix))
    try:
        with open(temporary / _STATE, "wb") as file:
            _write_tensors(tensors, file)
            file.flush()
            os.fsync(file.fileno())  # on disk before it takes the name
        manifest.write(temporary, step=step, finite=True, meta=meta,
                       tensors=manifest.digests(tensors))
        target = root / manifest.new_name(root, step)[0]
        durable.replace(temporary, target)
        folder.point_to(root, target.name)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)
    return target


def _write_tensors(tensors: dict[str, Any], file: Any) -> None:
    """``torch.save`` into ``file``; a failed write is its ``OSError`` (torch's zip writer
    raises a RuntimeError in its ``__exit__`` after the write's ``OSError``).

    Raises:
        OSError: the write failed (a full disk, ...).
    """
    try:
        torch.save(tensors, file)
    except RuntimeError as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise cause from exc


def _retain(root: Path) -> None:
    """Removes the verified checkpoints older than the newest verified one that none of
    the rules keeps: the newest ``_KEEP`` and the newest whose weights are finite.
    Nothing is removed while ``latest`` disagrees with the folders: that is a state to
    look at, not to tidy."""
    found = folder.newest(root)
    if found.name is None or not found.agrees:
        return
    names = folder.verified(root)
    keep = set(names[-_KEEP:]) | {found.name}
    for name in reversed(names):
        try:
            if manifest.read(root / name)["finite"]:
                keep.add(name)
                break
        except CheckpointError:
            continue
    newest = manifest.order(found.name)
    for name in names:
        if name not in keep and manifest.order(name) < newest:
            shutil.rmtree(root / name, ignore_errors=True)


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Removes what saves into ``directory`` killed midway left behind (a crash or an
    error removes its own). Call it only while no save into ``directory`` runs: it
    would take that save's files away.

    Returns:
        The files and directories removed, sorted.
    """
    root = Path(directory) / _DIRECTORY
    prefix, suffix = _TEMPORARY
    stale = sorted([*root.glob(f"{prefix}*{suffix}"), *root.glob(manifest.POINTER_TEMPORARY)])
    latest = _latest_directory(Path(directory))
    stale += sorted(p for p in root.glob("step-*") if p.is_dir() and p != latest
                    and folder.is_name(p.name)
                    and not (p / manifest.MANIFEST).exists())  # a save killed before its end
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def load(directory: str | Path, *, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Loads the newest checkpoint in ``directory`` into ``model`` (and ``optimizer``),
    verified against its manifest.

    Returns:
        The ``extra`` that was saved with it.

    Raises:
        CheckpointError: there is none, it is damaged (naming the file and tensor), it
            cannot be read, or it does not fit the model.
    """
    target, found = _verified_latest(Path(directory))
    _check_kind(target)
    meta = manifest.from_json(found["meta"])
    if _distributed():
        tensors, values = dcpfiles.load(target, found, model, optimizer)
        meta["optimizer"]["values"] = values
    else:
        tensors = _read_verified(target, found)
        manifest.check_fits({k: v.shape for k, v in tensors["model"].items()}, model, target,
                            partial=False)
    model.load_state_dict(tensors["model"])
    if optimizer is not None:
        _load_optimizer_state(model, optimizer, tensors.get("optimizer", {}), meta["optimizer"])
    return dict(meta["extra"])


def _check_kind(target: Path) -> None:
    """Raises CheckpointError where the checkpoint in ``target`` was written by the
    other kind of launch than this one (torchrun's files in one process, or the reverse)."""
    ranks = len(list(target.glob("rank-*.json")))
    if not _distributed() and ranks and not (target / _STATE).exists():
        raise CheckpointError(
            f"the checkpoint {target} was written under torchrun by {ranks} process"
            f"{'es' * (ranks > 1)}; resume it with `torchrun --nproc-per-node {ranks}` "
            "(any number of processes loads it)")
    if _distributed() and (target / _STATE).exists():
        raise CheckpointError(
            f"the checkpoint {target} was written by one process; resume it without "
            "torchrun (conveyor train --resume ...)")


def load_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The weights of the newest checkpoint (either kind) by plain-model name, verified,
    for any model."""
    weights: dict[str, torch.Tensor] = _load_part(Path(directory), "model")
    return weights


def load_optimizer_state(directory: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's tensors of the newest checkpoint (either kind), verified, by
    plain-model parameter name, then by the optimizer's own key (Adam's ``exp_avg``,
    ``exp_avg_sq``, ``step``): each whole, whatever shape of pipeline, tensor and data
    ranks wrote it. Empty before the first step."""
    moments: dict[str, dict[str, torch.Tensor]] = _load_part(Path(directory), "optimizer")
    return moments


def _load_part(directory: Path, part: str) -> dict[str, Any]:
    target, found = _verified_latest(directory)
    if (target / _STATE).exists():
        whole: dict[str, Any] = _read_verified(target, found).get(part, {})
        return whole
    return dcpfiles.load_whole(target, found, part)


def _verified_latest(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The newest verified checkpoint and its manifest.

    Raises:
        CheckpointError: there is none: the first format, a damaged manifest (read
            again to name the damage), or nothing.
    """
    target = _latest_directory(directory)
    if target is None:
        if (directory / _LEGACY).exists():
            manifest.read(directory)  # raises: the first format, which has none
        for candidate in sorted((p for p in (directory / _DIRECTORY).glob("step-*")
                                 if folder.is_name(p.name)),
                                key=lambda p: manifest.order(p.name), reverse=True):
            if (candidate / manifest.MANIFEST).exists():
                manifest.check_files(candidate, manifest.read(candidate))  # raises
        raise CheckpointError(f"no checkpoint in {directory}")
    return target, manifest.read(target)


def _read_verified(target: Path, found: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a one-process checkpoint, every file and tensor verified."""
    damaged = manifest.check_files(target, found)
    try:
        tensors = torch.load(target / _STATE, map_location="cpu", weights_only=True)
    except Exception as exc:
        if damaged:
            manifest.check_tensors(target, {}, found["tensors"], damaged)
        raise CheckpointError(f"cannot read the checkpoint {target / _STATE}: "
                              f"{manifest.first_line(exc)}") from exc
    manifest.check_tensors(target, tensors, found["tensors"], damaged)
    return dict(tensors)


def _latest_directory(directory: Path) -> Path | None:
    """The newest verified checkpoint in ``directory``, if any (not the pointer's)."""
    name = folder.newest(directory / _DIRECTORY).name
    return directory / _DIRECTORY / name if name else None


# -- the state, and optimizer state by parameter name --------------------------------

def _state(model: nn.Module, optimizer: torch.optim.Optimizer,
           extra: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """What a checkpoint holds: the tensors (the model's, the optimizer's by parameter
    name) and the rest as JSON data (``extra``, the optimizer's hyper-parameters and its
    values that are not tensors)."""
    order = manifest.aliases(model, optimizer)
    saved = optimizer.state_dict()
    values = {name: {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
              for index, state in saved["state"].items() for name in order[index]}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [order[i][0] for i in group["params"]]}
              for group in saved["param_groups"]]
    meta = manifest.to_json({"extra": extra,
                             "optimizer": {"param_groups": groups, "values": values}})
    return {"model": model.state_dict(),
            "optimizer": manifest.optimizer_tensors(model, optimizer)}, meta


def _load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                          tensors: dict[str, dict[str, torch.Tensor]],
                          saved: dict[str, Any]) -> None:
    current = optimizer.state_dict()
    state = {}
    for index, aliases in enumerate(manifest.aliases(model, optimizer)):
        found = [name for name in aliases if name in tensors or name in saved["values"]]
        if found:
            state[index] = {**saved["values"].get(found[0], {}), **tensors.get(found[0], {})}
    groups = [{**saved_group, "params": group["params"]}
              for saved_group, group in zip(saved["param_groups"], current["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
