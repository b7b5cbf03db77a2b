"""``cuda_graphs=True``: a compiled stage's forward and backward replayed from CUDA graphs.

A step that is host-bound on a GPU (the kernels of a micro-batch shorter than the
host's work to launch them) spends most of its time launching. A CUDA graph launches a
whole recorded stream of kernels at once. torch's own (``torch.compile``'s
``mode="reduce-overhead"``) replay each graph into one memory, which a pipeline cannot
give them: several micro-batches are in flight at a stage at once, each holding its
outputs and the tensors its backward reads (on an H200 the second micro-batch's replay
overwrote the first's). Here each micro-batch in flight has a capture of its own
(``torch.cuda.make_graphed_callables`` of the stage's compiled graph: a forward and a
backward graph with their own static memory), taken from a pool per kind of input
(shapes, dtypes, whether it needs a gradient, autocast) and given back when the
micro-batch's backward has run; a stage holds as many as it has micro-batches in
flight at most (1F1B: about the number of stages after it, GPipe: all).

Three things keep it exact, as a replay hands on memory it will write again:

* the stage's outputs are the capture's static outputs, free again only after the
  micro-batch's backward, which comes after every later stage has used them (the
  schedules whose backward is never split: GPipe, 1F1B, interleaved);
* the input's gradient is copied out of the capture's static memory before it leaves
  the stage (:class:`_CopiedGradient`);
* each parameter that gets a gradient has a ``.grad`` before a replay's backward, so
  that autograd adds the static gradient into it rather than adopting the static
  tensor itself as ``.grad`` (a zero ``.grad`` where there was none).

A capture's first replay is checked against the compiled graph run on the same input
(outputs and every gradient, to float tolerance): a capture that differs fails the
step, naming the stage, rather than train on.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConveyorError

__all__: list[str] = []


class GraphedStage:
    """The CUDA graphs of one stage's compiled call (``call``, the stage's layers run
    as one compiled graph), captured per kind of input and micro-batch in flight."""

    def __init__(self, call: Callable[[Any], Any], layers: nn.Module, index: int) -> None:
        self._call = call
        self._layers = layers
        self._index = index
        self._free: dict[Any, list[Callable[..., Any]]] = defaultdict(list)
        self._all: dict[Any, list[Callable[..., Any]]] = defaultdict(list)
        self._gradients: dict[Any, list[nn.Parameter]] = {}
        self._plain: set[Any] = set()  # kinds of input whose output is not one tensor
        #: how many captures (forward and backward graph pairs) the stage holds
        self.captures = 0

    def __call__(self, x: Any, microbatch: int) -> Any:
        """The stage's output on ``x``: a capture's replay where one can run (a tensor
        input, gradients on), else the compiled call."""
        if not (_replayable(x) and torch.is_grad_enabled()) or not (
                x.requires_grad or any(p.requires_grad for p in self._layers.parameters())):
            return self._call(x)  # (nothing to differentiate: nothing to keep apart)
        key = _signature(x, self._layers)
        if key in self._plain:
            return self._call(x)
        if microbatch == 0:  # a new step: no micro-batch is in flight any more (one
            for kind, captures in self._all.items():  # of a failed step's included)
                self._free[kind] = list(captures)
        with _without_autocast_cache():
            graphed = self._free[key].pop() if self._free[key] else self._capture(key, x)
            if graphed is None:
                return self._call(x)
            for param in self._gradients[key]:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            output = graphed(_CopiedGradient.apply(x) if x.requires_grad else x)
        output.grad_fn.register_hook(functools.partial(_give_back, self._free[key], graphed))
        return output

    def _capture(self, key: Any, x: torch.Tensor) -> Callable[..., Any] | None:
        """A new capture for inputs like ``x``, its first replay checked; None where
        the stage's output is not one tensor (it then runs without graphs)."""
        sample = x.detach().clone().requires_grad_(x.requires_grad)
        params = [p for p in self._layers.parameters() if p.requires_grad]
        if torch.is_autocast_enabled("cuda"):
            # Autocast's cache keeps the weights it cast earlier in the step (the
            # compiled stage's probe casts them), and with them the parameters'
            # AccumulateGrad nodes, made on the default stream: a capture's backward
            # would then wait on that stream, which CUDA refuses (H200, torch 2.11).
            torch.clear_autocast_cache()
        expected = self._reference(sample, params)
        if expected is None:
            self._plain.add(key)
            return None
        if key not in self._gradients:  # the parameters the backward reaches
            self._gradients[key] = [p for p, g in zip(params, expected[2]) if g is not None]
        graphed = torch.cuda.make_graphed_callables(_Replayed(self._layers, self._call),
                                                    (sample,), allow_unused_input=True)
        self._check(graphed, sample, params, expected)
        self._all[key].append(graphed)
        self.captures += 1
        return graphed

    def _reference(self, sample: torch.Tensor,
                   params: list[nn.Parameter]) -> tuple[Any, ...] | None:
        """The compiled call's output on ``sample`` and its gradients (of the input and
        of ``params``) for an output gradient of ones; None unless the output is one
        tensor that needs a gradient."""
        leaf = sample.detach().clone().requires_grad_(sample.requires_grad)
        output = self._call(leaf)
        if not isinstance(output, torch.Tensor) or output.grad_fn is None:
            return None
        wanted = ([leaf] if leaf.requires_grad else []) + params
        grads = torch.autograd.grad(output, wanted, torch.ones_like(output), allow_unused=True)
        input_grad = grads[0] if leaf.requires_grad else None
        return output.detach(), input_grad, list(grads[1:] if leaf.requires_grad else grads)

    def _check(self, graphed: Callable[..., Any], sample: torch.Tensor,
               params: list[nn.Parameter], expected: tuple[Any, ...]) -> None:
        leaf = sample.detach().clone().requires_grad_(sample.requires_grad)
        output = graphed(leaf)
        wanted = ([leaf] if leaf.requires_grad else []) + params
        grads = torch.autograd.grad(output, wanted, torch.ones_like(output), allow_unused=True)
        found = [output.detach(), *grads]
        want = [expected[0], *([expected[1]] if leaf.requires_grad else []), *expected[2]]
        # The same kernels on the same input; a library may pick another algorithm in a
        # capture, which rounds otherwise: within 16-bit rounding under autocast.
        tolerance = 2e-2 if torch.is_autocast_enabled("cuda") else 1e-4
        for got, value in zip(found, want):
            if (got is None) != (value is None) or (got is not None and float(
                    (got.float() - value.float()).norm()) > tolerance * float(
                    value.float().norm()) + 1e-6):
                raise ConveyorError(
                    f"stage {self._index}: the CUDA graph captured for inputs of shape "
                    f"{tuple(sample.shape)} does not replay what the compiled stage "
                    "computes; run without cuda_graphs=True")


class _Replayed(nn.Module):
    """What a capture records: the stage's compiled call, with the stage's parameters
    (for ``make_graphed_callables``, which graphs a module's forward and backward)."""

    def __init__(self, layers: nn.Module, call: Callable[[Any], Any]) -> None:
        super().__init__()
        self.layers = layers
        self._run = call

    def forward(self, x: torch.Tensor) -> Any:
        return self._run(x)


class _CopiedGradient(torch.autograd.Function):
    """The identity, whose backward copies the gradient: a replay's gradient of the
    stage's input lies in the capture's static memory, which its next replay writes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


def _give_back(free: list[Callable[..., Any]], graphed: Callable[..., Any],
               grad_inputs: Any, grad_outputs: Any) -> None:
    """A node's post-hook: the micro-batch's backward has run, its capture is free."""
    free.append(graphed)


def _replayable(x: Any) -> bool:
    """Whether a capture can take ``x``: one tensor on a GPU."""
    return isinstance(x, torch.Tensor) and x.is_cuda


def _signature(x: torch.Tensor, layers: nn.Module) -> tuple[Any, ...]:
    """What a capture is for: the input's kind, autocast, and the layers' modes."""
    return (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad,
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            tuple(m.training for m in layers.modules()))


@contextlib.contextmanager
def _without_autocast_cache() -> Iterator[None]:
    """Autocast as it is, without its cache of cast weights (a capture must cast them
    itself; ``make_graphed_callables`` refuses the cache)."""
    if not torch.is_autocast_enabled("cuda"):
        yield
        return
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        yield


def check_cuda_graphs(*, devices: list[torch.device], compiled: bool, splits: bool,
                      modes: list[str], offloaded: bool, sharded: bool) -> None:
    """Refuses ``cuda_graphs=True`` where it cannot be exact, saying why.

    Raises:
        ConveyorError: a stage off CUDA, no ``compile=True``, a schedule that splits
            the backward, recomputation, offload or FSDP.
    """
    off = [i for i, device in enumerate(devices) if device.type != "cuda"]
    reasons = [
        (bool(off), f"stage {off[0] if off else 0} is on {devices[off[0]] if off else ''}: "
                    "CUDA graphs replay on a GPU only; give CUDA devices"),
        (not compiled, "it replays each stage's compiled graph: give compile=True too"),
        (splits, "a schedule that splits the backward into I and W keeps a micro-batch's "
                 "stage outputs past its own backward, which a replay would overwrite; "
                 "use gpipe, 1f1b or interleaved-1f1b"),
        (any(mode != "never" for mode in modes),
         "a recomputed stage runs its forward again inside the backward; give "
         "recompute=\"never\""),
        (offloaded, "offload= moves what a capture keeps in its own memory"),
        (sharded, "FSDP gathers the parameters a capture would hold fixed"),
    ]
    for refused, why in reasons:
        if refused:
            raise ConveyorError(f"cuda_graphs=True: {why}")
