"""Megatron's conjugate operators, as custom ops a traced graph keeps whole.

::

    colwise   x --copy--> Linear(W[rows t]) --> y_t                 (copy: grad all-reduced)
    rowwise   x_t --> Linear(W[:, cols t]) --reduce--> y (+ bias)   (reduce: forward all-reduce)
    gather    y_t --gather--> y                                     (backward: own slice)

Each op takes its tensor group by name (``group.group_name``) and the seconds its
all-reduce may wait; every all-reduce goes through
:func:`conveyor.distributed.faults.collective.all_reduce`. A gather is an all-reduce of
the rank's slice laid into zeros: exact (each element is one value plus zeros).
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.distributed.faults import collective
from conveyor.torchprivate import process_group_named

__all__: list[str] = []


def sum_over(x: torch.Tensor, group: str, seconds: float, what: str) -> torch.Tensor:
    out = x.contiguous().clone()
    collective.all_reduce(out, group=process_group_named(group), what=what, seconds=seconds,
                          inline=True)
    return out


@torch.library.custom_op("conveyor::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str, seconds: float) -> torch.Tensor:
    """The sum of ``x`` over the tensor group (forward); its gradient passes as it is."""
    return sum_over(x, group, seconds, "the tensor group's sum of a row-parallel output")


@tp_reduce.register_fake
def _(x: torch.Tensor, group: str, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


def _reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
    return grad, None, None


tp_reduce.register_autograd(_reduce_backward)


@torch.library.custom_op("conveyor::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str, seconds: float) -> torch.Tensor:
    """``x`` as it is (forward); its gradient summed over the tensor group."""
    return x.clone()


@tp_copy.register_fake
def _(x: torch.Tensor, group: str, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


def _copy_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group, ctx.seconds = inputs[1], inputs[2]


def _copy_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
    return sum_over(grad, ctx.group, ctx.seconds,
                "the tensor group's sum of a column-parallel input's gradient"), None, None


tp_copy.register_autograd(_copy_backward, setup_context=_copy_setup)


@torch.library.custom_op("conveyor::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, group: str, seconds: float, parts: int,
              index: int) -> torch.Tensor:
    """The ``parts`` slices of the last dimension, this rank's ``index``-th, put
    together (forward); the gradient of this rank's slice (backward)."""
    size = x.shape[-1]
    full = x.new_zeros(*x.shape[:-1], size * parts)
    full[..., index * size:(index + 1) * size] = x
    return sum_over(full, group, seconds,
                    "the tensor group's gathering of a column-parallel output")


@tp_gather.register_fake
def _(x: torch.Tensor, group: str, seconds: float, parts: int, index: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * parts)


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.parts, ctx.index = inputs[3], inputs[4]


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None, None]:
    size = grad.shape[-1] // ctx.parts
    return grad[..., ctx.index * size:(ctx.index + 1) * size].contiguous(), None, None, \
        None, None


tp_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


def grad_sum(param: torch.Tensor, group: str, seconds: float) -> None:
    """Sums ``param``'s gradient over the tensor group as each is computed: a weight
    every rank holds whole but applies to its part of the values (Qwen3's per-head
    norms: each rank sees only its heads' share of the gradient)."""
    param.register_hook(
        lambda grad: sum_over(grad, group, seconds,
                          "the tensor group's sum of a replicated weight's gradient"))
