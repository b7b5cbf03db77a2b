"""What a module does besides computing from its inputs and parameters.

``probe(module, run)`` calls a copy of ``module`` twice on the same input, each time
with torch's generators seeded alike, and notes for every submodule (by qualified name):
the random numbers it drew (from torch's default generator, or from a generator of its
own), whether it changed its input tensors in place, which plain attributes and buffers
its forward changed (a counter, a running average), whether it is a batch norm in training mode, and which is the
innermost submodule whose two calls gave different outputs on equal inputs. The
original module is never called, so neither its state nor its statistics move.

:func:`conveyor.check` reads these facts to say why a pipeline differs from the plain
model, and to decide which layers its plain reference must run micro-batch by
micro-batch (those that draw random numbers, as the pipeline's per-micro-batch streams do).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.torchprivate import pytree, TorchDispatchMode

__all__: list[str] = []

_PROBE_SEED = 1234  # both calls draw from torch's generators seeded with this


@dataclass
class ModuleFacts:
    """What one submodule did in the probe's calls.

    Attributes:
        kind: the submodule's class name.
        random: drew from torch's default generator.
        own_generator: drew from a ``torch.Generator`` of its own (``generator=``).
        mutated_input: changed one of its input tensors in place.
        changed: its plain attributes and buffers that one call changed, as
            ``"name: old -> new"`` (a buffer: ``"name (buffer): old -> new"``).
        batch_norm: a batch norm in training mode (normalises by the batch's statistics).
    """

    kind: str
    random: bool = False
    own_generator: bool = False
    mutated_input: bool = False
    changed: list[str] = field(default_factory=list)
    batch_norm: bool = False


@dataclass
class Probe:
    """The facts of every submodule of a probed module, in ``named_modules`` order.

    Attributes:
        modules: facts by qualified name (the module itself under its own name).
        repeatable: the two calls gave equal outputs.
        unrepeatable: the innermost submodule whose outputs differed between the two
            calls although its inputs were equal (None: none did).
    """

    modules: dict[str, ModuleFacts]
    repeatable: bool = True
    unrepeatable: str | None = None

    def where(self, fact: str) -> list[str]:
        """The names of the submodules for which ``fact`` (an attribute) is true."""
        return [name for name, facts in self.modules.items() if getattr(facts, fact)]

    @property
    def random(self) -> bool:
        """Whether the module drew from torch's default generators."""
        return bool(self.where("random"))


def probe(module: nn.Module, run: Callable[[nn.Module], Any], *, prefix: str = "") -> Probe:
    """Calls ``run`` twice on a deep copy of ``module`` and notes what it did.

    Args:
        module: the module to probe (left untouched).
        run: calls the module it is given on the input (the same input both times).
        prefix: the qualified name of ``module`` in its model, prefixed to every name.
    """
    subject = copy.deepcopy(module)
    names = {id(m): _join(prefix, name) for name, m in subject.named_modules()}
    found = Probe({names[id(m)]: ModuleFacts(
        type(m).__name__, batch_norm=isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.training) for m in subject.modules()})
    before = {id(m): _attributes(m) for m in subject.modules()}
    watch = _Watch(names, found)
    handles = watch.attach(subject)
    try:
        results = [watch.call(subject, run) for _ in range(2)]
        for m in subject.modules():  # one more call than the first changed these
            found.modules[names[id(m)]].changed = _changes(before[id(m)], _attributes(m))
        found.repeatable = results[0] == results[1]
        if not found.repeatable:  # call it twice more, comparing every submodule's call
            watch.detailed = True
            calls = []
            for _ in range(2):
                watch.call(subject, run)
                calls.append(watch.calls)
            found.unrepeatable = next((name for (name, given, made), (_, given2, made2)
                                       in zip(*calls) if given == given2 and made != made2),
                                      None)
    finally:
        for handle in handles:
            handle.remove()
    return found


class _Watch(TorchDispatchMode):
    """Notes, while active, each random op by the submodule it ran in and each
    submodule that changed its input in place; ``detailed``, each submodule call's input
    and output digests too (which costs a pass over every activation)."""

    def __init__(self, names: dict[int, str], found: Probe) -> None:
        super().__init__()
        self.names = names
        self.found = found
        self.detailed = False
        self.stack: list[tuple[str, list[int], str]] = []  # name, input versions, digest
        self.calls: list[tuple[str, str, str]] = []  # name, input digest, output digest

    def call(self, subject: nn.Module, run: Callable[[nn.Module], Any]) -> str:
        """Runs ``subject`` with torch seeded for the probe; returns the output's digest."""
        self.calls = []
        torch.default_generator.manual_seed(_PROBE_SEED)
        with self:
            return digest(run(subject))

    def attach(self, subject: nn.Module) -> list[Any]:
        handles = []
        for m in subject.modules():
            handles.append(m.register_forward_pre_hook(self._enter))
            handles.append(m.register_forward_hook(self._leave, always_call=True))
        return handles

    def _enter(self, module: nn.Module, args: Any) -> None:
        tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        self.stack.append((self.names[id(module)], [t._version for t in tensors],
                           digest(args) if self.detailed else ""))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name, versions, given = self.stack.pop()
        tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        if [t._version for t in tensors] != versions or (
                self.detailed and digest(args) != given):
            self.found.modules[name].mutated_input = True
        if self.detailed:
            self.calls.append((name, given, digest(output)))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and self.stack:
            facts = self.found.modules[self.stack[-1][0]]
            if kwargs.get("generator") is None:
                facts.random = True
            else:
                facts.own_generator = True
        return func(*args, **kwargs)


def digest(value: Any) -> str:
    """A fingerprint of ``value``'s tensors (exact bytes) and other leaves."""
    h = hashlib.blake2b(digest_size=16)
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().cpu().contiguous()
            h.update(str((data.dtype, tuple(data.shape))).encode())
            if data.numel():
                h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


_PLAIN = (bool, int, float, str, type(None))


def _attributes(module: nn.Module) -> dict[str, Any]:
    """The module's own plain attributes (numbers, strings, small tensors held outside
    its parameters and buffers) and buffers, as values to compare (the running
    statistics of a batch norm in training mode aside: they do not shape its output,
    which the batch's statistics normalise)."""
    found: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training":
            continue
        if isinstance(value, _PLAIN):
            found[name] = value
        elif isinstance(value, torch.Tensor) and value.numel() <= 16:
            found[name] = value.detach().clone()
    if not (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training):
        for name, buffer in module.named_buffers(recurse=False):
            found[f"{name} (buffer)"] = buffer.detach().clone()
    return found


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changed = []
    for name, old in before.items():
        new = after.get(name)
        same = (torch.equal(old, new) if isinstance(old, torch.Tensor)
                and isinstance(new, torch.Tensor) else old == new)
        if not same:
            changed.append(f"{name}: {_show(old)} -> {_show(new)}")
    return changed


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.tolist()) if value.numel() <= 16 else f"a tensor of {list(value.shape)}"
    return repr(value)


def _join(prefix: str, name: str) -> str:
    return ".".join(part for part in (prefix, name) if part)
