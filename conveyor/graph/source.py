"""Building only the layers a rank holds, with weights that do not depend on the rank.

A pipeline over many processes should not build the whole model on each of them. It
takes either a model built on the meta device (no memory), or a function that builds
layer i; each rank creates only its own layers. Layer i is initialised under its own
seed, derived from torch's global seed and i alone, so a model cut into 1, 2 or 4
stages starts from the same weights, and :func:`sequential` builds the same model
unpartitioned for reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from conveyor.graph.weights import draw_init_seed, reset_of, seeded

__all__ = ["LayerBuilder", "sequential"]

LayerBuilder = Callable[[int], nn.Module]


def sequential_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of ``module`` as ``(name, layer)`` pairs, in order.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"conveyor pipelines an nn.Sequential, got {type(module).__name__}; wrap the "
            "layers in order: nn.Sequential(layer0, layer1, ...), or cut any module at its "
            "submodules: give split_at=[names], or no balance to cut among its blocks"
        )
    # Not named_children(): it skips a module that appears twice, which is a layer here.
    return [(name, layer) for name, layer in module._modules.items() if layer is not None]


def is_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in (*layer.parameters(), *layer.buffers()))


def materialize(layer: nn.Module, index: int, *, device: torch.device, init_seed: int,
                name: str) -> nn.Module:
    """``layer`` on ``device``; a meta layer gets storage and its own initialisation.

    Raises:
        TypeError: a meta layer holds parameters or buffers in a module without
            ``reset_parameters()``, so there is no way to initialise them.
    """
    if not is_meta(layer):
        return layer.to(device)
    for module in layer.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own and reset_of(module) is None:
            raise TypeError(
                f"layer {index} ({name}) was built on the meta device, but its "
                f"{type(module).__name__} has parameters or buffers and no "
                "reset_parameters() to initialise them; pass a function that builds "
                "layer i instead"
            )
    layer.to_empty(device=device)
    with seeded(init_seed, index, device), torch.no_grad():
        for module in layer.modules():
            reset = reset_of(module)
            if reset is not None:
                reset()
    return layer


def build(builder: LayerBuilder, index: int, *, device: torch.device,
          init_seed: int) -> nn.Module:
    """Layer ``index`` from ``builder``, created on ``device`` under its own seed."""
    with seeded(init_seed, index, device), device:
        layer = builder(index)
    if not isinstance(layer, nn.Module):
        raise TypeError(f"the layer builder returned {type(layer).__name__} for layer "
                        f"{index}; it must return an nn.Module")
    return layer


def sequential(builder: LayerBuilder, layers: int, *,
               device: torch.device | str = "cpu") -> nn.Sequential:
    """The whole model from ``builder``, initialised exactly as a Pipeline would."""
    init_seed = draw_init_seed()
    return nn.Sequential(*[build(builder, i, device=torch.device(device), init_seed=init_seed)
                           for i in range(layers)])


class LayerSource:
    """The layers of a model as the user gave it: an ``nn.Sequential`` (possibly on the meta
    device) or a function that builds layer i. Each rank takes only its own layers."""

    def __init__(self, module: nn.Sequential | LayerBuilder, layers: int | None) -> None:
        if isinstance(module, nn.Module):
            self._layers: list[tuple[str, nn.Module]] | None = sequential_layers(module)
            self._builder: LayerBuilder | None = None
            self.names = [name for name, _ in self._layers]
        elif callable(module):
            if layers is None:
                raise TypeError("a layer-building function needs layers=, the number of "
                                "layers to build")
            self._layers, self._builder = None, module
            self.names = [str(i) for i in range(layers)]
        else:
            raise TypeError(f"Pipeline takes an nn.Sequential or a function that builds "
                            f"layer i, got {type(module).__name__}")

    def builds_layers(self) -> bool:
        """Whether taking a layer creates or initialises one (a layer function, or a
        layer on the meta device), so that an initialisation seed is needed."""
        return self._layers is None or any(is_meta(layer) for _, layer in self._layers)

    def layers_if_known(self) -> list[tuple[str, nn.Module]]:
        return self._layers or []

    def layer(self, index: int, device: torch.device, init_seed: int) -> nn.Module:
        if self._layers is not None:
            name, layer = self._layers[index]
            return materialize(layer, index, device=device, init_seed=init_seed,
                               name=type(layer).__name__)
        assert self._builder is not None
        return build(self._builder, index, device=device, init_seed=init_seed)

    def parameter_counts(self) -> list[float]:
        if self._layers is not None:
            return [float(sum(p.numel() for p in layer.parameters()))
                    for _, layer in self._layers]
        assert self._builder is not None
        counts = []
        for i in range(len(self.names)):
            with torch.device("meta"):
                counts.append(float(sum(p.numel() for p in self._builder(i).parameters())))
        return counts
