"""What a forward changes that a pipeline cannot give the plain model's meaning, found
at a stage's first forward and refused with its name.

:mod:`~conveyor.engine.recompute.sideeffects` puts back, around each recomputation,
the buffers, tensor and plain attributes and generators a stage's modules hold. Three
kinds of change are beyond it, and would make a pipeline train differently from the
plain model without a word:

* **state that crosses stages**: a tensor, generator, container or module held by the
  modules of two stages (one buffer object in two layers, one module used in two
  stages), which a forward writes. Each stage runs its micro-batches at its own time,
  so a later stage reads it as another micro-batch left it, not as the plain model's
  order would (:func:`find_shared` finds them when the pipeline is built);
* **a Python container changed in forward** (a list appended to, a dict counted, a
  set added to) in a stage that recomputes: the recomputation changes it again;
* **a parameter changed in place in forward** (WGAN's ``self.weight.clamp_()`` under
  ``torch.no_grad()``, or through ``.data``): a micro-batch's backward would use the
  weight as a later micro-batch's forward left it (autograd refuses it mid-step, or,
  through ``.data``, nobody does).

A stage looks once per mode (training or not, recomputed or not), at its first forward
in that mode: before it, it notes each container's contents, each parameter's version
and sum, and each shared object's state, and compares after. Every later action pays a
set lookup. A change that only a later step makes is not seen (documented in
``docs/limits.md``). A module declares an attribute's changes harmless by listing its
name in ``conveyor_harmless`` (a class or instance attribute: ``conveyor_harmless =
("seen",)``); the pipeline then leaves that attribute alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.errors import ModelError

__all__: list[str] = []

#: The attribute in which a module lists the names of attributes whose changes in
#: forward it declares harmless.
HARMLESS = "conveyor_harmless"
_CONTAINERS = (list, dict, set)
_INTERNAL = frozenset(nn.Module().__dict__)  # torch's own bookkeeping (hooks, children)


@dataclass
class Shared:
    """One object held by the modules of two or more stages.

    Attributes:
        value: the tensor, generator, container or module.
        holders: where each stage holds it: ``(stage, "layer.attribute")``.
    """

    value: Any
    holders: list[tuple[int, str]] = field(default_factory=list)

    def describe(self) -> str:
        kinds = {torch.Generator: "generator", nn.Module: "module", torch.Tensor: "tensor"}
        kind = next((k for t, k in kinds.items() if isinstance(self.value, t)),
                    type(self.value).__name__)
        places = " and ".join(f"{name} (stage {stage})" for stage, name in self.holders)
        return f"one {kind} object held as {places}"


def find_shared(stage_layers: Mapping[int, Iterable[tuple[str, nn.Module]]]
                ) -> dict[int, list[Shared]]:
    """The objects that the layers of more than one stage hold (not parameters, which
    the pipeline ties), listed for each stage that holds them.

    Args:
        stage_layers: every stage's (name, layer) pairs, as the user's model holds them.
    """
    found: dict[int, Shared] = {}
    for stage, named in stage_layers.items():
        for layer_name, layer in named:
            for name, module in layer.named_modules(prefix=layer_name, remove_duplicate=False):
                for key, value in _state(module):
                    _note(found, value, stage, f"{name}.{key}")
                if module._buffers or _watches_attributes(module):
                    _note(found, module, stage, name)
    by_stage: dict[int, list[Shared]] = {}
    for shared in found.values():
        stages = {stage for stage, _ in shared.holders}
        if len(stages) > 1:
            for stage in sorted(stages):
                by_stage.setdefault(stage, []).append(shared)
    return by_stage


def _note(found: dict[int, Shared], value: Any, stage: int, where: str) -> None:
    shared = found.setdefault(id(value), Shared(value))
    if all(s != stage for s, _ in shared.holders):
        shared.holders.append((stage, where))


def _watches_attributes(module: nn.Module) -> bool:
    """Whether ``module``'s attributes may hold the user's state: not torch's own
    modules (they keep state in buffers), nor conveyor's (its stages and graphs fill
    caches of their own at a first call)."""
    return not type(module).__module__.startswith(("torch.", "conveyor."))


def _state(module: nn.Module) -> list[tuple[str, Any]]:
    """The state ``module`` holds that a forward may change: its buffers, and (unless
    it is one of torch's own modules) its tensor, generator and container attributes,
    but those it declares harmless."""
    harmless = set(getattr(module, HARMLESS, ()))
    held: list[tuple[str, Any]] = [(k, v) for k, v in module._buffers.items()
                                   if v is not None]
    if _watches_attributes(module):
        held += [(k, v) for k, v in module.__dict__.items()
                 if k not in _INTERNAL and isinstance(v, (torch.Tensor, torch.Generator,
                                                          *_CONTAINERS))
                 and not isinstance(v, nn.Parameter)]
    return [(k, v) for k, v in held if k not in harmless]


def _snapshot(value: Any) -> Any:
    """What :func:`_same` compares ``value`` with after a forward."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, nn.Module):
        return dict(value._buffers), dict(value.__dict__) if _watches_attributes(value) else {}
    if isinstance(value, dict):
        return list(value.items())
    return list(value)


def _same(value: Any, before: Any) -> bool:
    if isinstance(value, torch.Tensor):
        if value.shape != before.shape or torch.equal(value, before):
            return value.shape == before.shape
        return value.is_floating_point() and bool(
            ((value == before) | (value.isnan() & before.isnan())).all())
    if isinstance(value, torch.Generator):
        return torch.equal(value.get_state(), before)
    if isinstance(value, nn.Module):
        return _entries_same(value._buffers, before[0]) and (
            not before[1] or _entries_same(value.__dict__, before[1]))
    now = list(value.items()) if isinstance(value, dict) else list(value)
    if isinstance(value, set):
        return len(now) == len(before) and set(now) == set(before)
    return len(now) == len(before) and all(a is b or a == b for a, b in zip(now, before))


def _entries_same(now: dict[str, Any], then: dict[str, Any]) -> bool:
    return now.keys() == then.keys() and all(now[k] is then[k] for k in now)


class FirstLook:
    """A stage's look at its first forward in each mode (see the module's docstring).

    Args:
        stage: the stage's number, for messages.
        modules: gives every module the stage's forward may run.
    """

    def __init__(self, stage: int, modules: Callable[[], Iterable[nn.Module]]) -> None:
        self.stage = stage
        self._modules = modules
        #: the objects this stage shares with others (:func:`find_shared`)
        self.shared: list[Shared] = []
        #: the model's names of modules and parameters, by id (for messages)
        self.names: dict[int, str] = {}
        self._done: set[tuple[bool, bool]] = set()

    def due(self, training: bool, recomputed: bool) -> bool:
        """Whether a forward in this mode is the stage's first (cheap: every action asks)."""
        return (training, recomputed) not in self._done

    def watching(self, run: Callable[[Any], Any], training: bool, recomputed: bool,
                 microbatch: int) -> Callable[[Any], Any]:
        """``run``, looked at on its first call (a recomputation's calls pass through).

        Raises (from the returned function):
            ModelError: the forward changed state shared with another stage, a
                container in a recomputed stage, or a parameter.
        """
        self._done.add((training, recomputed))
        called = False

        def looked(inputs: Any) -> Any:
            nonlocal called
            if called:
                return run(inputs)
            called = True
            before = self._look(recomputed)
            outputs = run(inputs)
            self._compare(before, microbatch, recomputed)
            return outputs
        return looked

    def _look(self, recomputed: bool) -> dict[str, list[tuple[Any, ...]]]:
        modules = list({id(m): m for m in self._modules()}.values())
        params = list({id(p): p for m in modules for p in m.parameters(recurse=False)
                       if type(p.data) is torch.Tensor}.values())  # (not FSDP's shards)
        with torch.no_grad():
            sums = [p.detach().sum() for p in params]
        containers = [(m, k, v, _snapshot(v)) for m in modules for k, v in _state(m)
                      if isinstance(v, _CONTAINERS)] if recomputed else []
        return {"params": [(p, p._version, s) for p, s in zip(params, sums)],
                "containers": containers,
                "shared": [(s, _snapshot(s.value)) for s in self.shared]}

    def _compare(self, before: dict[str, list[tuple[Any, ...]]], microbatch: int,
                 recomputed: bool) -> None:
        where = f"stage {self.stage}'s forward of micro-batch {microbatch}"
        for shared, snapshot in before["shared"]:
            if not _same(shared.value, snapshot):
                raise ModelError(
                    f"state shared across stages: {where} changed {shared.describe()}: "
                    "each stage runs its "
                    "micro-batches at its own time (in its own process under torchrun), so "
                    "another stage would read it as some other micro-batch left it, not in "
                    "the plain model's order. Put those modules in one stage (balance=[...] "
                    "on an nn.Sequential, or another split_at), or give each its own object")
        for param, version, total in before["params"]:
            with torch.no_grad():
                now = param.detach().sum()
            if param._version != version or not (torch.equal(now, total) or bool(
                    now.isnan() and total.isnan())):
                name = self.names.get(id(param), "a parameter")
                raise ModelError(
                    f"{where} changed the parameter {name} in place (a clamp_ under "
                    "torch.no_grad() or through .data, as WGAN's critic does): in a pipeline, "
                    "a micro-batch's backward would use the weight as later micro-batches' "
                    "forwards left it. Change it after optimizer.step() instead (WGAN's own "
                    "loop clamps there), or compute the changed weight in forward without "
                    "writing it (torch.nn.utils.parametrize)")
        for module, key, value, snapshot in before["containers"]:
            if not _same(value, snapshot):
                name = self.names.get(id(module), type(module).__name__) or "the model"
                raise ModelError(
                    f"{where} changed {name}.{key} ({type(value).__name__}, "
                    f"{type(module).__name__}) in place, and the stage recomputes its "
                    "forward for backward, which would change it again (the plain model "
                    "changes it once per micro-batch). Keep it out of forward, pass "
                    "recompute=\"never\", or, if the change does not matter (a log), declare "
                    f"it harmless: {type(module).__name__}.{HARMLESS} = ({key!r},)")
