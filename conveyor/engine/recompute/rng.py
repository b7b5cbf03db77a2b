"""Random numbers in the pipeline that depend only on the layer and the micro-batch.

Every call of layer i on micro-batch m draws from its own stream, seeded by
``derive_seed(step_seed, i, m)``; ``step_seed`` is drawn from torch's global generator
once per pipelined call. So ``torch.manual_seed(s)`` makes a run reproducible, and the
dropout masks are the same whatever the number of stages, the checkpoint mode or the
timing of threads, and the same again when a micro-batch is recomputed in backward.

Two ways to give a layer call its stream, which draw identical numbers:

* A device used by one thread only (a GPU, whose stages in one process share a
  thread, or a single CPU stage): reseed that device's default generator before the
  layer runs. Costs ~1 us a call, and ~5 us with the seed's derivation: so a layer
  that drew nothing at its first call in a mode (found as below) is not reseeded.
* The CPU shared by several worker threads: reseeding the one CPU generator would
  race, so random ops are routed to a private generator by a dispatch mode. The mode
  adds ~15 us of Python to every op it sees, so it wraps only the submodules that drew
  random numbers when the layer first ran (its first call runs whole under the mode,
  noting which submodules the random ops came from); on a config-P block with dropout
  that is the Dropout alone; an op that draws nothing (attention or dropout with a
  dropout probability of 0, dropout outside training) does not count. The assumption:
  a layer in one mode (training or not) draws from the same submodules every call.

Either way a layer's first call in a mode runs under that mode, seeded as the layer's
stream (the numbers are the same), to learn whether it draws.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.torchprivate import OpOverload, TorchDispatchMode

__all__: list[str] = []

_training = operator.attrgetter("training")  # a module's mode

_MASK64 = (1 << 64) - 1
# Held while a random op without a generator argument borrows a default generator.
_BORROW_LOCK = threading.Lock()
# Per thread: the mode of the layer call in progress, for the hooks on random parts.
_local = threading.local()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_seed(step_seed: int, layer: int, microbatch: int) -> int:
    """A 63-bit seed for ``layer`` on ``microbatch``, well mixed from ``step_seed``."""
    return _splitmix64(_splitmix64(_splitmix64(step_seed) ^ layer) ^ microbatch) >> 1


def draw_step_seed() -> int:
    """Draws the seed of one pipelined call from torch's global CPU generator."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"no default random generator known for device {device}")


def reseed(device: torch.device, seed: int) -> None:
    """Seeds ``device``'s default generator with ``seed``, as a stage seeds a layer call
    on a device of its own (the plain model run with the pipeline's streams)."""
    _default_generator(device).manual_seed(seed)


class LayerRandomness:
    """Seeds the layer calls of the stages that one worker runs on one device.

    Args:
        device: the device the layers run on.
        shared: whether other workers use the same device's generator at the same time.
    """

    def __init__(self, device: torch.device, *, shared: bool) -> None:
        self.device = device
        self.shared = shared and device.type in ("cpu", "cuda")
        self.seeds = device.type in ("cpu", "cuda")  # (no generator known elsewhere)
        # (layer index, training) -> the outermost submodules whose forward drew
        # random numbers in that mode
        self._random_parts: dict[tuple[int, bool], list[nn.Module]] = {}
        # (first layer index, each layer's training flag) of runs of layers all silent
        self._silent_runs: set[tuple[int | bool, ...]] = set()

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Restores the device's default generator after a phase that reseeds it."""
        if self.shared or self.device.type not in ("cpu", "cuda"):
            yield
            return
        generator = _default_generator(self.device)
        state = generator.get_state()
        try:
            yield
        finally:
            generator.set_state(state)

    def knows(self, index: int, layer: nn.Module) -> bool:
        """Whether layer ``index`` needs no probe before its next call: whether it
        draws in its mode is known (and its draws routed, where workers share the
        device)."""
        return (index, layer.training) in self._random_parts or not self.seeds

    @contextlib.contextmanager
    def probing(self, index: int, layer: nn.Module, seed: int = 0) -> Iterator[None]:
        """Runs the body, a call of ``layer`` (layer ``index``), under a seeded dispatch
        mode that notes which of its submodules draw random numbers, and routes their
        draws from then on. torch.compile leaves a call under a dispatch mode eager
        (torch 2.13 and older: that code for good), so a compiled layer is probed by an
        eager call aside (see :class:`~conveyor.engine.stage.Stage`)."""
        with _probe(layer, seed) as mode:
            yield
        self._random_parts[(index, layer.training)] = parts = _outermost(mode.sources)
        if self.shared:  # (a worker of its own reseeds the device's generator instead)
            for part in parts:
                _route_random_ops(part)

    def draws(self, index: int, layer: nn.Module) -> bool:
        """Whether a probe found layer ``index`` drawing random numbers in its mode."""
        return bool(self._random_parts.get((index, layer.training)))

    def silent(self, index: int, layer: nn.Module) -> bool:
        """Whether layer ``index`` needs no stream of its own: it drew nothing at its
        first call in its mode (or this device has no generator to seed)."""
        return not self.seeds or self._random_parts.get((index, layer.training)) == []

    def all_silent(self, first: int, layers: Iterable[nn.Module]) -> bool:
        """Whether each of ``layers`` (layers ``first``, ``first + 1``, ...) is
        :meth:`silent` in its mode: found once for each set of modes."""
        modes = (first, *map(_training, layers))
        if modes not in self._silent_runs:
            if not all(self.silent(first + offset, layer) for offset, layer in enumerate(layers)):
                return False  # (a layer not yet probed may be silent once it is)
            self._silent_runs.add(modes)
        return True

    def draws_nothing(self, index: int, layer: nn.Module) -> None:
        """Notes that layer ``index`` draws no random numbers in its current mode."""
        self._random_parts[(index, layer.training)] = []

    @contextlib.contextmanager
    def layer_call(self, step_seed: int, index: int, microbatch: int,
                   layer: nn.Module) -> Iterator[None]:
        """Runs the body (a call of ``layer``, layer ``index``) with its random stream."""
        if not self.seeds:
            yield
            return
        parts = self._random_parts.get((index, layer.training))
        if parts is None:
            with self.probing(index, layer, derive_seed(step_seed, index, microbatch)):
                yield
            return
        if not parts:  # draws nothing in this mode: its stream is never read
            yield
            return
        seed = derive_seed(step_seed, index, microbatch)
        if not self.shared:
            _default_generator(self.device).manual_seed(seed)
            yield
            return
        previous = getattr(_local, "mode", None)
        _local.mode = _SeededOps(seed)
        try:
            yield
        finally:
            _local.mode = previous


@contextlib.contextmanager
def _probe(layer: nn.Module, seed: int) -> Iterator[_SeededOps]:
    """Runs the body under a seeded mode that notes which submodule each random op ran in."""
    mode = _SeededOps(seed)
    stack: list[nn.Module] = [layer]

    def enter(module: nn.Module, *_: Any) -> None:
        stack.append(module)

    def leave(module: nn.Module, *_: Any) -> None:
        stack.pop()

    handles = []
    for module in layer.modules():
        if module is not layer:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
    mode.stack = stack
    try:
        with mode:
            yield mode
    finally:
        for handle in handles:
            handle.remove()


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``modules`` that are not inside another one of them."""
    unique = list({id(m): m for m in modules}.values())
    inner = {id(sub) for m in unique for sub in m.modules() if sub is not m}
    return [m for m in unique if id(m) not in inner]


_routed: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _route_random_ops(part: nn.Module) -> None:
    """Hooks that run ``part`` under the seeded mode of the layer call in progress."""
    if part in _routed:
        return
    _routed.add(part)
    entered: list[_SeededOps | None] = []  # a part runs on its stage's thread only

    def enter(module: nn.Module, *_: Any) -> None:
        mode: _SeededOps | None = getattr(_local, "mode", None)
        if mode is not None and not mode.active:
            mode.__enter__()
            entered.append(mode)
        else:
            entered.append(None)

    def leave(module: nn.Module, *_: Any) -> None:
        mode = entered.pop()
        if mode is not None:
            mode.__exit__(None, None, None)

    part.register_forward_pre_hook(enter)
    part.register_forward_hook(leave, always_call=True)


@functools.lru_cache(maxsize=None)
def _takes_generator(op: OpOverload) -> bool:
    return any(argument.name == "generator" for argument in op._schema.arguments)


#: Arguments of dropout and attention ops at which they draw no random numbers.
_DRAW_NOTHING = {"p": 0.0, "dropout_p": 0.0, "train": False}
_COMPOSITE_DROPOUTS = {"aten::dropout", "aten::feature_dropout", "aten::alpha_dropout",
                       "aten::feature_alpha_dropout"}


def _draws(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a random op draws: dropout (torch's composite ``dropout`` ops) and
    attention kernels with a dropout probability of 0, or dropout outside training,
    return without touching a generator."""
    name = op._schema.name
    if not ("attention" in name or name in _COMPOSITE_DROPOUTS):
        return True
    for i, argument in enumerate(op._schema.arguments):
        if argument.name in _DRAW_NOTHING:
            default = argument.default_value if argument.has_default_value() else None
            value = args[i] if i < len(args) else kwargs.get(argument.name, default)
            if value is not None and value == _DRAW_NOTHING[argument.name]:
                return False
    return True


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


class _SeededOps(TorchDispatchMode):
    """Routes every random op to private generators seeded with ``seed``, one per device."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.active = False
        self.stack: list[nn.Module] | None = None  # set while probing a layer
        self.sources: list[nn.Module] = []  # where random ops ran, while probing
        self._generators: dict[torch.device, torch.Generator] = {}

    def __enter__(self) -> _SeededOps:
        self.active = True
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        self.active = False
        super().__exit__(*args)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = generator
        return generator

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        device = _device_of(args, kwargs)
        if device.type not in ("cpu", "cuda"):
            return func(*args, **kwargs)
        if self.stack is not None and _draws(func, args, kwargs):
            self.sources.append(self.stack[-1])
        generator = self._generator(device)
        if _takes_generator(func):
            if kwargs.get("generator") is None:
                kwargs = {**kwargs, "generator": generator}
            return func(*args, **kwargs)
        # No generator argument (randn.default, CUDA's fused dropout): lend the private
        # stream to the default generator for the duration of the op.
        with _BORROW_LOCK:
            default = _default_generator(device)
            saved = default.get_state()
            default.set_state(generator.get_state())
            try:
                out = func(*args, **kwargs)
                generator.set_state(default.get_state())
            finally:
                default.set_state(saved)
        return out
