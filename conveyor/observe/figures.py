"""What a model's layers and stages cost, per sample: the planner's figures.

:func:`measure` takes them per layer of an ``nn.Sequential`` from one forward on a
sample, :func:`measure_split` per stage of any model cut as a pipeline cuts it; on the
meta device neither costs memory. ``conveyor.observe.plan`` plans from them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from conveyor.engine.microbatch import batch_size
from conveyor.errors import BalanceError
from conveyor.graph.source import sequential_layers
from conveyor.torchprivate import pytree

__all__: list[str] = []


@dataclass(frozen=True)
class LayerFigures:
    """What one layer costs, per sample.

    Attributes:
        parameters: parameter elements.
        parameter_bytes: bytes of the parameters themselves.
        activation_bytes: bytes autograd saves for backward (parameters excluded).
        input_bytes: bytes the layer receives.
        output_bytes: bytes the layer hands to the next.
        flops: forward floating-point operations.
    """

    name: str
    parameters: int
    parameter_bytes: int
    activation_bytes: float
    input_bytes: float
    output_bytes: float
    flops: float


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree)
               if isinstance(t, torch.Tensor))


def measure(model: nn.Sequential, sample: Any) -> list[LayerFigures]:
    """Per-layer figures from one forward of ``model`` on ``sample`` (meta works).

    Args:
        model: the model as an ``nn.Sequential``, on any device (meta: no memory).
        sample: a batch on the same device; figures are divided by its batch size.
    """
    samples = batch_size(sample)
    figures = []
    x = _own_memory(sample)
    # Storages a layer saved (kept alive, so that no new storage takes their address): a
    # later layer saving one adds nothing.
    counted: dict[int, Any] = {}
    for name, layer in sequential_layers(model):
        x = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), x)
        figure, out = _figures(name, layer, list(layer.parameters()), x, samples, counted)
        figures.append(figure)
        x = out
    return figures


def measure_split(model: nn.Module, sample: Any, *, split_at: Sequence[str] | None = None,
                  stages: int | None = None) -> list[LayerFigures]:
    """Figures of each stage of ``model`` cut at ``split_at``, or into ``stages`` stages
    where ``Pipeline(model, stages=...)`` would cut it, from one forward of each stage
    on ``sample`` (a micro-batch as the model takes it; on the meta device with a meta
    model: no memory). A stage's figure is named by the submodule it begins at
    (``"(start)"`` for the first); its parameters are those it holds, a copy of a weight
    tied across stages included; its input and output are what crosses to it and from it.

    The model is copied first (``copy.deepcopy``), as cutting gives a tied weight a copy
    per stage: build a large model on the meta device.

    Raises:
        BalanceError: neither ``split_at`` nor ``stages``, or they disagree; see
            ``conveyor.Pipeline`` for the errors of choosing a cut.
        ModelError: the model cannot be traced or cut there.
    """
    from conveyor.graph.autosplit import choose_split_at
    from conveyor.graph.export import split_model

    if split_at is None:
        if stages is None:
            raise BalanceError("give split_at= (where stages begin) or stages= (to cut as "
                               "Pipeline would)")
        split_at = choose_split_at(model, stages, sample)
    elif stages is not None and len(split_at) + 1 != stages:
        raise BalanceError(f"split_at gives {len(split_at) + 1} stages but stages={stages}")
    model = copy.deepcopy(model)
    device = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device
    split = split_model(model, sample, split_at, dict.fromkeys(range(len(split_at) + 1), device))
    samples = batch_size(sample)
    figures, live = [], _own_memory(sample)
    made: dict[str, Any] = {}  # every value the stages so far made for later ones
    for name, stage in zip(["(start)", *split_at], split.stages.values()):
        if stage.index > 0:
            live = {value: made[value] for value in stage.programs[True].receives}
        figure, out = _figures(name, stage.train(), stage.bound_parameters(), live, samples)
        figures.append(figure)
        if isinstance(out, dict) and stage.index < len(split_at):
            made.update(pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), out))
    return figures


def _own_memory(sample: Any) -> Any:
    """``sample`` with each tensor in memory of its own: a view of a larger batch would
    count the whole batch where a layer saves its input (a saved view holds all of it)."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, sample)


def _figures(name: str, module: Any, params: Sequence[torch.Tensor], live: Any,
             samples: int, counted: dict[int, Any] | None = None
             ) -> tuple[LayerFigures, Any]:
    """The figures of a layer or traced stage reading ``params``, from one forward on
    ``live``, and its output. A storage in ``counted`` (an earlier layer saved it: a
    ReLU its output, which the next layer saves as its input) is not counted again;
    what this layer saves is added to it."""
    held = {p.untyped_storage()._cdata for p in params} | set(counted or ())
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in held:
            saved[storage._cdata] = storage.nbytes()  # a view holds all of it
            if counted is not None:
                counted[storage._cdata] = storage
        return t

    with torch.enable_grad(), FlopCounterMode(display=False) as flops, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(live)
    return LayerFigures(
        name=name,
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        activation_bytes=sum(saved.values()) / samples,
        input_bytes=_nbytes(live) / samples,
        output_bytes=_nbytes(out) / samples,
        flops=flops.get_total_flops() / samples,
    ), out
