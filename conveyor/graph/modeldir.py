"""A model's weights as they are stored: a state dict, one file, or a model directory.

``weights=`` takes what a user has on disk, read lazily, one tensor at a time:

* a model directory as ``save_pretrained`` writes it: sharded safetensors with
  ``model.safetensors.index.json``, one ``model.safetensors``, or ``pytorch_model.bin``
  (with ``pytorch_model.bin.index.json`` and its shards);
* an index file itself (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``);
* one ``.safetensors`` file, or one ``torch.save`` file of a state dict;
* a state dict in memory.

A shard is opened the first time one of its tensors is asked for, so a rank of a
pipeline opens only the shards holding its stages' tensors and reads only those
tensors (safetensors' ``safe_open`` and ``get_tensor``; ``torch.save`` files memory-mapped
and loaded with ``weights_only=True``: loading never runs code). Every tensor knows the
file it is expected in, which an error names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Union

import torch

from conveyor.errors import ModelError

__all__: list[str] = []

Weights = Union[str, "os.PathLike[str]", Mapping[str, torch.Tensor]]
_log = logging.getLogger("conveyor")

#: What a model directory may hold, in the order it is looked for.
STORED = ("model.safetensors.index.json", "model.safetensors",
          "pytorch_model.bin.index.json", "pytorch_model.bin")


class StoredWeights:
    """Tensors by name from ``weights=``, each read from its own file when asked for.

    Attributes:
        source: what was given, as a user would name it in an error.
        opened: the files opened so far, in order (a rank opens only its stages' shards).
    """

    def __init__(self, weights: Weights) -> None:
        self._memory: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Path] = {}  # tensor name -> its file (from an index)
        self._single: Path | None = None
        self._index: Path | None = None
        self._open: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        self.opened: list[Path] = []
        if isinstance(weights, Mapping):
            self._memory = weights
            self.source = "the state dict given"
            return
        path = Path(os.fspath(weights))
        self.source = str(path)
        if not path.exists():
            raise ModelError(f"weights={str(path)!r} does not exist; give a model directory, "
                             "an index file, a .safetensors or torch.save file, or a state dict")
        path = _stored_in(path) if path.is_dir() else path
        if path.name.endswith(".index.json"):
            self._index = path
            self._files = _weight_map(path)
        else:
            self._single = path

    def close(self) -> None:
        """Closes the files opened."""
        self._stack.close()
        self._open.clear()

    def file_of(self, name: str) -> str:
        """Where ``name`` is expected: its file's name (and the folder), or the source."""
        path = self._files.get(name, self._single)
        if path is None:
            return self.source if self._index is None else \
                f"{self._index} (whose weight_map has no such name)"
        return str(path)

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor stored under ``name``, or None where none is.

        Raises:
            ModelError: the index names a shard that is missing, or that lacks ``name``.
        """
        if self._memory is not None:
            return self._memory.get(name)
        path = self._files.get(name) if self._index is not None else self._single
        if path is None:
            return None
        file = self._opened(path, name)
        value = file.get_tensor(name) if hasattr(file, "get_tensor") else file.get(name)
        if value is None and self._index is not None:
            raise ModelError(f"{path} has no tensor {name!r}, though {self._index.name} "
                             "maps it there; the directory is incomplete or its index stale "
                             "(save the model again, or download it again)")
        return value

    def _opened(self, path: Path, name: str) -> Any:
        """The open file at ``path`` (opened now if not yet)."""
        if path in self._open:
            return self._open[path]
        if not path.is_file():
            raise ModelError(f"{path} does not exist, though {self._index} names it for "
                             f"{name!r}; the directory is incomplete (download it again)")
        _log.debug("weights: opening %s", path)
        self.opened.append(path)
        if path.name.endswith(".safetensors"):
            safe_open = _safe_open()
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            file: Any = _SafetensorsFile(handle)
        else:
            file = _torch_file(path)
        self._open[path] = file
        return file


class _SafetensorsFile:
    """An open safetensors file: a tensor by name, or None where it has none."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._keys = set(handle.keys())

    def get_tensor(self, name: str) -> torch.Tensor | None:
        return self._handle.get_tensor(name) if name in self._keys else None


@contextlib.contextmanager
def stored(weights: Weights) -> Iterator[StoredWeights]:
    """``weights`` open for reading (see :class:`StoredWeights`), closed after."""
    reader = StoredWeights(weights)
    try:
        yield reader
    finally:
        reader.close()


def _stored_in(folder: Path) -> Path:
    """The file of a model directory to read: its index, or its one weights file.

    Raises:
        ModelError: the folder holds none of them.
    """
    for name in STORED:
        if (folder / name).is_file():
            return folder / name
    single = sorted(folder.glob("*.safetensors"))
    if len(single) == 1:
        return single[0]
    held = sorted(p.name for p in folder.iterdir())[:8]
    raise ModelError(f"weights={str(folder)!r} is a folder with none of {', '.join(STORED)} "
                     f"(it holds {', '.join(held) or 'nothing'}); give a model directory as "
                     "save_pretrained writes it, or the file of the weights")


def _weight_map(index: Path) -> dict[str, Path]:
    """Each tensor's shard, from an index file's ``weight_map``.

    Raises:
        ModelError: the file is not an index of shards.
    """
    try:
        mapping = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ModelError(f"{index} is not an index of shards (a JSON object with a "
                         f"'weight_map' of tensor names to files): {error}") from None
    if not isinstance(mapping, dict):
        raise ModelError(f"{index}'s weight_map is a {type(mapping).__name__}, not an object")
    return {str(name): index.parent / str(file) for name, file in mapping.items()}


def _safe_open() -> Any:
    """safetensors' ``safe_open``, or a clear error where the package is missing."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ModelError("reading .safetensors files needs the safetensors package: "
                         "pip install safetensors") from None
    return safe_open


def _torch_file(path: Path) -> Mapping[str, torch.Tensor]:
    """A ``torch.save`` file of a state dict, memory-mapped where its format allows;
    loaded with ``weights_only=True`` (loading never runs code).

    Raises:
        ModelError: the file does not hold a state dict, or cannot be read safely.
    """
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as error:
        if "mmap" not in str(error):  # the legacy format cannot be mapped
            raise ModelError(f"{path} cannot be read as a torch.save file of tensors: "
                             f"{error}") from None
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle's refusal of what is not a tensor, a bad file
        raise ModelError(f"{path} cannot be read as a torch.save file of tensors "
                         f"({type(error).__name__}: {str(error).splitlines()[0]}); "
                         "loading never runs code from a file") from None
    if not isinstance(state, Mapping):
        raise ModelError(f"{path} holds a {type(state).__name__}, not a state_dict")
    return state
