"""The loss of a micro-batch as ``loss_fn`` returns it: a scalar, or ``(loss_sum, count)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from conveyor.errors import ConveyorError

__all__: list[str] = []

#: ``loss_fn(output, target)``: a one-element tensor, or a ``(loss_sum, count)`` pair.
LossFn = Callable[[Any, Any], Any]


def loss_and_count(result: Any, m: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss tensor of micro-batch m, and the count of a ``(loss_sum, count)`` pair
    as a float64 tensor (None for a plain scalar loss).

    Raises:
        ConveyorError: ``result`` is neither a one-element tensor nor such a pair.
    """
    count = None
    if isinstance(result, (tuple, list)) and len(result) == 2:
        result, count = result
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            count = count.detach().reshape(()).to(torch.float64)
        elif isinstance(count, (int, float)) and not isinstance(count, bool) and count >= 0:
            count = torch.tensor(float(count), dtype=torch.float64)
        else:
            shown = (f"a tensor of shape {tuple(count.shape)}" if isinstance(count, torch.Tensor)
                     else repr(count))
            raise ConveyorError(
                f"loss_fn returned a pair whose count is {shown} on micro-batch {m}; the "
                "count must be a number >= 0 or a one-element tensor (e.g. the number of "
                "tokens that are not padding)"
            )
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        got = (tuple(result.shape) if isinstance(result, torch.Tensor)
               else type(result).__name__)
        raise ConveyorError(
            f"loss_fn must return a one-element tensor or a (loss_sum, count) pair, got "
            f"{got} on micro-batch {m}; reduce over the samples (reduction='mean'), or "
            "return (loss summed over elements, number of elements)"
        )
    return result, count

