"""Storage and values for a model built on the meta device, one stage's tensors at a time.

Built under ``torch.device("meta")``, a model costs no memory; each rank of a pipeline
then gives storage only to the tensors its stages read. Their values come, in this order:

1. from ``weights``: a plain model's ``state_dict``, a file of one, or a model directory
   as stored (sharded safetensors and their index, ``pytorch_model.bin``: each shard
   opened only when one of this process's tensors is in it, see
   :mod:`conveyor.graph.modeldir`), looked up under any of the tensor's names (a tied
   head is found under its embedding's name);
2. else from the user's ``init_fn(module)``, called on each module that owns such a
   tensor;
3. else from the model's own initialiser (Hugging Face's ``_init_weights(module)``);
4. else from each module's ``reset_parameters()``.

Each module is initialised under its own seed, derived from one seed and the module's
qualified name alone: torch's seed (``torch.initial_seed()``, what ``torch.manual_seed``
last set, not the generator's state: draws made since do not change it), or ``seed=``.
So a model cut into 1, 2 or 4 stages, on any ranks, starts from the same weights, a
module of one name gets the same values in models of other shapes, and
:func:`initialize` gives the whole model those same weights in one process (the plain
model to compare with).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.engine.recompute.rng import derive_seed
from conveyor.errors import ModelError
from conveyor.graph.modeldir import Weights as Weights
from conveyor.graph.modeldir import stored

__all__ = ["initialize"]

InitFn = Callable[[nn.Module], None]
#: The attribute of a parameter that is one rank's shard of a tensor-parallel weight
#: (:mod:`conveyor.tensor`): (dimension, index, parts) of the whole tensor; ``weights=``
#: reads that slice of the whole tensor it holds.
SHARD = "_conveyor_shard"
_INIT_STREAM = 1 << 40  # keeps initialisation seeds apart from dropout's micro-batch seeds


def draw_init_seed() -> int:
    """The seed all initialisations derive from: torch's seed, as ``torch.manual_seed``
    last set it (``torch.initial_seed()``); the generator's state is neither read nor
    advanced, so the weights do not depend on what was drawn before."""
    return torch.initial_seed()


@contextlib.contextmanager
def seeded(init_seed: int, index: int, device: torch.device) -> Iterator[None]:
    """torch's generators seeded for item ``index`` of an initialisation, then restored."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(init_seed, index, _INIT_STREAM))
        yield


@dataclass
class Placement:
    """The tensors of a model one process holds, and where: by ``id`` of the tensor.

    Attributes:
        devices: the device of each tensor held.
        aliases: more names to find a tensor's value under in ``weights`` (a tie's copy:
            the names of the weight it copies).
    """

    devices: dict[int, torch.device]
    aliases: dict[int, list[str]] = field(default_factory=dict)

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.devices


def initialize(model: nn.Module, *, device: torch.device | str = "cpu",
               init_fn: InitFn | None = None, weights: Weights | None = None,
               seed: int | None = None) -> nn.Module:
    """Gives every meta tensor of ``model`` storage on ``device`` and the values a
    pipeline built from the same model (after ``torch.manual_seed(seed)``) gives its
    stages; tensors already real are moved to ``device``. Returns ``model``.

    Each module's values depend only on ``seed`` and its qualified name: its
    initialiser runs with torch's generators seeded from the two (then restored), so
    they do not depend on the generators' state, on the other modules, or on how the
    model is cut.

    Args:
        model: the model, built on the meta device (its real tensors are moved).
        device: where the tensors get storage.
        init_fn: how the tensors are initialised (see the module's docstring).
        weights: a state dict, a file of one, or a model directory as stored (see
            :mod:`conveyor.graph.modeldir`) to load them from instead.
        seed: the seed of the whole model (default: torch's seed, as the last
            ``torch.manual_seed`` set it, which a pipeline uses too).

    Raises:
        ModelError: a module has tensors but no way to initialise them, or ``weights``
            lacks a tensor.
    """
    device = torch.device(device)
    tensors = [*model.parameters(), *model.buffers()]
    fill(model, Placement({id(t): device for t in tensors}), init_fn=init_fn, weights=weights,
         init_seed=draw_init_seed() if seed is None else seed)
    return model


def fill(model: nn.Module, placement: Placement, *, init_fn: InitFn | None,
         weights: Weights | None, init_seed: int) -> dict[int, torch.Tensor]:
    """Gives the tensors of ``model`` that ``placement`` holds storage on their devices
    and their values (see the module docstring); others are left as they are.

    Returns:
        The tensors that replaced meta tensors in the model (and in ``placement``), by
        ``id`` of the meta tensor each replaced: references to those held elsewhere
        must be updated.
    """
    replaced = _materialize(model, placement)
    meta = {id(t) for t in replaced.values()}
    if not meta:
        return replaced
    initialiser = _initialiser_of(model, init_fn)
    with torch.no_grad(), _untied(model, meta):
        # Children before parents, as nn.Module.apply and the modules' own constructors
        # go (a parent may re-initialise a child's tensors, as Hugging Face models do).
        below: dict[int, torch.Tensor] = {}  # module -> a meta tensor in it or under it
        for name, module in _post_order(model):
            found = next((t for t in _own_tensors(module) if id(t) in meta), None)
            if found is None:
                found = next((below[id(c)] for c in module.children() if id(c) in below),
                             None)
            if found is None:
                continue
            below[id(module)] = found
            init = initialiser(module)
            if init is None:
                if weights is not None or not any(id(t) in meta for t in _own_tensors(module)):
                    continue  # from the weights, or a container of initialised modules
                raise ModelError(
                    f"{name or 'the model'} ({type(module).__name__}) was built on the meta "
                    "device and has tensors, but no reset_parameters() to initialise them; "
                    "pass init_fn=<a function that initialises a module> or weights=<a "
                    "state_dict or checkpoint file of the plain model>")
            with seeded(init_seed, zlib.crc32(name.encode()), placement.devices[id(found)]):
                init()
        if weights is not None:
            _load(model, placement, meta, weights)
    return replaced


@contextlib.contextmanager
def _untied(model: nn.Module, meta: set[int]) -> Iterator[None]:
    """Within: a tensor that several modules hold (tied embeddings) is held by the first
    of them alone, the others given scratch tensors to initialise. So its value comes
    from its first module's initialiser, whichever other modules hold it in this process
    (a pipeline stage may hold a copy instead).
    """
    slots: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for table, name, tensor in tensor_slots(model):
        if id(tensor) in meta:
            slots.setdefault(id(tensor), []).append((table, name))
    shared = {key: found for key, found in slots.items() if len(found) > 1}
    originals = {key: found[0][0][found[0][1]] for key, found in shared.items()}
    for key, found in shared.items():
        tensor = originals[key]
        for table, name in found[1:]:
            scratch = torch.empty_like(tensor)
            table[name] = (nn.Parameter(scratch, requires_grad=tensor.requires_grad)
                           if isinstance(tensor, nn.Parameter) else scratch)
    try:
        yield
    finally:
        for key, found in shared.items():
            for table, name in found[1:]:
                table[name] = originals[key]


def _materialize(model: nn.Module, placement: Placement) -> dict[int, torch.Tensor]:
    """Moves the held tensors to their devices. A meta tensor is replaced, in every
    module holding it, by an empty tensor on its device (and ``placement`` updated);
    returns those replacements, by ``id`` of the meta tensor they replace."""
    replaced: dict[int, torch.Tensor] = {}
    for table, name, tensor in tensor_slots(model):
        if not placement.holds(tensor):
            continue
        if id(tensor) in replaced:
            table[name] = replaced[id(tensor)]
            continue
        device = placement.devices[id(tensor)]
        if tensor.is_meta and device.type != "meta":  # (a planner's stages stay on meta)
            empty = torch.empty_like(tensor, device=device)
            table[name] = replaced[id(tensor)] = (
                nn.Parameter(empty, requires_grad=tensor.requires_grad)
                if isinstance(tensor, nn.Parameter) else empty)
            if hasattr(tensor, SHARD):
                setattr(replaced[id(tensor)], SHARD, getattr(tensor, SHARD))
        elif tensor.device != device:
            tensor.data = tensor.data.to(device)
    for key, new in replaced.items():
        placement.devices[id(new)] = placement.devices.pop(key)
        if key in placement.aliases:
            placement.aliases[id(new)] = placement.aliases.pop(key)
    return replaced


def _initialiser_of(model: nn.Module,
                    init_fn: InitFn | None) -> Callable[[nn.Module], Callable[[], Any] | None]:
    """The initialisation of one module: the user's, the model's own, or torch's."""
    if init_fn is not None:
        return lambda module: lambda: init_fn(module)
    own = getattr(model, "_init_weights", None)
    if callable(own):  # Hugging Face models: handles every module type they use
        return lambda module: lambda: own(module)
    return reset_of


def reset_of(module: nn.Module) -> Callable[[], Any] | None:
    """The module's own initialisation (``reset_parameters``), if it has one."""
    # nn.MultiheadAttention keeps its initialisation in _reset_parameters.
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _load(model: nn.Module, placement: Placement, meta: set[int], weights: Weights) -> None:
    """Copies the held meta tensors' values from ``weights``, under any of their names
    (and, for a Hugging Face model, with or without its base model's prefix)."""
    names: dict[int, list[str]] = {}
    persistent: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        persistent.add(id(tensor))
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    for key, more in placement.aliases.items():
        names.setdefault(key, []).extend(more)
    prefix = getattr(model, "base_model_prefix", "")
    with stored(weights) as read:
        for tensor in [*model.parameters(), *model.buffers()]:  # each once
            if id(tensor) not in meta or not placement.holds(tensor):
                continue
            aliases = list(dict.fromkeys(names.get(id(tensor), [])))
            value = next((v for v in map(read.get, _prefixed(aliases, prefix))
                          if v is not None), None)
            if value is None:
                if id(tensor) not in persistent:
                    continue  # a non-persistent buffer: the initialiser made it
                raise ModelError(f"weights= has no tensor {' or '.join(map(repr, aliases))} "
                                 f"(looked for in {read.file_of(aliases[0])}); give the plain "
                                 "model's state_dict, a file of it or its model directory")
            shard = getattr(tensor, SHARD, None)
            if shard is not None and value.shape != tensor.shape:
                dim, index, parts = shard
                value = value.chunk(parts, dim)[index]
            if value.shape != tensor.shape:
                raise ModelError(f"weights= gives {aliases[0]!r} shape {tuple(value.shape)} "
                                 f"in {read.file_of(aliases[0])}, but the model's is "
                                 f"{tuple(tensor.shape)}")
            tensor.copy_(value)


def _prefixed(names: list[str], prefix: str) -> list[str]:
    """``names``, then each without the base model's prefix where it has it (a
    ``LlamaModel``'s file read into a ``LlamaForCausalLM``), or with it where not."""
    if not isinstance(prefix, str) or not prefix:
        return names
    start = prefix + "."
    return [*names, *(n[len(start):] if n.startswith(start) else start + n for n in names)]


def tensor_slots(model: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Every place a module of ``model`` holds a parameter or buffer: (its module's
    table, its name there, the tensor); a tensor held by several modules, once each."""
    found = []
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            found += [(table, name, tensor) for name, tensor in table.items()
                      if tensor is not None]
    return found


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    order: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))
    visit("", model)
    return order


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values())
            if t is not None]
