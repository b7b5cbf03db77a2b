"""Activation offload: the tensors a micro-batch's forward saves for its backward wait in
host memory while other micro-batches run, and come back one action ahead of it.

``offload="activations"`` gives each chosen stage an :class:`Offloader`. A forward whose
backward is not due soon runs inside a pack hook (``saved_tensors_hooks``) that copies
each tensor autograd saves to the host as it is saved, so that the device keeps none of
them; the executor asks for them back one action before the micro-batch's ``B`` or ``I``
(:func:`offload_plan`), and the hook's unpack hands autograd the copy on the device::

    F(m)  save -> host ........ (other actions) ........ X  reload m   B(m)  unpack
          (copied as saved, device copy freed)               (one action ahead)

On CUDA the copies run on a side stream into pinned host memory, overlapped with the
compute stream (events order the two); on the CPU the same path copies within host
memory, exact, so that tests see what a GPU run does. Parameters and their views, the
stage's inputs and buffers are never copied: they stay in memory anyway; nor is what
lies on another device (a vocabulary-parallel head's shards).

Each offloading stage counts the bytes its saved tensors hold on the device and on the
host, live and peak (:class:`OffloadMeter`, one per pipeline rank), what
``benchmarks/memory.py`` reports.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.schedules import Action, Kind
from conveyor.torchprivate import pytree

__all__: list[str] = []

#: A micro-batch whose backward comes within this many of its rank's actions after its
#: forward keeps its activations on the device: they would come back as soon as they left.
KEPT_WITHIN = 2


#: What ``offload=`` takes, per stage or for all.
OFFLOAD_MODES = ("activations", None)


def check_offload(offload: str | Sequence[str | None] | None) -> None:
    """Raises ValueError unless ``offload`` is a mode or a list of them."""
    given = [offload] if offload is None or isinstance(offload, str) else list(offload)
    for mode in given:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offload={offload!r}: each entry is \"activations\" (saved "
                             "activations wait on the host) or None (they stay)")


def offloaded_stages(offload: str | Sequence[str | None] | None,
                     stages: int) -> frozenset[int]:
    """The stages ``offload=`` moves activations off (checked by :func:`check_offload`).

    Raises:
        ValueError: a list whose length is not the number of stages.
    """
    if offload is None or isinstance(offload, str):
        return frozenset(range(stages)) if offload else frozenset()
    if len(offload) != stages:
        raise ValueError(f"offload={list(offload)} gives {len(offload)} entries for "
                         f"{stages} stages; give one mode, or one per stage")
    return frozenset(s for s, mode in enumerate(offload) if mode)


@dataclass
class OffloadMeter:
    """Bytes that one pipeline rank's saved activations hold, live and peak: on the
    device (kept there, or brought back for a backward) and on the host (offloaded)."""

    device: int = 0
    host: int = 0
    device_peak: int = 0
    host_peak: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, device: int = 0, host: int = 0) -> None:
        with self._lock:
            self.device += device
            self.host += host
            self.device_peak = max(self.device_peak, self.device)
            self.host_peak = max(self.host_peak, self.host)


class Offloader:
    """The offload of one stage on ``device``, counting into ``meter``."""

    def __init__(self, device: torch.device, meter: OffloadMeter) -> None:
        self.device = device
        self.meter = meter
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def activations(self, module: nn.Module, inputs: Any, *, offload: bool) -> Activations:
        """A store for one micro-batch's saved tensors, moving them to the host if
        ``offload`` (else keeping them on the device, counted)."""
        kept = {t.untyped_storage().data_ptr()
                for t in (*module.parameters(), *module.buffers(), *pytree.tree_leaves(inputs))
                if isinstance(t, torch.Tensor)}
        return Activations(self, kept, offload=offload)


class Activations:
    """The tensors one micro-batch's forward saved for backward on one stage.

    The autograd graph holds a handle to this store for each tensor it saved, so the
    store lives exactly as long as the graph: its bytes leave the meter with it.
    """

    def __init__(self, offloader: Offloader, kept: set[int], *, offload: bool) -> None:
        self.offloader = offloader
        self.offload = offload
        self._kept = kept
        # While the forward runs, each tensor saved, by where it lies, with its index:
        # held so that its memory is not reused by another tensor taken for it.
        self._saved: dict[tuple[Any, ...], tuple[torch.Tensor, int]] = {}
        self._tensors: list[torch.Tensor] = []  # on the host while offloaded
        self._left: set[int] = set()  # what :meth:`keep` left where it is
        self._on_host = offload
        self._arrived: Any = None  # a CUDA event: the reload is done
        self._counted = [0, 0]  # device, host bytes
        weakref.finalize(self, _uncount, offloader.meter, self._counted)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Autograd saves into this store inside the block."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._saved.clear()

    def keep(self, values: Any) -> None:
        """``values`` (a stage's outputs, a loss's targets) stay in memory anyway: what
        shares their memory is not offloaded, also what was saved before this call."""
        storages = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(values)
                    if isinstance(t, torch.Tensor)}
        self._kept |= storages
        for original, index in self._saved.values():
            if original.untyped_storage().data_ptr() in storages:
                size = original.numel() * original.element_size()
                self._tensors[index] = original.detach()
                self._left.add(index)
                self._count(**{"host" if self.offload else "device": -size})

    def _pack(self, tensor: torch.Tensor) -> Any:
        if _stays(tensor, self._kept) or tensor.device != self.offloader.device:
            return tensor
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor._version)
        if key in self._saved:  # one tensor saved twice (an output and the next input)
            return _Handle(self._saved[key][1])
        self._saved[key] = (tensor, len(self._tensors))
        size = tensor.numel() * tensor.element_size()
        if self.offload:
            tensor = self._to_host(tensor)
            self._count(host=size)
        else:  # detached: the graph holds this store, which must not hold the graph
            tensor = tensor.detach()
            self._count(device=size)
        self._tensors.append(tensor)
        return _Handle(len(self._tensors) - 1)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        if self._on_host:
            self.reload()
        self._unpacked()
        return self._tensors[packed.index]

    def _unpacked(self) -> None:
        """The compute stream waits for a reload under way (CUDA), once."""
        if self._arrived is None:
            return
        stream = torch.cuda.current_stream(self.offloader.device)
        stream.wait_event(self._arrived)
        for tensor in self._tensors:
            tensor.record_stream(stream)
        self._arrived = None

    def reload(self) -> None:
        """Starts bringing the offloaded tensors back to the device (on CUDA, on the
        side stream: a later unpack waits for it)."""
        if not self._on_host:
            return
        self._on_host = False
        stream = self.offloader.stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            size = self._move(lambda t: t.to(self.offloader.device, non_blocking=True,
                                             copy=True))
            if stream is not None:
                self._arrived = stream.record_event()
        self._count(device=size, host=-size)

    def park(self) -> None:
        """Moves the tensors back to the host (after an ``I``, until its ``W``)."""
        if self._on_host:
            return
        self._unpacked()
        size = self._move(self._to_host)
        self._on_host = True
        self._count(device=-size, host=size)

    def _move(self, move: Any) -> int:
        """Applies ``move`` to every tensor that moves (not those :meth:`keep` left);
        returns their bytes."""
        size = 0
        for index, tensor in enumerate(self._tensors):
            if index not in self._left:
                self._tensors[index] = move(tensor)
                size += tensor.numel() * tensor.element_size()
        return size

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        stream = self.offloader.stream
        strides = torch.empty_like(tensor, device="meta").stride()  # dense, as autograd's
        host = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype,
                                   pin_memory=stream is not None)
        if stream is None:
            return host.copy_(tensor)
        stream.wait_stream(torch.cuda.current_stream(self.offloader.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # not reused before the copy is done
        return host

    def _count(self, *, device: int = 0, host: int = 0) -> None:
        self._counted[0] += device
        self._counted[1] += host
        self.offloader.meter.add(device=device, host=host)


@dataclass(frozen=True)
class _Handle:
    """What autograd holds for a tensor in an :class:`Activations` store."""

    index: int


def _stays(tensor: torch.Tensor, kept: set[int]) -> bool:
    """Whether a saved tensor stays where it is: a parameter, an input of the stage or
    a buffer, or a view of one (in memory anyway), or empty."""
    base = tensor._base if tensor._base is not None else tensor
    return (base.is_leaf and base.requires_grad) or tensor.numel() == 0 or \
        tensor.untyped_storage().data_ptr() in kept


def _uncount(meter: OffloadMeter, counted: list[int]) -> None:
    meter.add(device=-counted[0], host=-counted[1])


@dataclass(frozen=True)
class OffloadPlan:
    """Which micro-batches of a step offload, and when each moves.

    Attributes:
        offloaded: (stage, micro-batch) pairs whose forward saves to the host.
        reloads: per lane (by its lead rank), at the position of an action in the lane,
            the pair to bring back before running it: one action ahead of the pair's
            ``B`` or ``I``, or of its ``W``.
        parks: per lane, at the position of an ``I``, the pair that goes back to the
            host after it, to wait there for its ``W``.
    """

    offloaded: frozenset[tuple[int, int]] = frozenset()
    reloads: Mapping[int, Mapping[int, tuple[int, int]]] = field(default_factory=dict)
    parks: Mapping[int, Mapping[int, tuple[int, int]]] = field(default_factory=dict)


def offload_plan(lanes: Mapping[int, Sequence[tuple[int, Action]]],
                 offloading: set[int], recomputed: Any) -> OffloadPlan:
    """The offload of one run of ``lanes`` (each lane's actions in order) for the stages
    in ``offloading``: every micro-batch whose forward records a graph (``recomputed(s,
    m)`` false) and whose ``B`` or ``I`` is more than :data:`KEPT_WITHIN` actions later
    waits on the host in between, and so between an ``I`` and a ``W`` that far apart."""
    offloaded: set[tuple[int, int]] = set()
    reloads: dict[int, dict[int, tuple[int, int]]] = {}
    parks: dict[int, dict[int, tuple[int, int]]] = {}
    for lead, lane in lanes.items():
        last: dict[tuple[int, int], int] = {}  # the pair's latest action with its graph
        for position, (_, action) in enumerate(lane):
            key = (action.stage, action.microbatch)
            if action.stage not in offloading:
                continue
            if action.kind is Kind.FORWARD:
                if not recomputed(*key):  # a recomputed graph is rebuilt in backward
                    last[key] = position
                continue
            if key not in last:
                continue
            if position - last[key] > KEPT_WITHIN:
                if action.kind is Kind.WEIGHT:
                    parks.setdefault(lead, {})[last[key]] = key
                else:
                    offloaded.add(key)
                reloads.setdefault(lead, {})[position - 1] = key
            last[key] = position
    return OffloadPlan(frozenset(offloaded), reloads, parks)

