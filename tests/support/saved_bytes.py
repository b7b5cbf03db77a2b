"""What each rank of a pipeline on CPU threads holds for the backward, measured: the
activation memory that ``conveyor.observe.plan`` predicts per rank.

A dispatch mode, entered around each stage's forward in the thread that runs it (the
first run, and a recomputation in the backward), counts every storage the forward
creates, from its creation until it is freed: what autograd saves, the output kept for
the stage's backward, the transient values of a recomputed forward, what a
recomputation rebuilds. The input a stage keeps counts too; each storage counts once,
on the rank that made or received it. Storages that exist before the step (parameters,
the batch) do not, nor does what the loss saves beside the output (a target).

Threads share one memory where the ranks of a real pipeline have a device each; within
:meth:`HeldBytes.on_devices` a rank copies a message from another rank on arrival, and
the first stage its micro-batches, as a transfer between devices does, so each rank
frees its own copy. Between two stages of one rank (a V's turn) nothing is copied, as
on one device. Unlike a pack hook for saved tensors, a dispatch mode does not displace
``torch.utils.checkpoint``'s own hooks: recomputed stages run as they would unmeasured.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import conveyor
from conveyor.engine import actions
from conveyor.engine.transport import deliver, neighbour
from conveyor.torchprivate import pytree

__all__ = ["HeldBytes", "RankBytes"]


def _copied(tree: Any) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), tree)


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor)]


class _Creating(TorchDispatchMode):
    """Hands each storage that an operation creates (not a view or in-place result of
    one of its arguments) to ``note``."""

    def __init__(self, note: Any) -> None:
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        existing = {s.data_ptr() for s in _storages((args, kwargs))}
        for storage in _storages(out):
            if storage.data_ptr() not in existing:
                self.note(storage)
        return out


class RankBytes:
    """Per pipeline rank, the live and peak bytes of the storages :meth:`note` is given,
    each counted once, from then until it is freed; storages that exist before the
    step (the parameters, the batch) are not. :meth:`watch` enters a context of the
    subclass's around each stage's forward, in the thread that runs it.

    Args:
        pipe: the pipeline, built (``pipe.runtime``), on CPU threads.
        batch: the tensors of the step's batch (inputs and targets), not counted.
    """

    def __init__(self, pipe: conveyor.Pipeline, *batch: torch.Tensor) -> None:
        self.ranks = pipe.schedule.stage_ranks
        self.before = {s.data_ptr() for s in _storages([*pipe.parameters(), *batch])}
        self.current = [0] * pipe.schedule.num_ranks
        self.peak = [0] * pipe.schedule.num_ranks
        self._live: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._open = threading.local()
        self._hooks: list[Any] = []
        for number, stage in pipe.runtime.stages.items():
            rank = self.ranks[number]
            self._hooks.append(stage.layers.register_forward_pre_hook(
                lambda _, args, rank=rank: self._enter(self.watch(rank, args[0]))))
            self._hooks.append(stage.layers.register_forward_hook(
                lambda *_: self._leave(), always_call=True))

    def watch(self, rank: int, inputs: Any) -> Any:
        """The context a forward of ``rank``'s stage on ``inputs`` runs in."""
        raise NotImplementedError

    def note(self, rank: int, storage: torch.UntypedStorage) -> None:
        """Counts ``storage`` on ``rank`` until it is freed (once; not one from before)."""
        key = storage.data_ptr()
        with self._lock:
            if key in self._live or key in self.before or storage.nbytes() == 0:
                return
            self._live[key] = (rank, storage.nbytes())
            self.current[rank] += storage.nbytes()
            self.peak[rank] = max(self.peak[rank], self.current[rank])
        weakref.finalize(storage, self._free, key)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _enter(self, context: Any) -> None:
        context.__enter__()
        self._open.stack = [*getattr(self._open, "stack", []), context]

    def _leave(self) -> None:
        self._open.stack.pop().__exit__(None, None, None)

    def _free(self, key: int) -> None:
        with self._lock:
            rank, size = self._live.pop(key)
            self.current[rank] -= size


class HeldBytes(RankBytes):
    """Per pipeline rank, the live and peak bytes of what its stages hold for the
    backward during ``pipe.step`` (see the module's docstring)."""

    @contextlib.contextmanager
    def on_devices(self, pipe: conveyor.Pipeline) -> Iterator[None]:
        """Within it, the pipeline's ranks copy what they receive as ranks on devices of
        their own do: a message from another rank (between two stages of one rank it
        stays shared, as on one device), and the step's micro-batches and targets,
        which come from the host. Threads would share them all."""
        transport = pipe.runtime.transport
        receive = transport.recv

        def received(kind: Any, stage: int, microbatch: int, *,
                     source: int | None = None) -> Any:
            value = receive(kind, stage, microbatch, source=source)
            sender = source if source is not None else neighbour(kind, stage)
            return value if self.ranks[sender] == self.ranks[stage] else _copied(value)

        def delivered(tree: Any, device: torch.device, *args: Any) -> Any:
            return _copied(deliver(tree, device, *args))

        transport.recv = received  # type: ignore[method-assign]
        try:
            with mock.patch.object(actions, "deliver", delivered):
                yield
        finally:
            del transport.recv

    def watch(self, rank: int, inputs: Any) -> Any:
        if not conveyor.is_recomputing():  # the inputs the stage keeps for its backward
            for storage in _storages(inputs):
                self.note(rank, storage)
        return _Creating(lambda storage: self.note(rank, storage))
