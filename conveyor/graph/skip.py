"""Skip connections in an ``nn.Sequential``: a layer stashes a value, a later one pops it.

A layer list passes one value from layer to layer; a U-Net's long skip or a residual
around several layers needs a second channel. Declare it on the layer classes and use
it in their ``forward``::

    @conveyor.skip.skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            x = self.conv(x)
            conveyor.skip.stash("skip", x)
            return self.pool(x)

    @conveyor.skip.skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, x):
            return self.conv(self.upsample(x) + conveyor.skip.pop("skip"))

    model = nn.Sequential(Down(), Middle(), Up())
    model(x)                                   # a plain model: the skip just works
    pipe = conveyor.GPipe(model, balance=[1, 2], sample=x[:4], chunks=4)

Where the pop runs on a later stage than its stash, ``GPipe`` and ``Pipeline`` trace the
layers with torch.export on ``sample`` and cut the graph where the balance puts the
stages (as ``split_at=`` does): the stashed value is an edge of the graph like any
other, sent to the stage that pops it, and its gradient comes back to the stash site
(an integer value travels without one). Where every pop is on its stash's stage, the
layers run as they are and no sample is needed.

Why plain calls and not torchgpipe's generators (``yield stash(...)``, ``x = yield
pop(...)``): torchgpipe's wrapper must intercept each command to hide the value in a
portal that carries it, and its gradient, to the popping partition, during every
forward and recomputation. Here the trace carries it, and recomputation replays the
graph, not the Python; nothing has to intercept the call. So ``forward`` stays an
ordinary function returning its output: it type-checks, reads as the model it is, and
a pop can sit inside an expression. The decorator keeps the class (its name, repr and
parameter names: no wrapper module in between, so state dicts are unchanged).

Names are checked before a pipeline is built (:mod:`conveyor.graph.skipcut`): in the
order the layers run (submodules in the order they are registered), every pop takes a value an
earlier layer stashed and that is not popped yet, every stash is popped, and a name is
not stashed again while its value waits. Blocks repeated in sequence (stash, pop,
stash, pop) may reuse a name; nested ones (a U-Net's levels) give each pair a namespace
with :func:`isolate`. A namespace is a string: printable in errors, and the same in
every process that builds the model.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import nn

from conveyor.errors import SkipError
from conveyor.torchprivate import pytree

__all__: list[str] = []

M = TypeVar("M", bound=nn.Module)
Key = tuple[str | None, str]  # (namespace, name)

_DECLARED = "_conveyor_skips"  # on a skippable class: its Declared
_NAMESPACES = "_conveyor_skip_namespaces"  # on an isolated layer: name -> namespace


@dataclass(frozen=True)
class Declared:
    stash: frozenset[str]
    pop: frozenset[str]


@dataclass
class _Call:
    """One running forward of a skippable layer, and what it has stashed and popped."""

    layer: nn.Module
    stashed: set[str] = field(default_factory=set)
    popped: set[str] = field(default_factory=set)


class _Store(threading.local):
    """The values stashed and not yet popped, and the skippable forwards running, per
    thread. nn.Sequential gives a stash no other way to its pop; between two calls of a
    model whose skips match, the store is empty again."""

    def __init__(self) -> None:
        self.values: dict[Key, Any] = {}
        self.calls: list[_Call] = []
        self.profiling = False  # see profiling()


_store = _Store()


def skippable(*, stash: Iterable[str] = (), pop: Iterable[str] = ()
              ) -> Callable[[type[M]], type[M]]:
    """Declares the skip values a layer class stashes and pops (class decorator).

    The class's ``forward`` calls :func:`conveyor.skip.stash` for each name in ``stash`` and
    :func:`conveyor.skip.pop` for each in ``pop``, once per call. The decorated class is a
    subclass under the same name whose ``forward`` tracks these calls.

    Args:
        stash: the names this layer's forward stashes.
        pop: the names it pops, stashed by earlier layers.

    Raises:
        SkipError: a name is not a string, or is both stashed and popped.
        TypeError: the decorated object is not an ``nn.Module`` class.
    """
    declared = Declared(_names(stash, "stash"), _names(pop, "pop"))
    both = declared.stash & declared.pop
    if both:
        raise SkipError(f"@skippable declares {sorted(both)} both in stash= and pop=; a "
                        "layer pops what an earlier layer stashed: use two names")

    def decorate(cls: type[M]) -> type[M]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@conveyor.skip.skippable decorates an nn.Module class, got {cls!r}")
        original = cls.forward

        @functools.wraps(original)
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with _running(self):
                return original(self, *args, **kwargs)

        attributes = {"forward": forward, _DECLARED: declared, "__doc__": cls.__doc__,
                      "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        return cast("type[M]", type(cls.__name__, (cls,), attributes))

    return decorate


def stash(name: str, value: Any) -> None:
    """Stashes ``value`` under ``name`` for a later layer to :func:`pop`; called in the
    forward of a layer whose class declares ``name`` in ``@skippable(stash=...)``.

    Raises:
        SkipError: outside such a forward, ``name`` not declared, or stashed twice in
            one call.
    """
    call = _current("stash", name)
    _check_declared(call.layer, name, "stash")
    if name in call.stashed:
        raise SkipError(f"{_kind(call.layer)} stashes {name!r} twice in one call; stash it "
                        "once (a tuple of values if need be)")
    call.stashed.add(name)
    _store.values[skip_key(call.layer, name)] = value


def pop(name: str) -> Any:
    """The value an earlier layer stashed under ``name``; called in the forward of a
    layer whose class declares ``name`` in ``@skippable(pop=...)``.

    Raises:
        SkipError: outside such a forward, ``name`` not declared, popped twice in one
            call, or nothing stashed under ``name`` (in the layer's namespace).
    """
    call = _current("pop", name)
    _check_declared(call.layer, name, "pop")
    if name in call.popped:
        raise SkipError(f"{_kind(call.layer)} pops {name!r} twice in one call; pop it "
                        "once and keep the value")
    key = skip_key(call.layer, name)
    if key not in _store.values:
        raise SkipError(f"{_kind(call.layer)} pops {describe(key)}, but nothing stashed it: "
                        "an earlier layer of the nn.Sequential must stash it in the same "
                        "namespace (conveyor.skip.verify_skips(model) checks the whole model)")
    call.popped.add(name)
    if _store.profiling:
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, _store.values[key])
    return _store.values.pop(key)


def isolate(module: M, namespace: str, *, only: Iterable[str] | None = None) -> M:
    """Puts the skip names of ``module`` (and of its skippable submodules) in
    ``namespace``, so that a block repeated inside another (a U-Net's levels) pairs its
    own stash and pop::

        nn.Sequential(isolate(Down(), "outer"), isolate(Down(), "inner"), Middle(),
                      isolate(Up(), "inner"), isolate(Up(), "outer"))

    Args:
        module: a skippable layer, or a module holding some.
        namespace: a name for the pair; stash and pop must share it.
        only: the skip names to isolate (default: every name the layers declare).

    Returns:
        ``module`` itself.

    Raises:
        SkipError: ``module`` holds no skippable layer, or ``only`` names a skip none
            of them declares.
    """
    if not isinstance(namespace, str):
        raise SkipError(f"a namespace is a string, got {namespace!r}")
    layers = [m for m in module.modules() if declared_of(m) is not None]
    if not layers:
        raise SkipError(f"{_kind(module)} has no @conveyor.skip.skippable layer to isolate")
    every = set().union(*(_declared_names(m) for m in layers))
    names = every if only is None else _names(only, "only")
    if names - every:
        raise SkipError(f"isolate(only={sorted(names)}): {_kind(module)} declares "
                        f"{sorted(every)}, not {sorted(names - every)}")
    for layer in layers:
        spaces = dict(getattr(layer, _NAMESPACES, {}))
        spaces.update({name: namespace for name in names & _declared_names(layer)})
        setattr(layer, _NAMESPACES, spaces)
    return module


@contextlib.contextmanager
def profiling() -> Iterator[None]:
    """Layers run one at a time, several times each (``profile_layers``): a pop reads,
    detached, the value its stash left last rather than taking it; nothing stays after.
    """
    saved = _store.values, _store.profiling
    _store.values, _store.profiling = {}, True
    try:
        yield
    finally:
        _store.values, _store.profiling = saved


@contextlib.contextmanager
def _running(layer: nn.Module) -> Iterator[None]:
    """The forward of a skippable ``layer`` runs: stash and pop refer to it, and after
    it every declared name must have been stashed and popped."""
    calls = _store.calls
    if calls and calls[-1].layer is layer:  # a subclass's forward calling super().forward
        yield
        return
    call = _Call(layer)
    calls.append(call)
    try:
        yield
    except BaseException:
        for name in call.stashed:  # a failed call leaves nothing of its own behind
            _store.values.pop(skip_key(layer, name), None)
        raise
    finally:
        calls.pop()
    declared = declared_of(layer)
    assert declared is not None
    for names, done, verb in ((declared.stash, call.stashed, "stash"),
                              (declared.pop, call.popped, "pop")):
        if names - done:
            raise SkipError(
                f"{_kind(layer)} declares {verb}={sorted(names)} but its forward did not "
                f"{verb} {sorted(names - done)}; call conveyor.{verb}(name...) in every "
                f"call, or take the name out of {verb}=")


def _current(verb: str, name: str) -> _Call:
    if not _store.calls:
        raise SkipError(f"conveyor.skip.{verb}({name!r}) runs outside the forward of a "
                        "@conveyor.skip.skippable layer; decorate the layer's class with "
                        f"@conveyor.skip.skippable({verb}=[{name!r}])")
    return _store.calls[-1]


def _check_declared(layer: nn.Module, name: str, verb: str) -> None:
    declared = declared_of(layer)
    names: frozenset[str] = frozenset() if declared is None else getattr(declared, verb)
    if name not in names:
        does = "stashes" if verb == "stash" else "pops"
        raise SkipError(f"{_kind(layer)} {does} {name!r}, which its class does not declare "
                        f"({verb}={sorted(names)}); add it: @conveyor.skip.skippable({verb}=[...])")


def declared_of(module: nn.Module) -> Declared | None:
    return getattr(type(module), _DECLARED, None)


def _declared_names(module: nn.Module) -> set[str]:
    declared = declared_of(module)
    return set() if declared is None else set(declared.stash | declared.pop)


def skip_key(layer: nn.Module, name: str) -> Key:
    return getattr(layer, _NAMESPACES, {}).get(name), name


def describe(key: Key) -> str:
    namespace, name = key
    return repr(name) if namespace is None else f"{name!r} (namespace {namespace!r})"


def _kind(module: nn.Module) -> str:
    return type(module).__name__


def _names(names: Iterable[str], what: str) -> frozenset[str]:
    if isinstance(names, str):
        raise SkipError(f"{what}= takes a list of names, got the string {names!r}; write "
                        f"{what}=[{names!r}]")
    result = frozenset(names)
    wrong = [n for n in result if not isinstance(n, str)]
    if wrong:
        raise SkipError(f"{what}= takes names (strings), got {wrong!r}")
    return result
