"""A model directory read back into a built pipeline: the inverse of ``save_pretrained``
for a pipeline that exists (a checkpoint resumed), each rank reading only its stages'
tensors (a tied weight, written once, found under any of its names)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from conveyor.errors import ModelError
from conveyor.graph.modeldir import stored

__all__: list[str] = []


def load_pretrained(pipe: nn.Module, runtime: Any, directory: str | os.PathLike[str]) -> None:
    """Copies the tensors of ``directory`` (a model directory, an index or a weights
    file, as ``weights=`` takes) into this process's stages of ``pipe``, in place.

    Raises:
        ModelError: a tensor of the stages is missing, or has another shape (named with
            the file it was expected in); nothing is changed then.
    """
    aliases: dict[str, list[str]] = {}
    for tie in runtime.layout.ties:
        for name in tie.names:
            aliases[name] = [other for other in tie.names if other != name]
    state = pipe.state_dict()
    found: dict[str, torch.Tensor] = {}
    with stored(directory) as read:
        for name, tensor in state.items():
            value = next((v for n in [name, *aliases.get(name, [])]
                          if (v := read.get(n)) is not None), None)
            if value is None:
                raise ModelError(f"{os.fspath(directory)} has no tensor {name!r} "
                                 f"(expected in {read.file_of(name)})")
            if tuple(value.shape) != tuple(tensor.shape):
                raise ModelError(f"{name!r} is {tuple(value.shape)} in {read.file_of(name)} "
                                 f"but {tuple(tensor.shape)} in the pipeline")
            found[name] = value
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(found[name])
