"""The plain model's side of :func:`conveyor.check`: a float64 copy on the CPU, run on the
whole batch, layer by layer.

A layer that draws random numbers (found by :func:`conveyor.checking.probe.probe`) runs
micro-batch by micro-batch with the pipeline's streams
(``derive_seed(step_seed, layer, microbatch)``), which is what the pipeline promises for
random layers; every other layer sees the whole batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.checking.probe import Probe, probe
from conveyor.engine.microbatch import gather, split
from conveyor.engine.recompute.rng import derive_seed, draw_step_seed, reseed
from conveyor.errors import ModelError
from conveyor.graph.calls import call_form
from conveyor.graph.source import LayerBuilder, sequential, sequential_layers
from conveyor.torchprivate import pytree

__all__: list[str] = []

Leaves = list[tuple[str, Any]]  # a value's leaves, each with its path ("['logits']")


def float64(value: Any) -> Any:
    """``value``'s tensors as CPU copies, floating ones in float64."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu", copy=True)
        return t.to(torch.float64) if t.is_floating_point() else t
    return pytree.tree_map_only(torch.Tensor, convert, value)


def plain_model(model: nn.Module | LayerBuilder, layers: int | None) -> nn.Module:
    """A float64 copy of the model on the CPU (a layer builder's model built whole).

    Raises:
        ModelError: the model is on the meta device, or is neither a module nor a builder.
    """
    if isinstance(model, nn.Module):
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            raise ModelError("conveyor.check runs the model: build it on a device, not on "
                             "the meta device (or load its weights first)")
        plain = copy.deepcopy(model).to("cpu").double()
    elif callable(model):
        if layers is None:
            raise ModelError("a layer-building function needs layers=, the number of layers")
        plain = sequential(model, layers).double()
    else:
        raise ModelError(f"conveyor.check takes an nn.Module or a function that builds layer i, "
                     f"got {type(model).__name__}")
    for param in plain.parameters():
        param.grad = None
    return plain


def leaves(value: Any) -> Leaves:
    """``value``'s leaves with their paths, tensors detached and cloned."""
    return [(pytree.keystr(path), leaf.detach().clone() if isinstance(leaf, torch.Tensor)
             else leaf) for path, leaf in pytree.tree_flatten_with_path(value)[0]]


@dataclass
class PlainRun:
    """The plain model's step on the whole batch.

    Attributes:
        outputs: per layer index, its output on the whole batch (traced: the model's
            output, under the last stage's index).
        probes: per layer index (traced: under -1, the whole model), what it does.
        per_microbatch: layer indices run micro-batch by micro-batch (random draws).
        final: the model's output on the whole batch, detached.
        loss: the loss of the whole batch.
        grads: every parameter's gradient after the step, by name (None: it has none).
    """

    outputs: dict[int, Leaves] = field(default_factory=dict)
    probes: dict[int, Probe] = field(default_factory=dict)
    per_microbatch: set[int] = field(default_factory=set)
    final: Any = None
    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


#: How a run seeds its backward: from ``loss_fn``'s value on the whole batch and the
#: whole loss, the tensor to call backward on and what to divide the gradients by after.
Seeding = Callable[[Any, torch.Tensor], tuple[torch.Tensor, float]]


def run_plain(plain: nn.Module, indices: Sequence[int], inputs: Any, targets: Any, *,
              loss_fn: Callable[[Any, Any], Any], chunks: int, seed: int,
              split_at: Sequence[str] | None, seeded: Seeding | None = None) -> PlainRun:
    """Forward and backward of the plain model on the whole batch (see the module's
    docstring for random layers). ``indices`` are the pipeline's layer indices (a
    traced model: its stages'), under which the outputs are kept. ``seeded``: how to
    seed the backward (default: from the whole loss, as a user's step does)."""
    torch.default_generator.manual_seed(seed)
    step_seed = draw_step_seed()
    result = PlainRun()
    if split_at is None:
        h = inputs
        for i, (name, module) in zip(indices, sequential_layers(plain)):
            given = h
            result.probes[i] = found = probe(
                module, lambda m: m(pytree.tree_map_only(torch.Tensor, _detached, given)),
                prefix=name)
            if found.random:
                result.per_microbatch.add(i)
                h = _per_microbatch(lambda part, m: module(part), h, chunks,
                                    lambda m: derive_seed(step_seed, i, m), _device_of(module))
            else:
                h = module(h)
            result.outputs[i] = leaves(h)  # now: a later layer may change it in place
    else:
        args = inputs
        result.probes[-1] = found = probe(
            plain, lambda m: _call(m, pytree.tree_map_only(torch.Tensor, _detached, args)))
        if found.random:
            result.per_microbatch.add(-1)
            h = traced_per_microbatch(plain, inputs, chunks, step_seed, split_at)
        else:
            h = _call(plain, inputs)
        result.outputs[indices[-1]] = leaves(h)
    result.final = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, h)
    value = loss_fn(h, targets)
    result.loss = whole_loss(lambda *_: value, h, targets)
    start, divisor = seeded(value, result.loss) if seeded else (result.loss, 1.0)
    try:
        start.backward()
    except RuntimeError as exc:
        raise ModelError(f"the plain model's backward fails on this batch, so there is "
                         f"nothing to compare the pipeline with: {exc}") from exc
    for name, param in plain.named_parameters():
        if param.grad is not None and divisor != 1.0:
            param.grad.div_(divisor)
        result.grads[name] = None if param.grad is None else param.grad.detach().clone()
    return result


def forward_whole(plain: nn.Module, inputs: Any, traced: bool) -> Any:
    """The plain model's forward on ``inputs``: called as a traced pipeline calls it,
    or (an ``nn.Sequential``) on the batch."""
    return _call(plain, inputs) if traced else plain(inputs)


def whole_loss(loss_fn: Callable[[Any, Any], Any], output: Any, targets: Any) -> torch.Tensor:
    """``loss_fn`` on a whole batch: its value, or ``loss_sum / count`` for a pair."""
    value = loss_fn(output, targets)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        total, count = value
        return total.reshape(()) / float(count)
    return value.reshape(())


def _device_of(model: nn.Module) -> torch.device:
    """Where ``model`` runs (its first parameter or buffer; the CPU without either)."""
    return next((t.device for t in (*model.parameters(), *model.buffers())),
                torch.device("cpu"))


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _call(model: nn.Module, batch: Any) -> Any:
    """The plain model called on ``batch`` as a traced pipeline calls it (a Hugging
    Face model with ``use_cache=False`` where the batch leaves it out)."""
    args, kwargs = call_form(model, batch).call(batch)
    return model(*args, **kwargs)


def _per_microbatch(run: Callable[[Any, int], Any], batch: Any, chunks: int,
                    seed_of: Callable[[int], int], device: torch.device) -> Any:
    outputs = []
    for m, part in enumerate(split(batch, chunks)):
        reseed(device, seed_of(m))
        outputs.append(run(part, m))
    return gather(outputs)


def traced_per_microbatch(plain: nn.Module, inputs: Any, chunks: int, step_seed: int,
                           split_at: Sequence[str]) -> Any:
    """The model micro-batch by micro-batch, reseeded where each traced stage begins
    with that stage's stream, as the pipeline's stages draw."""
    current = [0]
    device = _device_of(plain)

    def reseed_at(stage: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            reseed(device, derive_seed(step_seed, stage, current[0]))
        return hook

    handles = [plain.get_submodule(name).register_forward_pre_hook(reseed_at(k + 1))
               for k, name in enumerate(split_at)]

    def run(part: Any, m: int) -> Any:
        current[0] = m
        return _call(plain, part)

    try:
        return _per_microbatch(run, inputs, chunks, lambda m: derive_seed(step_seed, 0, m),
                               device)
    finally:
        for handle in handles:
            handle.remove()
