"""Binding a traced model's stages to the model's own tensors.

Each stage's graph reads a parameter, buffer or constant where the model keeps it, under
the model's name for it. A parameter that several stages use (tied embeddings) is read by
the lowest of them under the name that holds it, and by each other stage through a copy
installed under another of its names (or, lacking one, under ``<name>@stage<k>``, kept
out of state dicts); the copies are :class:`TiedParameter` s whose gradients the
pipeline sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind
from torch.utils.weak import WeakIdKeyDictionary

from conveyor.engine.ties import TiedParameter
from conveyor.errors import ModelError
from conveyor.graph.tracedstage import Binding, CutPlan
from conveyor.graph.weights import SHARD, Placement

__all__: list[str] = []

# A tied weight's copy made by a cut -> the weight (both alive only while the model is).
_copies_of: WeakIdKeyDictionary = WeakIdKeyDictionary()

#: Between a parameter's name and the stage of a copy that has no other name.
COPY_MARK = "@stage"


class Binder:
    """Binds the stages' graphs to the model's tensors: each stage reads a parameter,
    buffer or constant where the model keeps it; a parameter several stages use (tied
    embeddings) is read by the lowest of them under the name that holds it and by each
    other through a copy installed under another of its names."""

    def __init__(self, model: nn.Module, plans: Mapping[bool, CutPlan],
                 devices: Mapping[int, torch.device]) -> None:
        self.model = model
        self.originals = dict(model.named_parameters(remove_duplicate=False))
        self.devices = devices
        self.placement = Placement({})
        self.aliases: dict[int, list[str]] = {}
        for name, tensor in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]:
            self.aliases.setdefault(id(tensor), []).append(name)
        self.ties: list[TiedParameter] = []
        self._tie_names: dict[int, dict[int, str]] = {}  # tensor -> stage -> its name
        self._ties_by_tensor: dict[int, TiedParameter] = {}
        self._copies: dict[tuple[int, int], tuple[nn.Module, str]] = {}
        self._used: set[int] = set()
        self._find_ties(plans)

    def _find_ties(self, plans: Mapping[bool, CutPlan]) -> None:
        """Every parameter several stages use, with a name per stage: the same on every
        rank, whichever stages it builds."""
        stages_of: dict[str, set[int]] = {}
        for plan in plans.values():
            for spec in plan.program.graph_signature.input_specs:
                used_by = plan.uses.get(spec.arg.name, set())
                if spec.kind == InputKind.BUFFER and used_by:
                    self._used.add(id(self.model.get_buffer(spec.target)))
                if spec.kind == InputKind.PARAMETER:
                    stages_of.setdefault(spec.target, set()).update(used_by)
        for target, used_by in stages_of.items():
            tensor = self.originals[target]
            if used_by:
                self._used.add(id(tensor))
            if len(used_by) < 2 or id(tensor) in self._tie_names:
                continue
            stages = sorted(used_by)
            held = self._holding_name(tensor)
            spare = [n for n in self.aliases[id(tensor)] if n != held]
            # A parameter read by more stages than it has names (a position table read
            # by every block) gives each further copy a name of its own beside it.
            spare += [f"{held}{COPY_MARK}{k}" for k in stages[len(spare) + 1:]]
            names = [held, *spare[:len(stages) - 1]]
            self._tie_names[id(tensor)] = dict(zip(stages, names))
            self._ties_by_tensor[id(tensor)] = tie = TiedParameter(
                names=tuple(names), stages=tuple(stages), counted=stages[0] in self.devices)
            self.ties.append(tie)

    def _holding_name(self, tensor: torch.Tensor) -> str:
        """A name under which ``tensor`` is still the model's (a tie's other names may
        hold copies by now)."""
        return next(n for n in self.aliases[id(tensor)]
                    if self.model.get_parameter(n) is tensor)

    def bind(self, plan: CutPlan, k: int) -> list[Binding]:
        """Stage k's parameters, buffers and constants, placed on its device."""
        device = self.devices[k]
        bindings = []
        for spec in plan.program.graph_signature.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.USER_INPUT or k not in plan.uses.get(name, ()):
                continue
            if spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                bindings.append(Binding(name, "constant", None, "",
                                        _constant(plan, spec.target, device)))
                continue
            owner_name, _, attribute = spec.target.rpartition(".")
            if spec.kind == InputKind.BUFFER:
                owner = self.model.get_submodule(owner_name)
                self.placement.devices[id(getattr(owner, attribute))] = device
                bindings.append(Binding(name, "buffer", owner, attribute))
                continue
            tensor = self.originals[spec.target]
            names = self._tie_names.get(id(tensor))
            if names is None or k == min(names):
                owner_name, _, attribute = self._holding_name(tensor).rpartition(".")
                owner = self.model.get_submodule(owner_name)
                if names is not None and id(tensor) not in self.placement.devices:
                    self._ties_by_tensor[id(tensor)].copies.append(getattr(owner, attribute))
                self.placement.devices[id(tensor)] = device
            else:
                owner, attribute = self._copy(tensor, names[k], k)
            bindings.append(Binding(name, "parameter", owner, attribute))
        return bindings

    def _copy(self, tensor: torch.Tensor, name: str, k: int) -> tuple[nn.Module, str]:
        """Stage k's copy of a tied ``tensor``, installed under ``name``."""
        key = (id(tensor), k)
        if key not in self._copies:
            owner_name, _, attribute = name.rpartition(".")
            owner = self.model.get_submodule(owner_name)
            value = (torch.empty_like(tensor) if tensor.is_meta  # given a value by fill()
                     else tensor.detach().to(self.devices[k], copy=True))
            copy = nn.Parameter(value, requires_grad=tensor.requires_grad)
            if hasattr(tensor, SHARD):  # a copy of a tensor-parallel shard: the same rows
                setattr(copy, SHARD, getattr(tensor, SHARD))
            setattr(owner, attribute, copy)
            _copies_of[copy] = tensor
            if COPY_MARK in attribute:
                keep_out_of_state_dict(owner, attribute)
            self.placement.devices[id(copy)] = self.devices[k]
            self.placement.aliases[id(copy)] = self.aliases[id(tensor)]
            self._ties_by_tensor[id(tensor)].copies.append(copy)
            self._copies[key] = owner, attribute
        return self._copies[key]

    def place_unused(self, devices: Mapping[int, torch.device]) -> None:
        """Tensors no stage reads (an unused head, a buffer of an unused module) stay
        with stage 0, so that the model's state_dict keeps every key somewhere."""
        if 0 not in devices:
            return
        bound = set(self.placement.devices) | self._used
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            if id(tensor) not in bound:
                self.placement.devices[id(tensor)] = devices[0]


def keep_out_of_state_dict(owner: nn.Module, attribute: str) -> None:
    """The copy ``owner.<attribute>`` (named ``<name>@stage<k>``) stays out of state
    dicts: saved under the parameter's own name where the process lacks it (its stage
    under torchrun), loaded from that name."""
    own = attribute.split(COPY_MARK)[0]

    def saving(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
        value = state.pop(prefix + attribute, None)
        if value is not None:
            state.setdefault(prefix + own, value)

    def loading(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        if prefix + own in state:
            state[prefix + attribute] = state[prefix + own]

    owner.register_state_dict_post_hook(saving)
    owner.register_load_state_dict_pre_hook(loading)


def restore_ties(model: nn.Module) -> None:
    """Puts back the weights that an earlier cut of ``model`` replaced with per-stage
    copies (where the weight is still the model's), so that the model is traced as it
    was built: tied, and with the tensors of a trace kept for it."""
    held = {id(p) for p in model.parameters()}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            original = _copies_of.get(param) if param is not None else None
            if original is not None and id(original) in held:
                if COPY_MARK in name:  # a name the cut made: gone with the copy
                    del module._parameters[name]
                else:
                    module._parameters[name] = original  # type: ignore[assignment]


def _constant(plan: CutPlan, target: str, device: torch.device) -> Any:
    """A constant the traced graph reads (a tensor made in forward), on ``device``."""
    value = plan.program.constants[target]
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_meta:
        raise ModelError(
            f"the model's forward makes a tensor constant ({target}) that, traced on the "
            "meta device, has no value; build the model on a real device, or make the "
            "constant a buffer of the module (register_buffer) so it is initialised")
    return value.to(device)
