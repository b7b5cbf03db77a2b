"""The profile PipeDream plans from: per layer, what it costs in time, memory and bytes sent.

One short run on one device gives, per layer of an ``nn.Sequential`` (or per block of
any model, as ``Pipeline`` cuts it): forward and backward seconds, the bytes autograd
saves for backward, the bytes it hands to the next layer, and its parameters. Every
figure is per sample, so a plan can scale it to any micro-batch (time scales linearly
with the samples: profile at a batch near the micro-batch you will run). A model on the
meta device is profiled from its FLOP counts at the cluster's rate instead, so a
70B-parameter model plans on a laptop.

A profile is saved as JSON under a key made of the model's name, its input shapes and
the device, and read back instead of measured again (``cache=``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.engine.microbatch import batch_size
from conveyor.errors import ConveyorError
from conveyor.observe.plan import LayerFigures, measure, measure_split
from conveyor.tensor.costs import Collectives, collectives
from conveyor.tensor.plan import plan_shown
from conveyor.torchprivate import pytree

__all__ = ["LayerCost", "ModelProfile", "profile_model"]


@dataclass(frozen=True)
class LayerCost:
    """What one layer (or block) costs, per sample.

    Attributes:
        forward: seconds of its forward.
        backward: seconds of its backward (input and weight gradients).
        parameters: parameter elements.
        parameter_bytes: bytes of its parameters (their gradients take as much again).
        activation_bytes: bytes autograd saves for its backward.
        output_bytes: bytes it hands to the next layer: what crosses a cut after it.
        tp: its all-reduces over a tensor group, counted from the plan it was profiled
            with (:func:`conveyor.tensor.costs.collectives`); None: not counted (the
            mesh planner then takes a transformer layer's, Megatron's two of its output
            in forward and two in backward, for a layer with parameters).
    """

    name: str
    forward: float
    backward: float
    parameters: int
    parameter_bytes: float
    activation_bytes: float
    output_bytes: float
    tp: Collectives | None = None


@dataclass(frozen=True)
class ModelProfile:
    """A model's layers with their costs, and how they were found.

    Attributes:
        name: the model's name.
        layers: in order; a plan cuts between them.
        input_bytes: bytes per sample the first layer receives.
        source: how the times were found ("timed on cpu, batch 8", "FLOPs at ...").
        key: the model's name, input shapes and device, as the cache knows it.
        split_at: for a model cut at named submodules, where each layer but the first
            begins (empty for an ``nn.Sequential``, whose layers are cut by count).
    """

    name: str
    layers: tuple[LayerCost, ...]
    input_bytes: float
    source: str
    key: str = ""
    split_at: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "key": self.key,
                "input_bytes": self.input_bytes, "split_at": list(self.split_at),
                "layers": [asdict(layer) for layer in self.layers]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        try:
            layers = tuple(LayerCost(**{**layer, "tp": Collectives(**layer["tp"])})
                           if layer.get("tp") else LayerCost(**layer)
                           for layer in data["layers"])
            return cls(str(data["name"]), layers,
                       float(data["input_bytes"]), str(data["source"]), str(data.get("key", "")),
                       tuple(data.get("split_at", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConveyorError(f"cannot read the profile: {exc!r}; profiles are written by "
                                "ModelProfile.save") from None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConveyorError(f"cannot read the profile {path}: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def of(cls, name: str, figures: Sequence[LayerFigures],
           seconds: Sequence[tuple[float, float]], source: str) -> ModelProfile:
        """The profile of layers measured as ``figures``, each taking ``seconds`` (its
        forward and backward, per sample)."""
        layers = tuple(LayerCost(f.name, forward, backward, f.parameters,
                                 float(f.parameter_bytes), f.activation_bytes, f.output_bytes)
                       for f, (forward, backward) in zip(figures, seconds, strict=True))
        return cls(name, layers, figures[0].input_bytes if figures else 0.0, source)

    @classmethod
    def from_figures(cls, figures: Sequence[LayerFigures], *, flops: float,
                     name: str = "model") -> ModelProfile:
        """A profile from FLOP counts (:func:`conveyor.observe.plan.measure`, meta works):
        forward at ``flops`` FLOP/s, backward twice the forward."""
        return cls.of(name, figures, [(f.flops / flops, 2 * f.flops / flops) for f in figures],
                      f"FLOPs at {flops:.3g} FLOP/s, backward twice forward")


def _key(name: str, sample: Any, device: torch.device, tp_plan: Any = None) -> str:
    shapes = [(tuple(t.shape), str(t.dtype)) for t in pytree.tree_leaves(sample)
              if isinstance(t, torch.Tensor)]
    planned = () if tp_plan is None else (plan_shown(tp_plan),)
    digest = hashlib.sha256(repr((name, shapes, str(device), torch.__version__, *planned)
                                 ).encode())
    return f"{name}-{digest.hexdigest()[:16]}"


def profile_model(model: nn.Module, sample: Any, *, name: str | None = None,
                  split_at: Sequence[str] | None = None, repeat: int = 3,
                  cache: str | Path | None = None, flops: float = 1e14,
                  tp_plan: str | Mapping[str, Any] | None = None) -> ModelProfile:
    """Profiles ``model`` on ``sample`` (a batch as the model takes it), layer by layer.

    An ``nn.Sequential`` is profiled per layer. Any other model is cut at ``split_at``
    (default: before each of its repeated blocks, as ``Pipeline`` finds them, and before
    its output embedding where it names one, as Hugging Face models do with
    ``get_output_embeddings()``), and each piece is one layer of the profile; what runs
    before the first block is a layer of its own (an embedding), timed with the first
    block. On the meta device the times
    come from FLOP counts at ``flops`` FLOP/s.

    Args:
        name: the model's name in the cache (default: its class name).
        repeat: timed runs per layer (the fastest counts).
        cache: a folder: a profile of the same name, input shapes and device is read
            from it instead of measured, and a new one is saved there.
        tp_plan: a tensor-parallel plan (as ``Pipeline`` takes it): each layer's
            all-reduces under it are counted, for the mesh planner to weigh.
    """
    from conveyor.graph.profile import block_times, profile_layers

    name = name or type(model).__name__
    device = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device
    key = _key(name, sample, device, tp_plan)
    path = Path(cache) / f"{key}.json" if cache is not None else None
    if path is not None and path.exists():
        return ModelProfile.load(path)
    samples = batch_size(sample)
    source = f"timed on {device.type}, batch {samples}"
    names: tuple[str, ...] = ()
    if isinstance(model, nn.Sequential):
        figures = measure(model, sample)
    else:
        names = tuple(split_at if split_at is not None else _blocks_and_head(model))
        figures = measure_split(model, sample, split_at=names)
    if device.type == "meta":
        profile = ModelProfile.from_figures(figures, flops=flops, name=name)
    elif isinstance(model, nn.Sequential):
        timed = profile_layers(model, sample, repeat=repeat)
        profile = ModelProfile.of(name, figures, [(t.forward_seconds / samples,
                                                   t.backward_seconds / samples)
                                                  for t in timed], source)
    else:
        ran, seconds = block_times(model, names, sample, repeat=repeat)
        if list(ran) != list(names):
            raise ConveyorError(f"{name}: the forward runs the blocks {ran}, not {list(names)}"
                                "; give split_at= in the order the forward runs them")
        # block_times gives forward and backward together: a third forward, as FLOPs.
        profile = ModelProfile.of(name, figures, [(0.0, 0.0)] + [
            (t / 3 / samples, 2 * t / 3 / samples) for t in seconds], source)
    profile = replace(profile, key=key, split_at=names)
    if tp_plan is not None:
        counted = collectives(model, sample, tp_plan, names)
        profile = replace(profile, layers=tuple(
            replace(layer, tp=tp) for layer, tp in zip(profile.layers, counted, strict=True)))
    if path is not None:
        profile.save(path)
    return profile


def _blocks_and_head(model: nn.Module) -> list[str]:
    from conveyor.graph.autosplit import find_blocks

    names = list(find_blocks(model).names)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, nn.Module):
        names += [name for name, module in model.named_modules() if module is head][:1]
    return names
