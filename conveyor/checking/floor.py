"""The plain model's own noise floor: how far the plain model differs from itself when
only the rounding of its backward changes, and what in it computes below float64.

A pipeline forms a step's gradients as the plain model does, but it seeds each
micro-batch's backward as the pipeline must: a ``(loss_sum, count)`` loss backward from
the sum alone (the whole step's count is known only once every micro-batch has run) and
the gradients divided by the count at the end; a scalar loss times its micro-batch's
share. In float64 the two orders agree to about 1e-16. A float64 model that computes some
operations in float32 inside (an RMSNorm that upcasts "for stability" to float32, and
so, in a float64 model, down to it; a softmax, a rotary table, a selective scan) rounds
the gradient that reaches those operations to float32: a seed of ``1/count`` and a seed
of 1 then ``/count`` give gradients one float32 ulp apart (about 6e-8 relative) wherever
``count`` is not a power of two. The traced stages are not the cause: they run the same
kernels on the same layouts as the eager model (a step over the same seeds is bitwise
equal), which is why 8 or 16 tokens match and 9, 11 or 12 do not.

:func:`noise_floor` runs the plain model once more, on the whole batch with the same
random streams, seeded the pipeline's way, and measures the gap; :func:`check` then
judges the pipeline against that floor (times :data:`MARGIN`) rather than against float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.checking.plain import PlainRun, run_plain
from conveyor.torchprivate import TorchDispatchMode, pytree

__all__: list[str] = []

#: The pipeline may differ from the plain model by this many times the plain model's own
#: gap. Both gaps are float32 roundings flipped by a seed rounded another way: one ulp
#: each, here or there, so the two maxima are of one size (measured over ten decoder
#: families: the pipeline's gap 0.3-3x the floor); a defect (a micro-batch's gradient
#: lost, a loss weighted wrong) is of the order of the gradient itself, 1e5 times more.
MARGIN = 10.0
#: A floor below this is float64's own: the model computes in float64 throughout.
FLOAT64_LEVEL = 1e-12
#: A floor above this is not rounding (float16's ulp is 1e-3): the model differs from
#: itself for another reason (state a forward changes, an input changed in place,
#: draws the check cannot replay), which the check's findings name; it is not a floor.
ROUNDING_LEVEL = 1e-3
#: The scale a scalar loss is seeded with in the floor's run (not a power of two, as a
#: micro-batch's share of the batch often is not).
_SCALAR_SEED = 3.0


@dataclass
class Floor:
    """How far the plain model differs from itself.

    Attributes:
        relative: the largest relative gap over the loss and every gradient.
        where: the tensor with that gap.
        lower: operations that compute below the model's float64, as
            ``"Module: op, op"`` (empty: none seen).
    """

    relative: float = 0.0
    where: str = ""
    lower: list[str] = field(default_factory=list)

    @property
    def elevated(self) -> bool:
        """Whether the model's own rounding is above float64's: it differs from itself
        by a rounding's size and computes below float64 inside."""
        return FLOAT64_LEVEL < self.relative <= ROUNDING_LEVEL and bool(self.lower)

    def rtol(self, rtol: float) -> float:
        """The tolerance to judge the pipeline with: ``rtol`` or the floor's margin."""
        return max(rtol, MARGIN * self.relative) if self.elevated else rtol

    def cause(self) -> str:
        """The cause, in words, of a gap at the floor's size."""
        inside = "; ".join(self.lower[:3]) or "operations the check did not see"
        return (f"float32 inside the model: the plain model differs from itself by "
                f"{self.relative:.2g} (relative, at {self.where}) when only the rounding "
                f"of its backward's seed changes, because it computes in float32 inside "
                f"a float64 model ({inside}); the pipeline is judged against "
                f"{MARGIN:g}x that")


class _LowerPrecision(TorchDispatchMode):
    """Notes every operation whose floating output is below float64, by the innermost
    module running it."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack, self.seen = stack, dict[str, list[str]]()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        low = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
               and t.is_floating_point() and t.dtype != torch.float64]
        if low and self.stack:
            ops = self.seen.setdefault(self.stack[-1], [])
            name = str(getattr(func, "__name__", func)).split(".")[0]
            if name not in ops:
                ops.append(name)
        return out


def lower_precision(plain: nn.Module, call: Callable[[nn.Module], Any]) -> list[str]:
    """What in ``plain`` (a float64 model) computes below float64, on one forward of
    ``call`` on a copy, as ``"Module: op, op"`` per module class."""
    model = copy.deepcopy(plain)
    stack: list[str] = []

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(type(module).__name__)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    mode = _LowerPrecision(stack)
    try:
        with torch.no_grad(), mode:
            call(model)
    except Exception:  # noqa: BLE001 - a model the mode cannot watch: nothing named
        return []
    finally:
        for handle in handles:
            handle.remove()
    return [f"{kind}: {', '.join(ops[:4])}" for kind, ops in mode.seen.items()]


def noise_floor(before: nn.Module, reference: PlainRun, indices: Sequence[int], inputs: Any,
                targets: Any, *, loss_fn: Callable[[Any, Any], Any], chunks: int, seed: int,
                split_at: Sequence[str] | None, call: Callable[[nn.Module], Any]) -> Floor:
    """The plain model (``before``: a copy as it was before the reference's step) run
    again on the same batch and streams, its backward seeded the pipeline's way, against
    the reference's loss and gradients; ``call`` runs a model's forward on the batch
    (to name what computes below float64)."""
    again = run_plain(before, indices, inputs, targets, loss_fn=loss_fn, chunks=chunks,
                      seed=seed, split_at=split_at, seeded=_pipeline_seed)
    floor = Floor()
    assert reference.loss is not None and again.loss is not None
    _widen(floor, "the loss", again.loss, reference.loss)
    for name, grad in again.grads.items():
        want = reference.grads.get(name)
        if want is not None and grad is not None:
            _widen(floor, repr(name), grad, want)
    if FLOAT64_LEVEL < floor.relative <= ROUNDING_LEVEL:
        floor.lower = lower_precision(before, call)
    return floor


def _pipeline_seed(value: Any, whole: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The pipeline's seed for the loss ``loss_fn`` returned on the whole batch: the sum
    of a pair, to be divided by its count after backward; a scalar times a factor."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        total, count = value
        return total.reshape(()), float(count)
    return whole * _SCALAR_SEED, _SCALAR_SEED


def _widen(floor: Floor, where: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.detach().double(), want.detach().double()
    scale = float(want.abs().max()) if want.numel() else 0.0
    if not scale:
        return
    gap = float((got - want).abs().max()) / scale
    if gap > floor.relative:
        floor.relative, floor.where = gap, where
