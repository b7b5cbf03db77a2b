"""Saving and resuming training: weights, optimizer, step, random state, data position.

Checkpoints use the plain model's parameter names (a pipeline's state dict has exactly
those keys), and the optimizer's state is stored by parameter name rather than by
position, so a checkpoint written by 2 stages resumes on 4, or loads into the plain
model. Writes are atomic: in one process a file is written beside its final name and
moved into place; under torchrun each save is a torch.distributed.checkpoint directory
and a ``latest`` pointer is replaced once every rank has written. A crash mid-write
leaves the previous checkpoint as it was; a process killed mid-write also leaves its
temporary file, which :func:`remove_temporaries` clears.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.train.errors import CheckpointError

__all__ = ["CheckpointError", "exists", "load", "load_weights", "remove_temporaries", "save"]

_FILE = "checkpoint.pt"
_DIRECTORY = "checkpoint"
# A save writes beside its final name first: ".checkpoint-<random>.tmp" in one process,
# "checkpoint/.latest.tmp" (the pointer) under torchrun.
_TEMPORARY = (".checkpoint-", ".tmp")
_POINTER_TEMPORARY = ".latest.tmp"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def exists(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint (either kind)."""
    directory = Path(directory)
    return (directory / _FILE).exists() or _latest_directory(directory) is not None


def save(directory: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any]) -> Path:
    """Writes a checkpoint of ``model`` and ``optimizer`` (and ``extra``) into ``directory``.

    Returns:
        The path of the checkpoint (a file, or under torchrun a directory).

    Raises:
        OSError: the checkpoint could not be written (a full disk, ...); the previous
            one is intact, and no temporary file is left behind.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": _optimizer_state(model, optimizer),
             "extra": extra}
    if not _distributed():
        path = directory / _FILE
        prefix, suffix = _TEMPORARY
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())  # on disk before it takes the name
            os.replace(temporary, path)  # atomic: the old file until this very moment
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        return path
    import torch.distributed.checkpoint as dcp

    root = directory / _DIRECTORY
    target = root / f"step-{int(extra.get('step', 0)):08d}"
    if dist.get_rank() == 0 and target.exists() and target != _latest_directory(directory):
        shutil.rmtree(target)  # a save of this step killed midway (at any world size)
    try:
        _barrier(model, "the barrier before a checkpoint's writes")
        _bounded(lambda: dcp.save(_flatten_for_dcp(state), checkpoint_id=str(target)),
                 model, f"the checkpoint {target.name}")
        _barrier(model, "the barrier after a checkpoint's writes")
    except Exception as exc:
        _failed_save(exc, model, target.name)
        raise
    if dist.get_rank() == 0:
        pointer = root / _POINTER_TEMPORARY
        pointer.write_text(target.name)
        os.replace(pointer, root / "latest")
        kept = sorted(p.name for p in root.glob("step-*"))[-2:]  # the newest two
        for old in root.glob("step-*"):
            if old.name < target.name and old.name not in kept:
                shutil.rmtree(old)
    _barrier(model, "the barrier after a checkpoint's pointer")
    return target


def _failed_save(exc: Exception, model: nn.Module, name: str) -> None:
    """Names the rank behind a distributed save that failed on this rank: the failure a
    rank announced, else the rank that no longer answers (killed, frozen); this rank's
    own error is announced for the others. A write that failed (an OSError) is left to
    the caller.

    Raises:
        PeerFailure: another rank failed or went silent during the save.
        ConveyorError: this rank's own error (its cause), once announced.
    """
    from conveyor.distributed.explain import own_report
    from conveyor.distributed.peerfailure import first_line, reported, timed_out
    from conveyor.errors import ConveyorError, PeerFailure

    runtime = getattr(model, "runtime", None)
    whereabouts = getattr(runtime, "whereabouts", None)
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


def _barrier(model: nn.Module, what: str) -> None:
    """Every process here before any goes on, waiting at most the pipeline's opening
    timeout (a rank killed or frozen in a save is named, not waited for 30 minutes)."""
    timeouts = getattr(model, "timeouts", None)
    if timeouts is None:
        dist.barrier()
        return
    from conveyor.distributed import collective

    collective.all_reduce(torch.zeros(1), group=None, what=what, seconds=timeouts.opening)


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Removes the temporary files that saves into ``directory`` killed midway left
    behind (a crash or an error removes its own). Call it only while no save into
    ``directory`` runs: it would take that save's file away.

    Returns:
        The files removed, sorted.
    """
    directory = Path(directory)
    prefix, suffix = _TEMPORARY
    stale = sorted([*directory.glob(f"{prefix}*{suffix}"),
                    *directory.glob(f"{_DIRECTORY}/{_POINTER_TEMPORARY}")])
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def load(directory: str | Path, *, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Loads the latest checkpoint in ``directory`` into ``model`` (and ``optimizer``).

    Returns:
        The ``extra`` that was saved with it.

    Raises:
        CheckpointError: there is none, it cannot be read, or it does not fit the model.
    """
    directory = Path(directory)
    if _distributed():
        state = _load_dcp(directory, model, optimizer)
    else:
        path, state = _read_file(directory)
        _check_fits({k: v.shape for k, v in state["model"].items()}, model, path,
                    partial=False)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        _load_optimizer_state(model, optimizer, state["optimizer"])
    return dict(state.get("extra", {}))


def load_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint (either kind) by plain-model name, for any model."""
    directory = Path(directory)
    target = _latest_directory(directory)
    if target is not None:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            converted = Path(scratch) / "weights.pt"
            dcp_to_torch_save(str(target), str(converted))
            saved = torch.load(converted, map_location="cpu", weights_only=False)
        if isinstance(saved.get("model"), dict):
            return dict(saved["model"])
        # Older torch versions leave the keys flattened as "model.<name>".
        return {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    weights: dict[str, torch.Tensor] = _read_file(directory)[1]["model"]
    return weights


def _read_file(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The single-process checkpoint in ``directory`` (or at that path), checked."""
    path = directory / _FILE if directory.is_dir() else directory
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: "
                              f"{_first_line(exc)}") from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a conveyor checkpoint (it has no 'model' "
                              "entry); saving.save writes them")
    return path, state


def _latest_directory(directory: Path) -> Path | None:
    """The newest complete torch.distributed.checkpoint save in ``directory``, if any."""
    pointer = directory / _DIRECTORY / "latest"
    return directory / _DIRECTORY / pointer.read_text().strip() if pointer.exists() else None


# -- optimizer state by parameter name ---------------------------------------------

def _aliases(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Every name of each of the optimizer's parameters, in its order: a tied one (the
    plain model's shared embedding and head) has several, which a pipeline holds as
    separate copies."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    order = _aliases(model, optimizer)
    saved = optimizer.state_dict()
    return {
        "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                          "params": [order[i][0] for i in group["params"]]}
                         for group in saved["param_groups"]],
        "state": {name: value for i, value in saved["state"].items() for name in order[i]},
    }


def _load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                          saved: dict[str, Any]) -> None:
    current = optimizer.state_dict()
    state = {}
    for index, aliases in enumerate(_aliases(model, optimizer)):
        found = [saved["state"][name] for name in aliases if name in saved["state"]]
        if found:
            state[index] = found[0]
    groups = [{**saved_group, "params": group["params"]}
              for saved_group, group in zip(saved["param_groups"], current["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- torch.distributed.checkpoint ----------------------------------------------------

def _flatten_for_dcp(state: dict[str, Any]) -> dict[str, Any]:
    """DCP reads back only the keys a template already has: tensors go by name, the rest
    (hyperparameters, step, random state) in one pickled blob, the same on every rank."""
    blob = io.BytesIO(pickle.dumps({"extra": state["extra"],
                                    "param_groups": state["optimizer"]["param_groups"]}))
    return {"model": state["model"], "optimizer_state": state["optimizer"]["state"],
            "meta": blob}


def _materialize_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
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


def _load_dcp(directory: Path, model: nn.Module,
              optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    target = _latest_directory(directory)
    if target is None:
        raise CheckpointError(f"no checkpoint at {directory / _DIRECTORY}")
    try:
        saved = dcp.FileSystemReader(str(target)).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"cannot read the checkpoint {target}: "
                              f"{_first_line(exc)}") from exc
    # Each rank holds only its stages' weights: it checks those (the same files for all
    # ranks, so they all raise or none does, and no rank waits in dcp.load alone).
    _check_fits({k[len("model."):]: v.size for k, v in saved.items()
                 if k.startswith("model.") and hasattr(v, "size")}, model, target, partial=True)
    template: dict[str, Any] = {"model": model.state_dict(), "meta": io.BytesIO()}
    if optimizer is not None:
        if not optimizer.state:
            _materialize_optimizer_state(model, optimizer)
        template["optimizer_state"] = _optimizer_state(model, optimizer)["state"]
    try:
        dcp.load(template, checkpoint_id=str(target))
    except (Exception, dcp.api.CheckpointException) as exc:  # the latter is a BaseException
        raise CheckpointError(f"cannot load the checkpoint {target}: "
                              f"{_first_line(exc)}") from exc
    template["meta"].seek(0)
    meta = pickle.load(template["meta"])
    return {"model": template["model"], "extra": meta["extra"],
            "optimizer": {"state": template.get("optimizer_state", {}),
                          "param_groups": meta["param_groups"]}}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _check_fits(saved: dict[str, torch.Size], model: nn.Module, where: Path, *,
                partial: bool) -> None:
    """Raises CheckpointError naming the weights that ``model`` lacks, has in another
    shape, or (unless the model holds only some stages) that it does not have."""
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    problems = [f"{name} is {tuple(saved[name])} in the checkpoint but {tuple(shape)} here"
                for name, shape in expected.items()
                if name in saved and saved[name] != shape]
    missing = [name for name in expected if name not in saved]
    unexpected = [] if partial else [name for name in saved if name not in expected]
    if missing:
        problems.append(f"{len(missing)} weights missing ({', '.join(missing[:3])}...)")
    if unexpected:
        problems.append(f"{len(unexpected)} weights it does not have "
                        f"({', '.join(unexpected[:3])}...)")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3
                                           else "")
        raise CheckpointError(f"the checkpoint {where} does not fit this model: {shown}; "
                              "was it written for a model of another size?")
