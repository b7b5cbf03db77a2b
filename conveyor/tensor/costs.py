"""What a plan's splits cost in collectives, layer by layer: what the planner weighs.

Each split module runs the group's operators of :mod:`conveyor.tensor.regions`, one
all-reduce each::

    colwise                 backward: its input's gradient (when the input needs one)
    colwise_gather_output   forward: its output (laid into zeros, whole); backward: as colwise
    rowwise                 forward: its output
    embedding_rowwise       forward: its output
    replicated_with_grad_allreduce   backward: each of its weights' gradients

So a Llama decoder layer split by its own plan all-reduces twice in forward (o_proj,
down_proj) and five times in backward (q, k, v, gate and up's inputs), where a model
with Megatron's fused projections would twice. :func:`collectives` counts them on one
forward of the model (on the meta device too), as a profile's layers cut it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch import nn

from conveyor.engine.microbatch import batch_size
from conveyor.graph.calls import as_call
from conveyor.tensor.plan import planned_modules, resolve_plan
from conveyor.torchprivate import pytree

__all__: list[str] = []


@dataclass(frozen=True)
class Collectives:
    """One layer's all-reduces over its tensor group, per micro-batch.

    Attributes:
        forward: how many its forward runs.
        forward_bytes: the bytes they carry, per sample.
        backward: how many its backward runs.
        backward_bytes: the bytes they carry, per sample, beside ``weight_bytes``.
        weight_bytes: bytes of weight gradients summed in backward, per micro-batch
            whatever its size (weights kept whole whose gradient each rank sees a part of).
    """

    forward: int = 0
    forward_bytes: float = 0.0
    backward: int = 0
    backward_bytes: float = 0.0
    weight_bytes: float = 0.0

    def __add__(self, other: Collectives) -> Collectives:
        return Collectives(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __sub__(self, other: Collectives) -> Collectives:
        return Collectives(*(a - b for a, b in zip(astuple(self), astuple(other))))


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree)
               if isinstance(t, torch.Tensor))


def _needs_grad(tree: Any) -> bool:
    return any(t.requires_grad for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def _cost(style: str, module: nn.Module, inputs: Any, output: Any,
          samples: int) -> Collectives:
    """What one module split as ``style`` all-reduces, having seen ``inputs`` and
    ``output`` in forward."""
    input_grad = (1, _nbytes(inputs) / samples) if _needs_grad(inputs) else (0, 0.0)
    if style == "colwise":
        return Collectives(backward=input_grad[0], backward_bytes=input_grad[1])
    if style == "colwise_gather_output":
        return Collectives(1, _nbytes(output) / samples, *input_grad)
    if style in ("rowwise", "embedding_rowwise"):
        return Collectives(1, _nbytes(output) / samples)
    if style == "replicated_with_grad_allreduce":
        weights = [p for p in module.parameters() if p.requires_grad]
        return Collectives(backward=len(weights),
                           weight_bytes=sum(p.numel() * p.element_size() for p in weights))
    return Collectives()  # kept whole


def collectives(model: nn.Module, sample: Any, tp_plan: str | Mapping[str, Any],
                split_at: Sequence[str] = ()) -> list[Collectives]:
    """Per layer of a profile of ``model`` (an ``nn.Sequential``'s layers; else what
    comes before ``split_at[0]``, then a layer from each name of ``split_at``), the
    all-reduces its split modules run under ``tp_plan``, from one forward on ``sample``
    (a batch as the model takes it; meta works). A module belongs to the layer that
    was running when it ran, as a pipeline cuts it.

    Raises:
        TensorParallelError: the plan cannot be read, or names no module of the model.
    """
    planned = planned_modules(model, resolve_plan(model, tp_plan))
    if isinstance(model, nn.Sequential) and not split_at:
        starts = [module for module in model._modules.values() if module is not None]
    else:
        starts = [model.get_submodule(name) for name in split_at]
        starts.insert(0, model)  # "(start)": running until the first name runs
    found = [Collectives() for _ in starts]
    samples = batch_size(sample)
    running = [0]
    handles = []

    def enter(index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            running[0] = max(running[0], index)  # a layer's inner call: still that layer
        return hook

    def ran(style: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            found[running[0]] = found[running[0]] + _cost(style, module, args, output, samples)
        return hook

    try:
        for index, module in enumerate(starts):
            if module is not model:
                handles.append(module.register_forward_pre_hook(enter(index)))
        for name, (style, _) in planned.items():
            handles.append(model.get_submodule(name).register_forward_hook(ran(style)))
        # An nn.Sequential takes the batch as its one input, as its layers are measured.
        args, kwargs = ((sample,), {}) if starts[0] is not model else as_call(sample)
        with torch.enable_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return found
