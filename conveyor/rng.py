"""Random numbers in the pipeline that depend only on the layer and the micro-batch.

Every call of layer i on micro-batch m draws from its own stream, seeded by
``derive_seed(step_seed, i, m)``; ``step_seed`` is drawn from torch's global generator
once per pipelined call. So ``torch.manual_seed(s)`` makes a run reproducible, and the
dropout masks are the same whatever the number of stages, the checkpoint mode or the
timing of threads, and the same again when a micro-batch is recomputed in backward.

Two ways to give a layer call its stream, which draw identical numbers:

* A device used by one worker only (each GPU of a pipeline, or a single CPU stage):
  reseed that device's default generator before the layer runs. Costs ~1 us a call.
* The CPU shared by several worker threads: reseeding the one CPU generator would
  race, so random ops are routed to a private generator by a dispatch mode. The mode
  adds Python to every op, so it runs only on layers that drew random numbers the
  first time they ran (found by running that first call under the mode).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LayerRandomness", "derive_seed", "draw_step_seed"]

_MASK64 = (1 << 64) - 1
# Held while a random op without a generator argument borrows a default generator.
_BORROW_LOCK = threading.Lock()


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


class LayerRandomness:
    """Seeds the layer calls of the stages that one worker runs on one device.

    Args:
        device: the device the layers run on.
        shared: whether other workers use the same device's generator at the same time.
    """

    def __init__(self, device: torch.device, *, shared: bool) -> None:
        self.device = device
        self.shared = shared and device.type in ("cpu", "cuda")
        self._draws: dict[int, bool] = {}  # layer -> drew random numbers on first call

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

    @contextlib.contextmanager
    def layer_call(self, step_seed: int, layer: int, microbatch: int) -> Iterator[None]:
        """Runs the body with the random stream of ``layer`` on ``microbatch``."""
        seed = derive_seed(step_seed, layer, microbatch)
        if not self.shared:
            if self.device.type in ("cpu", "cuda"):
                _default_generator(self.device).manual_seed(seed)
            yield
            return
        if self._draws.get(layer) is False:
            yield
            return
        mode = _SeededOps(seed)
        with mode:
            yield
        self._draws.setdefault(layer, mode.drew)


@functools.lru_cache(maxsize=None)
def _takes_generator(op: torch._ops.OpOverload) -> bool:
    return any(argument.name == "generator" for argument in op._schema.arguments)


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
        self.drew = False
        self._generators: dict[torch.device, torch.Generator] = {}

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
        self.drew = True
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
