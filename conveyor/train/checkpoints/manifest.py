"""What a checkpoint says of itself, so that a damaged or forged one is refused; and the
folder of checkpoints (names, the ``latest`` pointer).

Every checkpoint directory holds a ``manifest.json``, written last (before the pointer
that makes the checkpoint the newest): the SHA-256 of every file beside it and of every
tensor by name, whether its weights are finite, and its metadata (the step, the history,
the optimizer's hyper-parameters, the random state) as JSON, never as a pickle, so that
reading it runs no code. The manifest carries the SHA-256 of its own content too.

Loading checks the manifest, then each file, then each tensor it read: a flipped bit is
an error that names the file and, where it can, the tensor.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.train.checkpoints import durable, tensorshards
from conveyor.train.errors import CheckpointError

__all__: list[str] = []

MANIFEST = "manifest.json"
FORMAT = 2  # 1: conveyor's first checkpoints, pickled, without a manifest
_CHUNK = 1 << 22  # bytes read at a time when hashing a file


# ------------------------------------------------------------------ JSON, not pickle

def to_json(value: Any) -> Any:
    """``value`` (dicts, lists, tuples, numbers, strings, None, tensors) as JSON data;
    tensors (a random generator's state) as tagged base64 of their bytes."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return {"__tensor__": {"dtype": str(data.dtype).removeprefix("torch."),
                               "shape": list(data.shape),
                               "bytes": base64.b64encode(_bytes_of(data)).decode()}}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: to_json(v) for k, v in value.items()}
        return {"__pairs__": [[to_json(k), to_json(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a checkpoint's metadata holds plain values and tensors, not "
                    f"{type(value).__name__} ({value!r:.60})")


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json` (tuples come back as lists)."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            spec = value["__tensor__"]
            dtype = getattr(torch, spec["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"a tensor of unknown type {spec['dtype']!r}")
            raw = bytearray(base64.b64decode(spec["bytes"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else \
                torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(spec["shape"]).clone()
        if "__pairs__" in value:
            return {from_json(k): from_json(v) for k, v in value["__pairs__"]}
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


# ------------------------------------------------------------------ checksums

def _bytes_of(tensor: torch.Tensor) -> bytes:
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return data.view(torch.uint8).numpy().tobytes() if data.numel() else b""


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's type, shape and bytes."""
    h = hashlib.sha256(f"{tensor.dtype} {list(tensor.shape)}".encode())
    h.update(_bytes_of(tensor))
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tensors_of(state: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """Every plain tensor in a nested dict, by its path (``model/layers.0.weight``);
    sharded tensors (DTensors) are left to the files' checksums."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from tensors_of(value, f"{name}/")
        elif isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
            yield name, value


def digests(state: Mapping[str, Any]) -> dict[str, str]:
    return {name: tensor_digest(tensor) for name, tensor in tensors_of(state)}


def not_finite(state: Mapping[str, Any], buffers: set[str]) -> list[str]:
    """The tensors of a checkpoint's state that would poison a run: a parameter or an
    optimizer's state that is not finite, a buffer (named in ``buffers``, as the model
    names it) holding NaN: a buffer may hold infinities on purpose, as a mask does."""
    found = []
    for name, tensor in tensors_of(state):
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        if name.removeprefix("model/") in buffers:
            bad = torch.isnan(tensor).any()
        else:
            bad = ~torch.isfinite(tensor).all()
        if bool(bad):
            found.append(name)
    return found


# ------------------------------------------------------------------ the manifest

def write(directory: Path, *, step: int, finite: bool, meta: Any,
          tensors: Mapping[str, str]) -> None:
    """Writes the manifest of the checkpoint in ``directory``, hashing every file there."""
    body = {"format": FORMAT, "step": step, "finite": finite,
            "files": {p.name: file_digest(p) for p in sorted(directory.iterdir())
                      if p.is_file() and p.name != MANIFEST},
            "tensors": dict(sorted(tensors.items())), "meta": meta}
    text = json.dumps(body, sort_keys=True)
    durable.write_bytes(directory / MANIFEST, json.dumps(
        {"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}, indent=1).encode())


def read(directory: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``directory``, its own checksum verified.

    Raises:
        CheckpointError: there is none (a checkpoint of an earlier conveyor, or not a
            checkpoint), or it is damaged.
    """
    path = directory / MANIFEST
    if not path.exists():
        raise CheckpointError(
            f"{directory} has no {MANIFEST}: it is not a checkpoint of this conveyor (those "
            "of conveyor 0.1's first format hold pickled objects, which loading would run "
            "as code; load one yourself with torch.load(path, weights_only=True))")
    try:
        whole = json.loads(path.read_text())
        body = whole["body"]
        text = json.dumps(body, sort_keys=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is damaged: {exc}") from exc
    if hashlib.sha256(text.encode()).hexdigest() != whole.get("sha256"):
        raise CheckpointError(f"{path} is damaged: its checksum does not match its content")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path} is of format {body.get('format')}; this conveyor "
                              f"reads format {FORMAT}")
    return dict(body)


def check_files(directory: Path, manifest: Mapping[str, Any]) -> list[str]:
    """The files of the checkpoint whose bytes differ from the manifest's checksums, or
    that are missing; raises for a file the manifest does not list where one is needed."""
    damaged = []
    for name, digest in manifest["files"].items():
        path = directory / name
        if not path.exists():
            raise CheckpointError(f"the checkpoint {directory} lacks its file {name}")
        if file_digest(path) != digest:
            damaged.append(name)
    return damaged


def check_tensors(where: Path, state: Mapping[str, Any], expected: Mapping[str, str],
                  damaged_files: list[str]) -> None:
    """Raises naming the tensors of ``state`` whose checksums differ from the manifest
    (and the files that did), or only the files, if every tensor read matches.

    Raises:
        CheckpointError: a file or a tensor differs from what was written.
    """
    wrong = [name for name, tensor in tensors_of(state)
             if name in expected and tensor_digest(tensor) != expected[name]]
    if not wrong and not damaged_files:
        return
    files = ", ".join(damaged_files) if damaged_files else "its files"
    tensors = (f"; the tensor{'s' * (len(wrong) > 1)} {', '.join(wrong[:5])}"
               f"{' ...' if len(wrong) > 5 else ''} differ{'s' * (len(wrong) == 1)} from "
               "what was saved" if wrong else "")
    raise CheckpointError(f"the checkpoint {where} is damaged: {files} changed since it was "
                          f"written (the checksums in its {MANIFEST} do not match){tensors}; "
                          "resume from an intact copy")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def check_fits(saved: Mapping[str, torch.Size], model: nn.Module, where: Path, *,
               partial: bool) -> None:
    """Raises CheckpointError naming the weights that ``model`` lacks, has in another
    shape, or (unless the model holds only some stages) that it does not have."""
    expected = tensorshards.whole_shapes(model)  # a tensor-parallel shard's: the whole
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


# ------------------------------------------------------------------ the folder

POINTER = "latest"
POINTER_TEMPORARY = ".latest.tmp"


def name_of(step: int, again: int = 0) -> str:
    """``step-00000012``, or ``step-00000012.2`` for the third save of that step."""
    return f"step-{step:08d}" + (f".{again}" if again else "")


def order(name: str) -> tuple[int, int]:
    """The saving order of a checkpoint's name."""
    base, _, again = name.partition(".")
    return int(base.removeprefix("step-")), int(again or 0)


def new_name(root: Path, step: int) -> tuple[str, int]:
    """A name for a new checkpoint of ``step`` in ``root`` that none has had: a save
    never writes into another checkpoint's directory. Returns it and its suffix."""
    taken = [order(p.name)[1] for p in root.glob(f"{name_of(step)}*")]
    again = max(taken) + 1 if taken else 0
    return name_of(step, again), again


def latest(root: Path) -> str | None:
    """The text of the ``latest`` pointer (None: there is none); only a hint, see
    :mod:`conveyor.train.checkpoints.folder`."""
    pointer = root / POINTER
    try:
        return pointer.read_bytes().decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError:  # a folder, unreadable: damaged
        return "?"


# ------------------------------------------------------------------ optimizer state

def aliases(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Every name of each of the optimizer's parameters, in its order: a tied one (the
    plain model's shared embedding and head) has several, which a pipeline holds as
    separate copies."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer
                      ) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's tensors (moments, steps) by parameter name (each name of a tied
    parameter)."""
    order_ = aliases(model, optimizer)
    return {name: {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            for index, state in optimizer.state_dict()["state"].items()
            for name in order_[index]}
