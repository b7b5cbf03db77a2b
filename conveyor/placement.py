"""Pipelines place their layers on several devices; moving the whole module would undo it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["KeepsPlacement"]


class KeepsPlacement(nn.Module):
    """An nn.Module that allows dtype conversions but refuses device moves."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            raise _move_error(device)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Any:
        raise _move_error("cuda")

    def cpu(self) -> Any:
        raise _move_error("cpu")


def _move_error(device: Any) -> TypeError:
    return TypeError(
        f"a pipeline keeps each stage on its own device and cannot be moved to {device}; "
        "pass devices=[...] when building it (dtype changes like .double() are fine)"
    )
