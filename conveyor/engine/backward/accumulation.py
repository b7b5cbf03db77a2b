"""How a pipelined call's weight gradients reach ``.grad``.

:class:`SetAside`: a call's backward runs into empty ``.grad`` fields, with what the
parameters held before set aside. The call can then work on its own gradients alone (sum
the copies of a tied weight, divide by a token count, average over data-parallel
replicas) before they are added to the earlier ones, as autograd would have added them;
a call that fails leaves ``.grad`` as it found it.

:class:`FusedAccumulation`: within the call, each micro-batch's weight gradient of a
linear layer adds itself into ``.grad`` inside its own matrix product.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.torchprivate import has_gradient_hooks

__all__: list[str] = []


class SetAside:
    """Sets the ``.grad`` of ``params`` aside (to None) until :meth:`restore` or
    :meth:`add_back`."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._held: list[tuple[nn.Parameter, torch.Tensor | None]] = [
            (p, p.grad) for p in params]
        for p, _ in self._held:
            p.grad = None

    def restore(self) -> None:
        """Puts back the gradients held before, dropping what the call computed."""
        for p, earlier in self._held:
            p.grad = earlier

    def add_back(self) -> None:
        """Adds the gradients held before to the call's own (in place, as autograd
        accumulates)."""
        for p, earlier in self._held:
            if earlier is None:
                continue
            if p.grad is None:
                p.grad = earlier
            else:
                p.grad = earlier.add_(p.grad)


# ------------------------------------------------------------ fused weight gradients
#
# Every micro-batch's backward adds its weight gradient into ``.grad``: autograd computes
# the product into a fresh tensor, then reads it and ``.grad`` and writes ``.grad`` again,
# a pass over memory as large as the weights for every micro-batch. A linear layer's
# weight gradient is one matrix product, which can add itself into ``.grad`` as it is
# computed (``addmm_``, as Megatron's gradient-accumulation fusion does on GPUs). On
# config P at 8 micro-batches under torchrun (a 2-core CPU machine) a 1F1B step took
# 8-10% less time with it, GPipe's 0-9% (benchmarks/distributed.py, README "Measured").
#
# The fused product runs only where nothing else could see the difference: inside a
# stage's whole backward (``B``, not the ``I``/``W`` split, which must keep the weight
# gradient apart), for a linear layer (an ``nn.Linear``, or a traced stage's call of
# ``aten.linear`` or ``aten.addmm``) whose weight and bias are plain leaf parameters
# without gradient hooks, outside autocast. Anywhere else the layer is autograd's own
# linear: called by user code, under ``torch.autograd.grad``, or in another backward.
#
# Nor does it run for a small weight: the fused node is a Python autograd function, whose
# cost per call outweighs the pass over memory it saves below about 2^16 elements (two
# processes, 1F1B, 8 layers of Linear(d, d), fused over autograd's: d=64 1.27x, 128 1.15x,
# 256 0.98x, 512 0.84x the step; ``benchmarks/host_overhead.py`` is the host-bound case).
FUSED_MIN_ELEMENTS = 1 << 16

def fusing_allowed() -> bool:
    """Whether pipelines may fuse weight gradients (``CONVEYOR_FUSE_ACCUMULATION=0``:
    autograd's accumulation everywhere, to compare or to rule it out)."""
    return os.environ.get("CONVEYOR_FUSE_ACCUMULATION", "1") != "0"


_running = threading.local()  # .accumulator: the stage whose layers run on this thread


class FusedAccumulation:
    """One stage's switch for fused weight gradients: its layers' forwards build fused
    nodes (:meth:`layers`), and those nodes add into ``.grad`` only while the stage's
    own whole backward runs (:meth:`backward`), whichever thread autograd runs them on.
    """

    def __init__(self, modules: Iterable[nn.Module],
                 graphs: Iterable[torch.fx.GraphModule] = ()) -> None:
        #: whether any layer or graph was given fused nodes (else nothing to switch)
        self.fuses = False
        for module in modules:
            if type(module) not in (nn.Linear, FusedLinear):  # (a model pipelined before)
                continue
            if cast(nn.Linear, module).weight.numel() < FUSED_MIN_ELEMENTS:
                module.__class__ = nn.Linear
                continue
            module.__class__ = FusedLinear  # as FSDP2 swaps classes; state is the same
            cast(FusedLinear, module).accumulator = self
            self.fuses = True
        for graph in graphs:  # a traced stage's: its layers are calls of aten ops
            found = [node for node in graph.graph.nodes if node.op == "call_function"
                     and node.target in _FUSED_OPS]
            for node in found:
                node.target = _FUSED_OPS[node.target]
            if found:
                graph.recompile()
                self.fuses = True
        self.adding = False

    @contextlib.contextmanager
    def layers(self) -> Iterator[None]:
        """While the stage runs its layers on this thread (forward or recomputation)."""
        before = getattr(_running, "accumulator", None)
        _running.accumulator = self
        try:
            yield
        finally:
            _running.accumulator = before

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """While the stage's whole backward (``B``) runs."""
        self.adding = True
        try:
            yield
        finally:
            self.adding = False


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           owner: FusedAccumulation | None = None) -> torch.Tensor:
    """``F.linear``, whose weight gradient adds itself into ``.grad`` inside a stage's
    backward (see :class:`FusedAccumulation`).

    Args:
        owner: the stage of the calling layer. A call inside that stage's backward is
            a recomputation the model's own ``torch.utils.checkpoint`` makes, which must
            save what its forward saved; autograd may run it on another thread than the
            stage's (a GPU's), where the stage's layers are not marked as running."""
    accumulator = getattr(_running, "accumulator", None)
    if accumulator is None and owner is not None and owner.adding:
        accumulator = owner
    if accumulator is None or not _fusable(input, weight, bias):
        return F.linear(input, weight, bias)
    return _ProductFunction.apply(input, weight, bias, accumulator, False)


def addmm(bias: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, *,
          beta: float = 1, alpha: float = 1) -> torch.Tensor:
    """``torch.addmm``; as a layer ``bias + input @ weight`` with ``weight`` stored
    (in, out), such as GPT-2's ``Conv1D``, fused like :func:`linear`."""
    accumulator = getattr(_running, "accumulator", None)
    if accumulator is None or beta != 1 or alpha != 1 or bias.dim() != 1 \
            or not _fusable(input, weight, bias):
        return torch.addmm(bias, input, weight, beta=beta, alpha=alpha)
    return _ProductFunction.apply(input, weight, bias, accumulator, True)


class FusedLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient adds itself into ``.grad`` inside a stage's
    backward (see :class:`FusedAccumulation`); elsewhere exactly ``nn.Linear``."""

    accumulator: FusedAccumulation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias, owner=self.accumulator)


# Named as the layer it stands for, so that reprs, errors and tables read as the model's
# (pickle finds it by its qualified name, FusedLinear).
FusedLinear.__name__ = "Linear"


def _fusable(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(input.device.type) \
            or weight.numel() < FUSED_MIN_ELEMENTS:
        return False
    return all(type(p) is nn.Parameter and p.requires_grad and p.dtype == input.dtype
               and p.is_contiguous() and not has_gradient_hooks(p)
               and not getattr(p, "_post_accumulate_grad_hooks", None)
               for p in (weight, bias) if p is not None)


class _ProductFunction(torch.autograd.Function):
    """``input @ weight.T + bias`` (``F.linear``), or with ``transposed``, ``bias + input
    @ weight`` for a 2-d input (``addmm``)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None,
                accumulator: FusedAccumulation, transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.params, ctx.accumulator, ctx.transposed = (weight, bias), accumulator, transposed
        if transposed:
            assert bias is not None
            return torch.addmm(bias, input, weight)
        if input.dim() == 2:
            return F.linear(input, weight, bias)
        # F.linear would return a view of its 2-d product, which the layers after could
        # not modify in place (a custom function's output): the product goes into the
        # output instead.
        output = input.new_empty((*input.shape[:-1], weight.shape[0]))
        rows = output.view(-1, weight.shape[0])
        flat = input.reshape(-1, input.shape[-1])
        if bias is None:
            torch.mm(flat, weight.t(), out=rows)
        else:
            torch.addmm(bias, flat, weight.t(), out=rows)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        input, weight_value = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight_value.t() if ctx.transposed else weight_value)
        rows, columns = grad.reshape(-1, grad.shape[-1]), input.reshape(-1, input.shape[-1])
        # The weight's gradient is left.T @ right, in the weight's own layout.
        left, right = (columns, rows) if ctx.transposed else (rows, columns)
        weight, bias = ctx.params
        if ctx.accumulator.adding and not torch.is_grad_enabled() and all(
                p.grad is None or (p.grad.dtype == grad.dtype and p.grad.layout == torch.strided
                                   and not p.grad.requires_grad)
                for p in ctx.params if p is not None):
            add_into_grads(weight, bias, left, right, rows)
            return grad_input, None, None, None, None
        return (grad_input, left.t().mm(right), None if bias is None else rows.sum(0), None,
                None)


def add_into_grads(weight: nn.Parameter, bias: nn.Parameter | None, left: torch.Tensor,
                   right: torch.Tensor, rows: torch.Tensor) -> None:
    """Adds a layer's gradients into ``.grad`` (set where it is None): the weight's,
    ``left.T @ right``, in the product itself; the bias's, the sum of ``rows``."""
    if weight.grad is None:
        weight.grad = left.t().mm(right)
    else:
        weight.grad.addmm_(left.t(), right)
    if bias is not None:
        bias.grad = rows.sum(0) if bias.grad is None else bias.grad.add_(rows.sum(0))


_FUSED_OPS: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.aten.linear.default: linear, torch.ops.aten.addmm.default: addmm}
