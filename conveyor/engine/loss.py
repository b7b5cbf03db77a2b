"""The loss of a micro-batch as ``loss_fn`` returns it (a scalar, or ``(loss_sum, count)``),
and mixed precision: autocast for every stage, and loss scaling for float16."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from conveyor.errors import ConfigError, ConveyorError
from conveyor.torchprivate import norms, scale_in_place

__all__ = ["token_loss"]

#: ``loss_fn(output, target)``: a one-element tensor, or a ``(loss_sum, count)`` pair.
LossFn = Callable[[Any, Any], Any]


def token_loss(output: Any, targets: torch.Tensor, *,
               ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the tokens whose target is not ``ignore_index``, and
    their count: a ``loss_fn`` whose step loss is the mean over every real token of the
    whole batch, exactly, however the padding falls into micro-batches.

    Args:
        output: the logits (``(..., vocabulary)``), or a model's output holding them
            (a Hugging Face ``ModelOutput`` or a dict with ``"logits"``, or a tuple
            whose first element they are).
        targets: the class of each position, ``output``'s shape without its last
            dimension (for a language model, the next token: shifted by the caller).
        ignore_index: the target of padding, counted nowhere.

    Raises:
        ValueError: the targets' shape does not match the logits'.
    """
    logits = output
    if not isinstance(logits, torch.Tensor):
        logits = output["logits"] if isinstance(output, dict) or hasattr(output, "keys") \
            else output[0]
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(f"token_loss: the logits are {tuple(logits.shape)}, so the targets "
                         f"must be {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # a softmax over a vocabulary, summed: in float32 at least
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum")
    return total, (targets != ignore_index).sum()


def loss_and_count(result: Any, m: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss tensor of micro-batch m, and the count of a ``(loss_sum, count)`` pair
    as a float64 tensor (None for a plain scalar loss).

    Raises:
        ConveyorError: ``result`` is neither a one-element tensor nor such a pair.
    """
    count = None
    if isinstance(result, (tuple, list)) and len(result) == 2:
        result, count = result
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            count = count.detach().reshape(()).to(torch.float64)
        elif isinstance(count, (int, float)) and not isinstance(count, bool) and count >= 0:
            count = torch.tensor(float(count), dtype=torch.float64)
        else:
            shown = (f"a tensor of shape {tuple(count.shape)}" if isinstance(count, torch.Tensor)
                     else repr(count))
            raise ConveyorError(
                f"loss_fn returned a pair whose count is {shown} on micro-batch {m}; the "
                "count must be a number >= 0 or a one-element tensor (e.g. the number of "
                "tokens that are not padding)"
            )
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        got = (tuple(result.shape) if isinstance(result, torch.Tensor)
               else type(result).__name__)
        raise ConveyorError(
            f"loss_fn must return a one-element tensor or a (loss_sum, count) pair, got "
            f"{got} on micro-batch {m}; reduce over the samples (reduction='mean'), or "
            "return (loss summed over elements, number of elements)"
        )
    return result, count



#: ``precision=`` names and the dtype each computes in (None: the model's own dtype).
PRECISIONS: dict[str | None, torch.dtype | None] = {
    None: None, "32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str | None) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: no autocast).

    Raises:
        ConfigError: an unknown name.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}: choose one of 'bf16' (bfloat16 "
                          "compute, float32 weights), 'fp16' (float16 compute with loss "
                          "scaling) or None (the model's own dtype)")
    return PRECISIONS[precision]


def autocast(devices: Iterable[torch.device], dtype: torch.dtype | None) -> ExitStack:
    """Autocast to ``dtype`` on each device type of ``devices``: entered on the caller's
    thread, it reaches every stage's worker (each takes the caller's autocast state)."""
    stack = ExitStack()
    if dtype is not None:
        for device_type in sorted({d.type for d in devices}):
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
    return stack


def by_device(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by device, in the order each device first comes."""
    grouped: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        grouped.setdefault(tensor.device, []).append(tensor)
    return list(grouped.values())


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` (on one device) is finite, at one host
    synchronisation.

    A NaN or an infinity makes a tensor's norm NaN or infinite, so a finite one clears
    the whole tensor: one read of it, where ``isfinite().all()`` also writes and reads a
    mask (about 10x slower on a CPU), all of them in one call
    (:func:`~conveyor.torchprivate.norms`). A norm can overflow where no element is
    infinite (float16's above 65504, a float32 or bfloat16 element above 1.8e19
    squared), so a tensor whose norm is not finite is then checked element by element.
    """
    real = [t for t in tensors if t.is_floating_point()]
    if real:
        finite = torch.isfinite(torch.stack(norms(real)))
        if not bool(finite.all()) and not all(
                bool(torch.isfinite(t).all()) for t, ok in zip(real, finite.tolist()) if not ok):
            return False
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_complex())


class LossScaler:
    """Loss scaling for float16, with ``torch.amp.GradScaler``'s rules, over a pipeline.

    Each micro-batch's loss is multiplied by :attr:`scale` before its backward; after
    the step's backward the gradients are divided by it and checked. A NaN or inf on
    any stage (of any rank: the pipeline agrees on it) drops the step's gradients on
    every stage, halves the scale and sets :attr:`found_inf`; :meth:`step` then skips
    the optimizer. ``growth_interval`` steps in a row without one double it.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.found_inf = False
        self._good_steps = 0

    def unscale(self, grads: Sequence[torch.Tensor],
                agree: Callable[[torch.Tensor], None] | None = None) -> bool:
        """Divides ``grads`` by the scale; whether any (on any rank, through ``agree``,
        which takes the maximum of a one-element tensor over the ranks) is not finite."""
        found = torch.zeros(1)
        for same in by_device(grads):  # one host synchronisation per device
            scale_in_place(same, 1.0 / self.scale)
            if not all_finite(same):
                found.fill_(1.0)
        if agree is not None:
            agree(found)
        return bool(found.item())

    def record(self, found_inf: bool) -> None:
        """The scale for the next step, after one that did (or did not) overflow: what
        the pipeline calls once its step's gradients are checked."""
        self.found_inf = found_inf
        if found_inf:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def update(self, new_scale: float | torch.Tensor | None = None, *,
               found_inf: bool | None = None) -> None:
        """``torch.amp.GradScaler.update``'s place in a loop (``scaler.step(opt)`` then
        ``scaler.update()``): the pipeline has already set the next step's scale when it
        checked the step's gradients, so with no argument this changes nothing;
        ``new_scale`` sets the scale, as torch's does. ``found_inf`` (or a bool given
        alone, as earlier versions took it) applies the rule for a step that did (or did
        not) overflow, as :meth:`record`.
        """
        if isinstance(new_scale, bool):
            new_scale, found_inf = None, new_scale
        if found_inf is not None:
            self.record(found_inf)
        if new_scale is not None:
            self.scale = float(new_scale)

    def get_scale(self) -> float:
        """The scale the next step's losses are multiplied by (as torch's GradScaler)."""
        return self.scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do: the pipeline hands back gradients already unscaled (torch's
        ``scaler.unscale_(optimizer)`` before clipping may stay in a loop)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless the last step overflowed; whether it stepped."""
        if self.found_inf:
            return False
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = state["growth_factor"]
        self.backoff_factor = state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
        self._good_steps = state["good_steps"]
