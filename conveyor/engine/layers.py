"""A stage's layers as one module, and the errors that name the layer that failed.

A stage holds its layers in a :class:`Partition`; a traced model's stage is one
:class:`WholeStage` that reads the model's own parameters. :func:`failure` turns an
exception raised in a layer into the error a user sees; a layer that writes into the
stage's input (a leaf that requires grad) is found by its error
(:func:`writes_into_leaf`), and the stage then works on a copy (:func:`copied_leaves`).
Compiling a stage's layers (``compile=True``) is :mod:`conveyor.engine.compiled.stages`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConveyorError, LayerOutputError, StageError, add_note
from conveyor.torchprivate import pytree

__all__: list[str] = []

LayerLoop = Callable[[Any], Any]


class WholeStage(nn.Module):
    """A layer that is a whole stage of a traced model (``conveyor.graph`` makes them).

    It reads parameters and buffers that live elsewhere (the model's, under the model's
    names), takes the values that cross into it and hands on a dict of the values it
    makes, which :meth:`route` splits by the stage that uses each.
    """

    def bound_parameters(self) -> list[nn.Parameter]:
        """The parameters this stage reads."""
        raise NotImplementedError

    def graphs(self) -> list[torch.fx.GraphModule]:
        """The graphs this stage runs (one per training mode traced so far)."""
        raise NotImplementedError

    def graph(self) -> torch.fx.GraphModule | None:
        """The graph its next call runs (its mode's), None before that mode is traced."""
        raise NotImplementedError

    def bound_modules(self) -> list[nn.Module]:
        """The modules whose parameters or buffers this stage reads."""
        raise NotImplementedError

    def route(self, made: dict[str, Any], destinations: Sequence[int]) -> dict[int, Any]:
        """What this stage made, split by the stage each value goes to."""
        raise NotImplementedError


class Partition(nn.Sequential):
    """A stage's layers as one module.

    Called by its stage, it runs the stage's loop over its layers (seeded, checked);
    called directly, it is the plain ``nn.Sequential``.
    """

    def forward(self, input: Any, loop: LayerLoop | None = None) -> Any:
        return super().forward(input) if loop is None else loop(input)


def batch_rows(value: Any) -> tuple[int, torch.Size] | None:
    """Dim 0 of the first tensor in ``value`` that has one, with its shape."""
    if isinstance(value, torch.Tensor):  # the common case, without flattening
        return (value.shape[0], value.shape) if value.dim() else None
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return leaf.shape[0], leaf.shape
    return None


def failure(
    exc: Exception,
    context: str,
    *,
    hint: str = "",
    stage: int,
    microbatch: int,
    action: str,
    layer: int | None = None,
) -> Exception:
    """The exception to raise for ``exc``, which happened in ``context``.

    conveyor's own typed errors already say where they happened and pass as they are.
    Out-of-memory errors keep their type too (``except torch.cuda.OutOfMemoryError``
    must keep working) and get ``context`` as a note. Anything else is wrapped in a
    StageError whose message starts with ``context``.
    """
    if isinstance(exc, ConveyorError):
        return exc
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        add_note(exc, context)
        return exc
    return StageError(f"{context}: {type(exc).__name__}: {exc}{hint}", stage=stage,
                      microbatch=microbatch, action=action, layer=layer)


def keeps_rows(output: Any, rows: tuple[int, torch.Size] | None) -> bool:
    """Whether ``output`` is one tensor with the input's ``rows`` in dim 0: the common
    case, which :func:`check_output` passes, told without a call into it."""
    return (rows is not None and type(output) is torch.Tensor and output.dim() > 0
            and output.shape[0] == rows[0])


def check_output(output: Any, rows: tuple[int, torch.Size] | None,
                 where: Callable[[], str], microbatch: int) -> None:
    """Refuses an output that is not tensors, or whose batch dimension differs from
    the stage input's (``rows``; None: the input has none): micro-batches are
    concatenated along dim 0, so the pipeline's result would be wrong. ``where()``
    names the stage and layer that made it.

    Raises:
        LayerOutputError: saying so.
    """
    if isinstance(output, torch.Tensor):  # the common case, without flattening
        got = (output.shape[0], output.shape) if output.dim() else None
    else:
        got = None
        for path, leaf in pytree.tree_flatten_with_path(output)[0]:
            if isinstance(leaf, torch.Tensor):
                if got is None and leaf.dim():
                    got = leaf.shape[0], leaf.shape
            elif leaf is not None:
                at = "" if not path else f" (at output{pytree.keystr(path)})"
                raise LayerOutputError(
                    f"{where()} returned "
                    f"{type(leaf).__name__}{at} on micro-batch {microbatch}; a layer "
                    "must return a tensor or a tuple/list/dict of tensors"
                )
    if rows is None or (got is not None and got[0] == rows[0]):
        return
    found = f"{got[0]} rows (shape {list(got[1])})" if got is not None else "no batched tensor"
    raise LayerOutputError(
        f"{where()} returned {found} on "
        f"micro-batch {microbatch}, which has {rows[0]} rows; a layer must keep dim 0, "
        "the batch, along which the pipeline splits and concatenates micro-batches"
    )


def writes_into_leaf(exc: BaseException) -> bool:
    """Whether ``exc`` is autograd's refusal of an in-place write into a leaf tensor
    that requires grad (or into a view of one)."""
    return isinstance(exc, RuntimeError) and \
        "leaf Variable that requires grad is being used in an in-place operation" in str(exc)


def shares_a_leaf(value: Any, received: Any) -> bool:
    """Whether ``value`` holds one of ``received``'s leaf tensors that require grad."""
    leaves = {id(t) for t in pytree.tree_leaves(received)
              if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad}
    return any(id(t) in leaves for t in pytree.tree_leaves(value))


def shares_a_tensor(tensors: Sequence[torch.Tensor], value: Any) -> bool:
    """Whether one of ``tensors`` is a tensor leaf of ``value``."""
    leaves = {id(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}
    return any(id(t) in leaves for t in tensors)


def copied_leaves(inputs: Any) -> Any:
    """``inputs`` with each tensor leaf that requires grad replaced by a copy of it."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.clone() if t.requires_grad and t.is_leaf else t, inputs)
