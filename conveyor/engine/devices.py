"""Pipelines place their layers on several devices; moving the whole module would undo it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.errors import BalanceError

__all__ = ["KeepsPlacement", "default_devices"]


def default_devices(count: int, what: str) -> list[torch.device]:
    """The devices when none are given: ``cuda:0 .. count-1`` where CUDA is available,
    else the CPU ``count`` times.

    Raises:
        BalanceError: fewer CUDA devices than ``count``; ``what`` says what needs them
            (e.g. "balance has 3 stages").
    """
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * count
    available = torch.cuda.device_count()
    if available < count:
        raise BalanceError(f"{what} but only {available} CUDA devices are available; "
                           "pass devices=[...] (devices may repeat)")
    return [torch.device("cuda", i) for i in range(count)]


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
