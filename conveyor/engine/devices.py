"""Where stages run: resolving the devices a user names, and refusing moves of the whole
pipeline (each stage keeps its own device)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.errors import BalanceError
from conveyor.torchprivate import device_of_to

__all__: list[str] = []

Device = torch.device | str | int


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


def resolve_devices(devices: Sequence[Device] | None, count: int, *, what: str,
                    per: str = "stage") -> list[torch.device]:
    """The ``count`` devices to run on: the ones given, or :func:`default_devices`.

    A bare ``"cuda"`` names the current CUDA device, so that every stage and message
    agrees on one index.

    Args:
        devices: one device per ``per`` (devices may repeat), or None for the default.
        count: how many are needed.
        what: what needs them, for messages (e.g. "balance has 3 stages").
        per: what one device is for, for messages ("stage" or "pipeline rank").

    Raises:
        BalanceError: ``devices`` lists another number of devices than ``count``, or
            (by default) fewer CUDA devices are available.
    """
    if devices is None:
        return default_devices(count, what)
    resolved = [torch.device(d) for d in devices]
    if len(resolved) != count:
        raise BalanceError(f"devices lists {len(resolved)} devices but {what}; give one "
                           f"device per {per} (devices may repeat)")
    for device in resolved:
        if (missing := absent(device)) is not None:
            raise BalanceError(f"devices=: {missing}; pass devices that exist (devices "
                               "may repeat, e.g. devices=['cpu', 'cpu'])")
    return [
        torch.device("cuda", torch.cuda.current_device())
        if d.type == "cuda" and d.index is None else d
        for d in resolved
    ]


def absent(device: torch.device) -> str | None:
    """Why ``device`` is not on this machine (a CUDA device beyond those there, or any
    on a torch built without CUDA), or None where it is: what the command line and
    ``devices=`` both say, before torch's own assertion would.
    """
    if device.type != "cuda":
        return None
    if not torch.backends.cuda.is_built():
        return (f"there is no {device} here (this torch, {torch.__version__}, is built "
                "without CUDA)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        return f"there is no {device} here ({count} CUDA devices)"
    return None


class KeepsPlacement(nn.Module):
    """An nn.Module that allows dtype conversions but refuses device moves."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device = device_of_to(*args, **kwargs)
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
