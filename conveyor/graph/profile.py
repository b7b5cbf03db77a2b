"""Measuring a model on a sample: the one profiler behind ``balance="time"`` and friends.

Two views of the same kind of run, both in training mode (as the pipeline will train the
model: dropout on, batch norm on the batch) and both leaving the model as it was (each
module's mode, buffers, random generators and every ``.grad`` restored; gradients are
taken with ``torch.autograd.grad``, never accumulated), both keeping the fastest of
several runs after a warm-up (a busy machine slows some runs; the fastest is the code's
own time):

* :func:`profile_layers`: each layer of an ``nn.Sequential`` alone, layer after layer on
  the previous layer's output: its forward and backward time, the bytes autograd saves
  for its backward and its output's bytes (``balance_by_time``, ``balance_by_memory``);
* :func:`block_times`: the blocks of any model (the children of its largest
  ``nn.ModuleList``), timed inside the model's own forward and backward by hooks at their
  boundaries (:mod:`conveyor.graph.autosplit`)::

    forward    start | b0 ... | b1 ... | b2 ... | end        marks: b1 and b2 begin
    backward   end | ... b0 | ... b1 | ... b2 | start        marks: grads of b1's, b2's inputs

  Between two marks runs one block and whatever the model does before the next: the
  cut puts those operations on the same stage. What runs before the first block counts
  on the first, what runs after the last on the last.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from conveyor.errors import BalanceError, ModelError
from conveyor.graph import skip
from conveyor.graph.source import sequential_layers
from conveyor.graph.tracedstage import as_call
from conveyor.torchprivate import pytree

__all__: list[str] = []

# A layer is timed at least ``repeat`` times and for at least this long (up to
# _LAYER_RUNS): a fast layer's time is otherwise mostly noise.
_LAYER_SECONDS = 0.02
_LAYER_RUNS = 200
# Blocks run on past ``repeat`` until this many seconds are measured (at most _BLOCK_RUNS).
_BLOCK_SECONDS = 0.1
_BLOCK_RUNS = 50


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs, measured on a sample batch.

    Attributes:
        name: the layer's name in the ``nn.Sequential``.
        parameters: the number of parameter elements.
        parameter_bytes: bytes of parameters (gradients and optimizer state come on top).
        forward_seconds: forward time (the fastest of the timed runs).
        backward_seconds: backward time (input and weight gradients; the fastest run).
        saved_bytes: bytes of tensors autograd saves for backward, parameters excluded,
            each storage counted once.
        output_bytes: bytes of the layer's output tensors.
    """

    name: str
    parameters: int
    parameter_bytes: int
    forward_seconds: float
    backward_seconds: float
    saved_bytes: int
    output_bytes: int


def profile_layers(module: nn.Sequential, sample: Any, *, repeat: int = 3) -> list[LayerProfile]:
    """Measures each layer's time and memory on ``sample``, layer after layer.

    Runs on the device of the model's first parameter (CPU if it has none), in training
    mode. The model is left as it was: each module's mode, random number generators,
    buffers (batch-norm statistics) and ``.grad`` are restored afterwards.

    Args:
        module: the model as an ``nn.Sequential``.
        sample: an input batch for the first layer (tensor or nested structure).
        repeat: timed runs per layer after one warm-up (at least; a fast layer runs until
            20 ms are measured); 0 measures memory only. Times are the fastest run's.
    """
    layers = sequential_layers(module)
    device = next(module.parameters(), torch.empty(0)).device
    x = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), sample)
    profiles = []
    with preserved_state(module, device), skip.profiling():
        for name, layer in layers:
            profile, x = _profile_layer(name, layer, x, device, repeat)
            profiles.append(profile)
    return profiles


def _profile_layer(
    name: str, layer: nn.Module, x: Any, device: torch.device, repeat: int
) -> tuple[LayerProfile, Any]:
    params = [p for p in layer.parameters() if p.requires_grad]
    param_ids = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ids and t.device.type != "meta":
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def run(measure_memory: bool) -> tuple[float, float, Any]:
        leaves = pytree.tree_map_only(
            torch.Tensor,
            lambda t: t.detach().requires_grad_(t.is_floating_point() or t.is_complex()),
            x,
        )
        # The layer gets a copy, not the leaf itself: a layer that starts with an in-place
        # op (ReLU(inplace=True)) may modify it, as it may inside a stage.
        inputs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.clone() if t.requires_grad else t, leaves)
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                 if measure_memory else contextlib.nullcontext())
        _sync(device)
        start = time.perf_counter()
        with torch.enable_grad(), hooks:
            out = layer(inputs)
        _sync(device)
        forward = time.perf_counter() - start
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = [t for t in pytree.tree_leaves(leaves)
               if isinstance(t, torch.Tensor) and t.requires_grad] + params
        start = time.perf_counter()
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs],
                                allow_unused=True)
        _sync(device)
        return forward, time.perf_counter() - start, out

    _, _, out = run(measure_memory=True)
    times: list[tuple[float, float]] = []
    while repeat and (len(times) < repeat or (sum(f + b for f, b in times) < _LAYER_SECONDS
                                               and len(times) < _LAYER_RUNS)):
        times.append(run(measure_memory=False)[:2])
    out = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
    profile = LayerProfile(
        name=name,
        parameters=sum(p.numel() for p in layer.parameters()),
        parameter_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
        forward_seconds=min(t[0] for t in times) if times else 0.0,
        backward_seconds=min(t[1] for t in times) if times else 0.0,
        saved_bytes=sum(saved.values()),
        output_bytes=sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor)),
    )
    return profile, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def preserved_state(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Within: the model in training mode, as it will train. After: each module's mode,
    buffers, random generators and parameters' ``.grad`` as they were (the runs take
    gradients with ``autograd.grad``; a ``.grad`` is put back as the same tensor)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    devices = [device] if device.type == "cuda" else []
    try:
        module.train(True)
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for submodule, training in modes:
            submodule.training = training
        for param, grad in grads:
            param.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


class _Marks:
    """The times of one run's block boundaries."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entered: dict[int, float] = {}  # block -> its forward began
        self.gradient: dict[int, float] = {}  # block -> its input's gradient arrived

    def now(self) -> float:
        _sync(self.device)
        return time.perf_counter()

    def enter(self, block: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if block in self.entered:  # a block called twice: its first call marks it
            return
        self.entered[block] = self.now()
        first = next((t for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(partial(self.arrived, block))

    def arrived(self, block: int, grad: torch.Tensor) -> None:
        self.gradient.setdefault(block, self.now())


def block_times(model: nn.Module, names: Sequence[str], sample: Any, *,
                repeat: int = 5) -> tuple[list[str], list[float]]:
    """The blocks named ``names`` that the forward runs, and the seconds each takes
    (forward and backward, with what runs before the first and after the last block
    counted on them), in training mode (the model's modes restored after): per block,
    the fastest of at least ``repeat`` runs after one warm-up, and of more, up to a tenth of a second, when runs are fast (a busy machine
    slows some runs of a block; the fastest is the block's own time).

    Raises:
        BalanceError: the model is on the meta device (nothing to time).
        ModelError: the blocks do not run in their order.
    """
    device = next(model.parameters(), torch.empty(0)).device
    if device.type == "meta":
        raise BalanceError(f"balance='time' runs {type(model).__name__} on the sample, but "
                           "it is on the meta device; build it on a device, or balance by "
                           "parameters (balance=None)")
    modules = [model.get_submodule(name) for name in names]
    best: list[float] | None = None
    ran: list[int] = []
    runs, spent = 0, 0.0
    with preserved_state(model, device):
        _run(model, modules, sample, device)  # warm-up
        while runs < repeat or (spent < _BLOCK_SECONDS and runs < _BLOCK_RUNS):
            marks, forward, backward = _run(model, modules, sample, device)
            ran = sorted(marks.entered)
            _check_order(model, names, ran, marks.entered)
            costs = _costs(ran, marks, forward, backward)
            best = costs if best is None else [min(a, b) for a, b in zip(best, costs)]
            runs, spent = runs + 1, spent + backward[1] - forward[0]
    return [names[i] for i in ran], best or []


def _run(model: nn.Module, modules: list[nn.Module], sample: Any, device: torch.device
         ) -> tuple[_Marks, tuple[float, float], tuple[float, float]]:
    """One forward and backward with marks: the marks, forward's and backward's start
    and end."""
    params = [p for p in model.parameters() if p.requires_grad]
    args, kwargs = as_call(sample)
    marks = _Marks(device)
    handles = [m.register_forward_pre_hook(partial(marks.enter, i), with_kwargs=True)
               for i, m in enumerate(modules)]
    try:
        start = marks.now()
        with torch.enable_grad():
            out = model(*args, **kwargs)
        forward_end = marks.now()
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        backward_start = marks.now()
        if outs and params:
            torch.autograd.grad(outs, params, [torch.ones_like(t) for t in outs],
                                allow_unused=True)
        backward_end = marks.now()
    finally:
        for handle in handles:
            handle.remove()
    return marks, (start, forward_end), (backward_start, backward_end)


def _costs(ran: list[int], marks: _Marks, forward: tuple[float, float],
           backward: tuple[float, float]) -> list[float]:
    """Per block that ran, forward + backward seconds between its marks and the next's.
    A block whose input needs no gradient has no backward mark: what runs in backward
    before the next mark counts with it."""
    begins = [forward[0], *(marks.entered[b] for b in ran[1:]), forward[1]]
    ends: list[float] = [backward[1]]  # walking backward in time, from the first block
    for b in ran[1:]:
        ends.append(marks.gradient.get(b, ends[-1]))
    ends.append(backward[0])
    return [max(0.0, begins[i + 1] - begins[i]) + max(0.0, ends[i] - ends[i + 1])
            for i in range(len(ran))]


def _check_order(model: nn.Module, names: Sequence[str], ran: list[int],
                 entered: dict[int, float]) -> None:
    for a, b in itertools.pairwise(ran):
        if entered[b] < entered[a]:
            raise ModelError(
                f"{type(model).__name__}'s forward runs {names[b]!r} before {names[a]!r}: "
                "its blocks do not run in their order, so conveyor cannot choose the cut "
                "among them; give split_at=")
