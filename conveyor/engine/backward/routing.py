"""Values between stages: a stage's output as it goes to several stages, and back.

A traced stage sends each value it makes to every later stage that uses it (the
schedule's neighbour and edges). In backward, each of those stages sends back the
gradient of what it received; these helpers pair outputs with the gradients that came
back, and add up the gradients of a value that went to several stages, so that
autograd sees one gradient per output as it would in the plain model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conveyor.errors import ConveyorError
from conveyor.torchprivate import pytree

__all__: list[str] = []

#: An output of a stage and the gradient backward starts it from (None: a scalar loss).
Pair = tuple[torch.Tensor, "torch.Tensor | None"]


def output_pairs(value: Any, grads: Sequence[torch.Tensor | None]) -> list[Pair]:
    """(output, gradient) for each leaf of ``value`` that takes the gradient it got."""
    return [(out, grad) for out, grad in zip(pytree.tree_leaves(value), grads)
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]


def summed(pairs: list[Pair]) -> list[Pair]:
    """``pairs`` with the gradients of one output (sent to several stages) added up."""
    found: dict[int, Pair] = {}
    for out, grad in pairs:
        earlier = found.get(id(out), (out, None))[1]
        found[id(out)] = (out, grad if earlier is None or grad is None else earlier + grad)
    return list(found.values())


def check_no_gradient(value: Any, source: int, destination: int) -> None:
    """Raises ConveyorError if a value sent over an edge without gradients requires one:
    its gradient would be lost."""
    for path, leaf in pytree.tree_flatten_with_path(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            raise ConveyorError(
                f"stage {source} sends stage {destination} a value that requires grad "
                f"(at{pytree.keystr(path)}) over edge {source}~>{destination}, which the "
                "trace found carries no gradient; its gradient would be lost. Please "
                "report this model: the value depends on no parameter in the trace")
