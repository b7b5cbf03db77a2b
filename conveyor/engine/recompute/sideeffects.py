"""What a stage's forward changes in its modules, put back around a recomputation.

A forward may change the state its modules hold: a buffer updated in place (batch norm's
running statistics, a step counter, an exponential average, spectral norm's power
iteration, a quantization observer's range), a buffer or tensor attribute replaced
(``self.count = self.count + 1``; a traced stage writes its buffer updates back that
way), a plain value rebound (``self.calls += 1``). Recomputation runs the forward a
second time, later, after other micro-batches changed that state again: to rebuild the
graph the first run made, it must see the state the first run saw, and it must leave
the state as it finds it.

conveyor finds these changes by watching, not by a list of module types::

    before F(m)   record each module's attributes and buffers (objects and tensor
                  versions); keep a copy of each tensor changed since the last look
    F(m)          the forward, as the plain model runs it
    after F(m)    what was rebound or whose version moved: keep its value before F(m)
    B(m)          recompute with those values put in place (copies, so the
                  recomputation's own changes fall on them), then put back what was
                  there before the recomputation

A tensor changed in place needs a copy of its value from before the forward, and a
version counter cannot give one after the fact: :class:`ModuleState` keeps one copy of
each tensor it watches, refreshed only when the tensor's version moved since the last
look, so a tensor no forward changes is copied once, and a counter updated by every
forward once per forward. What cannot be watched this way is documented, not guessed:
Python containers changed in place (a list appended to: refused at a stage's first
forward, :mod:`~conveyor.engine.recompute.firstlook`), state outside the modules
(closures of hooks, globals, random generators that no module holds).

A ``torch.Generator`` a module holds (``self.gen``, drawn from with ``generator=``) is
state too: its state before the forward is put in place for the recomputation, and its
state then put back, as :mod:`~conveyor.engine.recompute.rng` replays torch's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import is_
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConveyorError

__all__: list[str] = []

_MISSING: Any = object()  # an attribute that did not exist


@dataclass
class SideEffects:
    """What one forward changed: for each changed entry of a module's ``__dict__`` or
    ``_buffers``, the value it held before the forward (``_MISSING``: none).

    Filled by :meth:`ModuleState.run`; empty until then, and for a forward that
    changed nothing."""

    changed: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)
    #: each generator the forward drew from, with its state before the forward
    generators: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)

    def put_before(self) -> list[Any]:
        """Puts the values from before the forward in place (a copy of each tensor, so
        that a recomputation's own changes fall on the copy); returns what was there."""
        current: list[Any] = [generator.get_state() for generator, _ in self.generators]
        for generator, state in self.generators:
            generator.set_state(state)
        copies: dict[int, torch.Tensor] = {}  # one per tensor: a tied buffer stays tied
        for holder, key, before in self.changed:
            current.append(holder.get(key, _MISSING))
            if before is _MISSING:
                holder.pop(key, None)
            elif _watched(before):
                if id(before) not in copies:
                    copies[id(before)] = before.clone()
                holder[key] = copies[id(before)]
            else:
                holder[key] = before
        return current

    def put_back(self, current: list[Any]) -> None:
        """Puts back what :meth:`put_before` returned."""
        for (generator, _), state in zip(self.generators, current):
            generator.set_state(state)
        current = current[len(self.generators):]
        for (holder, key, _), value in zip(self.changed, current):
            if value is _MISSING:
                holder.pop(key, None)
            else:
                holder[key] = value


def refuse_on_replicas(effects: SideEffects, modules: Iterable[tuple[str, nn.Module]],
                       stage: int, microbatch: int, *, pooled: tuple[type, ...]) -> None:
    """Raises if a forward of a replicated stage changed its modules' state: each
    replica runs only some of the micro-batches, so that state would differ between
    them, and from the plain model's (``pooled``: module types whose changes are pooled
    over the replicas at the end of the step, such as deferred batch norm).

    Raises:
        ConveyorError: naming the layer and what changed, once the forward's changes
            are undone.
    """
    if not effects.changed:
        return
    owners = {id(holder): (name, module) for name, module in modules
              for holder in _holders(module)}
    for holder, key, _ in effects.changed:
        name, module = owners.get(id(holder), ("?", None))
        if not isinstance(module, pooled):
            effects.put_before()  # the step fails: the state stays as it was
            raise ConveyorError(
                f"stage {stage}'s forward of micro-batch {microbatch} changed "
                f"{name or 'the stage'}.{key} ({type(module).__name__}): the stage has "
                "several replicas, each running only some micro-batches, so that state "
                "would differ between them and from the plain model's. Give this stage "
                "one replica (data_parallel=[...]), or for batch norm pass "
                "deferred_batch_norm=True (its statistics are pooled over the replicas)")


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version, and cannot be changed
        return None


def _holders(module: nn.Module) -> list[dict[str, Any]]:
    """Where ``module`` may keep state a forward changes: its buffers, and its
    attributes unless it is one of torch's own modules (those keep their state in
    buffers; skipping their thirty-odd attributes each keeps the watch cheap)."""
    holders = [module._buffers] if module._buffers else []
    if not type(module).__module__.startswith("torch."):
        holders.append(module.__dict__)
    return holders


def _watched(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
        and not value.requires_grad


class _Look:
    """One holder (a module's ``__dict__`` or ``_buffers``) before a forward."""

    __slots__ = ("holder", "training", "tensors", "before", "generators")

    def __init__(self, holder: dict[str, Any], training: bool,
                 tensors: list[tuple[str, torch.Tensor]],
                 generators: list[torch.Generator]) -> None:
        self.holder = holder
        self.training = training  # its module's training mode
        self.tensors = tensors  # the watched tensors it holds, by key
        self.before = dict(holder)  # a shallow copy
        # the generators it holds, with their states now
        self.generators = [(g, g.get_state()) for g in generators]


class ModuleState:
    """The state a stage's modules hold, watched across its forwards.

    Args:
        modules: gives every module the stage's forward may run (a traced stage's:
            those its graph reads, which grow when it is traced in another mode).
    """

    def __init__(self, modules: Callable[[], Iterable[nn.Module]]) -> None:
        self._modules = modules
        # By tensor id: (tensor, version, copy), the copy of its value at that version.
        # A copy is never changed: a recomputation works on a copy of it.
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        # Entries (holder, key, training) whose tensor has been compared by value after
        # a forward, and those a forward changes without moving the version counter.
        self._examined: set[tuple[int, str, bool]] = set()
        self._unversioned: set[tuple[int, str, bool]] = set()
        # By holder id: its values at the last look, the watched tensors among them and
        # the generators.
        self._seen: dict[int, tuple[list[Any], list[tuple[str, torch.Tensor]],
                                    list[torch.Generator]]] = {}

    def run(self, function: Callable[[Any], Any], inputs: Any, effects: SideEffects) -> Any:
        """``function(inputs)``, recording into ``effects`` what it changed."""
        looked = self._look()
        result = function(inputs)
        effects.changed = self._changes(looked)
        effects.generators = [(g, state) for look in looked for g, state in look.generators
                              if not torch.equal(g.get_state(), state)]
        return result

    def _look(self) -> list[_Look]:
        """Each holder as it is now; a copy of the value of each tensor that may have
        changed since the last look."""
        modules = {id(module): module for module in self._modules()}.values()
        looked = []
        copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        for module in modules:
            for holder in _holders(module):
                look = _Look(holder, module.training, *self._tensors_in(holder))
                for key, value in look.tensors:
                    version = _version(value)
                    if version is None:
                        continue
                    kept = copies.get(id(value)) or self._copies.get(id(value))
                    entry = (id(holder), key, look.training)
                    if kept is None or kept[0] is not value or kept[1] != version \
                            or entry not in self._examined or entry in self._unversioned:
                        kept = copies.get(id(value)) or (value, version, value.detach().clone())
                    copies[id(value)] = kept
                looked.append(look)
        self._copies = copies  # a tensor no longer held takes its copy with it
        return looked

    def _tensors_in(self, holder: dict[str, Any]
                    ) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Generator]]:
        """The watched tensors of ``holder``, by key, and its generators; found again
        only when one of the holder's entries was rebound since the last look (a
        module's ``__dict__`` holds some thirty entries, almost never a tensor)."""
        values = list(holder.values())
        seen = self._seen.get(id(holder))
        if seen is not None and len(seen[0]) == len(values) and all(map(is_, seen[0], values)):
            return seen[1], seen[2]
        tensors = [(key, value) for key, value in holder.items() if _watched(value)]
        generators = [value for value in values if isinstance(value, torch.Generator)]
        self._seen[id(holder)] = (values, tensors, generators)
        return tensors, generators

    def _changes(self, looked: list[_Look]) -> list[tuple[dict[str, Any], str, Any]]:
        """Each entry rebound, added, removed or changed in place since ``looked``,
        with its value then."""
        changed: list[tuple[dict[str, Any], str, Any]] = []
        for look in looked:
            holder = look.holder
            for key, old in look.tensors:
                kept = self._copies.get(id(old))
                if kept is None or kept[0] is not old or holder.get(key) is not old:
                    continue  # rebound (below), or not watched (an inference tensor)
                entry = (id(holder), key, look.training)
                if _version(old) != kept[1]:
                    self._examined.add(entry)  # its version tells
                    changed.append((holder, key, kept[2]))  # changed in place
                elif self._unversioned_change(entry, old, kept[2]):
                    changed.append((holder, key, kept[2]))  # changed, version unmoved
            if len(holder) == len(look.before) and all(
                    map(is_, holder.values(), look.before.values())):
                continue  # nothing rebound, added or removed
            for key, old in look.before.items():
                new = holder.get(key, _MISSING)
                if new is not old:
                    kept = self._copies.get(id(old))
                    changed.append((holder, key, kept[2] if kept is not None and kept[0] is old
                                    and _version(old) != kept[1] else old))
            changed += [(holder, key, _MISSING) for key in holder if key not in look.before]
        return changed

    def _unversioned_change(self, entry: tuple[int, str, bool], tensor: torch.Tensor,
                            copy: torch.Tensor) -> bool:
        """Whether ``tensor`` may have changed though its version did not move.

        Some kernels write into a tensor without moving its version counter (batch
        norm's running statistics, written by the native kernel): the first forward
        that sees an entry, in each training mode, compares its value with the copy
        (one synchronisation, once), and an entry found changed is copied and put back
        at every forward from then on."""
        if entry not in self._examined:
            self._examined.add(entry)
            if not torch.equal(tensor, copy):
                self._unversioned.add(entry)
        return entry in self._unversioned
