"""``Pipeline(verify_every=N)``: a certificate for the user's own run.

Every N-th step, after the pipeline's step, the same micro-batches run again through
the unpartitioned computation, stage by stage on the stages' own devices (no device
holds more than its stages): each micro-batch through stage 0's modules, its values
handed on as the model's own graph hands them (autograd spans the devices), the loss
weighted as ``Pipeline.step`` documents it (a scalar by the micro-batch's share of the
rows, a ``(loss_sum, count)`` pair summed and divided by the whole count), and
``torch.autograd.grad`` for the gradients: none of the pipeline's schedule, transport,
recomputation or gradient accumulation runs, and ``.grad`` is never touched. The loss
and each parameter's gradient are compared with what the step computed::

    step s:  pipeline step ──> grads G (this step's: .grad after - .grad before)
             reference     ──> per micro-batch m: g_m = d(seed_m)/dθ, R = Σ_m g_m
             |loss - loss_ref| and ‖G_p - R_p‖ ≤ tol · Σ_m ‖g_m,p‖   for each parameter p

The tolerance ``tol = eps(dtype) · 2 · (M + K)``: both sides compute the same
operations on the same micro-batches with the same kernels (the recomputation replays
the random streams), so they differ only by the order in which the M micro-batches'
gradients are added up (at most M - 1 roundings of each term: ``(M-1)·eps·Σ‖g_m‖``),
by fused accumulation and split weight gradients (a rounding per term) and by the
hand-over between K stages; 2x covers norms against elementwise bounds. A defect (a
micro-batch's gradient lost, a loss weighted wrong, swapped values) is of the order of
the gradient itself. ``eps`` is the compute dtype's: the autocast dtype of
``precision=``, else the parameters'.

Training state is left as it was: torch's random streams (forked), every buffer of the
stages' modules (batch-norm statistics: put back, the same objects), ``.grad``, the
step counters. It costs about one extra forward and backward of the model every N
steps (without a pipeline's overlap: the stages run one after the other).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.engine.loss import LossFn, autocast, loss_and_count
from conveyor.engine.microbatch import batch_size, split
from conveyor.engine.recompute.rng import draw_step_seed
from conveyor.errors import ConfigError, VerificationError
from conveyor.runtime.runtime import Runtime
from conveyor.torchprivate import pytree

__all__: list[str] = []

logger = logging.getLogger("conveyor")


def check_every(every: int | None) -> None:
    """Raises ConfigError unless ``every`` is None or a positive integer."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                              or every < 1):
        raise ConfigError(f"verify_every={every!r}: give a number of steps >= 1 (verify "
                          "every N-th step), or None (never, the default)")


@dataclass
class Before:
    """What the verified step starts from: its random seed, each parameter's gradient."""

    step_seed: int
    grads: dict[int, torch.Tensor | None]


class Certificate:
    """Counts the steps and verifies every ``every``-th (see the module's docstring)."""

    def __init__(self, every: int, chunks: int) -> None:
        self.every, self.chunks = every, chunks
        self.steps = 0  # steps begun
        self.verified = 0  # steps verified
        self.due_now = False  # whether the last step begun was verified

    def due(self) -> bool:
        """Counts a step; whether it is one to verify."""
        self.steps += 1
        self.due_now = False
        return self.steps % self.every == 0

    def before(self, params: Sequence[nn.Parameter]) -> Before:
        """What the step will start from, read without drawing from torch's streams."""
        state = torch.get_rng_state()
        seed = draw_step_seed()  # the seed the step will draw next
        torch.set_rng_state(state)
        return Before(seed, {id(p): None if p.grad is None else p.grad.detach().clone()
                             for p in params})

    def verify(self, runtime: Runtime, before: Before,
               named: Sequence[tuple[str, nn.Parameter]],
               batch: tuple[Any, Any] | Sequence[tuple[Any, Any]], *, loss_fn: LossFn,
               loss: torch.Tensor, dtype: torch.dtype | None, training: bool) -> None:
        """Re-runs the step's micro-batches (``batch``: the step's ``(inputs, targets)``,
        split as the step splits it, or the micro-batches it was given) through the
        unpartitioned computation and compares; logs "verified at step s".

        Raises:
            VerificationError: the loss or a gradient differs beyond the tolerance.
            ConfigError: the stages do not all run in this process.
        """
        schedule = runtime.schedule
        if set(runtime.stages) != set(range(schedule.num_stages)):
            raise ConfigError("verify_every needs every stage in this process (one process, "
                              "stages on threads); under torchrun it is not available yet")
        params = [p for _, p in named]
        parts = (list(zip(split(batch[0], self.chunks), split(batch[1], self.chunks)))
                 if isinstance(batch, tuple) else list(batch))
        devices = [stage.device for stage in runtime.stages.values()]
        with _kept_state(runtime, devices):
            with autocast(runtime.devices, dtype):
                reference = _reference(runtime, params, parts, loss_fn,
                                       before.step_seed if training else None)
        eps = torch.finfo(dtype or params[0].dtype).eps if params else 2.0**-52
        tol = eps * 2 * (len(reference.parts) + schedule.num_stages)
        self._compare(before, named, loss, reference, tol)
        self.verified += 1
        self.due_now = True
        logger.info("conveyor: verified at step %d (loss and %d gradients within %.2g of "
                    "the unpartitioned computation)", self.steps, len(named), tol)

    def _compare(self, before: Before, named: Sequence[tuple[str, nn.Parameter]],
                 loss: torch.Tensor, reference: _Reference, tol: float) -> None:
        want = float(reference.loss)
        if abs(float(loss) - want) > tol * reference.loss_scale + 1e-300:
            raise VerificationError(
                f"verify_every: step {self.steps}'s loss is {float(loss)!r} in the pipeline "
                f"but {want!r} in the unpartitioned computation of the same micro-batches "
                f"(tolerance {tol:.2g} relative); the pipeline's loss is wrong",
                step=self.steps, tensor="loss")
        # A gradient that is roundoff beside the model's others (a bias before a norm:
        # zero but for rounding) is judged on the model's scale, as its rounding is.
        overall = max(reference.scales.values(), default=0.0)
        for name, param in named:
            start = before.grads.get(id(param))
            got = torch.zeros_like(param) if param.grad is None else param.grad.detach()
            if start is not None:
                got = got - start
            expected = reference.grads.get(id(param))
            if expected is None:
                expected = torch.zeros_like(param)
            gap = float((got.double() - expected.double()).norm())
            scale = max(reference.scales.get(id(param), 0.0), overall)
            if gap > tol * scale + 1e-300 and not (math.isnan(gap) and scale == 0.0):
                size = float(expected.double().norm())
                raise VerificationError(
                    f"verify_every: step {self.steps}'s gradient of {name!r} differs from "
                    f"the unpartitioned computation's: |pipeline - reference| = {gap:.3g}, "
                    f"|reference| = {size:.3g} (tolerance {tol:.2g} x {scale:.3g}, the sum of "
                    "its micro-batches' gradient norms, at least the model's largest); the "
                    "first tensor that differs, in the model's order", step=self.steps,
                    tensor=name)


@dataclass
class _Reference:
    loss: float
    loss_scale: float  # the sum of the micro-batches' |loss| (the loss's rounding scale)
    grads: dict[int, torch.Tensor]
    scales: dict[int, float]
    parts: list[int]


def _reference(runtime: Runtime, params: Sequence[nn.Parameter],
               parts: Sequence[tuple[Any, Any]], loss_fn: LossFn,
               step_seed: int | None) -> _Reference:
    """The step's micro-batches through every stage's modules in turn, no schedule."""
    rows = sum(batch_size(y) for _, y in parts)
    grads: dict[int, torch.Tensor] = {}
    scales: dict[int, float] = {}
    total, count, magnitude, paired = 0.0, 0.0, 0.0, False
    wanted = [p for p in params if p.requires_grad]
    for m, (x, y) in enumerate(parts):
        output = _through_stages(runtime, x, m, step_seed)
        last = runtime.stages[runtime.schedule.num_stages - 1]
        value, pair = loss_and_count(loss_fn(output, _moved(y, last.device)), m)
        paired = pair is not None
        if pair is None:
            seed = value.reshape(()) * (batch_size(y) / rows)
        else:
            seed, count = value.reshape(()), count + float(pair)
        total += float(seed.detach())
        magnitude += abs(float(seed.detach()))
        found = torch.autograd.grad(seed, wanted, allow_unused=True)
        for p, g in zip(wanted, found):
            if g is not None:
                grads[id(p)] = grads[id(p)] + g if id(p) in grads else g.detach()
                scales[id(p)] = scales.get(id(p), 0.0) + float(g.double().norm())
    for tie in runtime.layout.ties:  # one weight, a copy per stage: each gets the sum
        ids = [id(c) for c in tie.copies if id(c) in grads]
        if len(ids) > 1:
            whole = sum((grads[i].to(grads[ids[0]].device) for i in ids[1:]), grads[ids[0]])
            scale = sum(scales[i] for i in ids)
            for i in ids:
                grads[i], scales[i] = whole.to(grads[i].device), scale
    if paired:
        grads = {k: g / count for k, g in grads.items()}
        scales = {k: s / count for k, s in scales.items()}
        total, magnitude = total / count, magnitude / count
    return _Reference(total, magnitude, grads, scales, [batch_size(y) for _, y in parts])


def _through_stages(runtime: Runtime, x: Any, m: int, step_seed: int | None) -> Any:
    """Micro-batch m through stage 0, 1, ... K-1 (each on its device), the values each
    stage makes going to the stages that use them, as the model's graph does."""
    schedule = runtime.schedule
    received: dict[int, dict[int, Any]] = {}
    output: Any = None
    for k in range(schedule.num_stages):
        stage = runtime.stages[k]
        given = _moved(x, stage.device) if k == 0 else stage.join(
            {j: _moved(v, stage.device) for j, v in received.get(k, {}).items()})

        def loop(h: Any, stage: Any = stage) -> Any:
            for offset, layer in enumerate(stage.layers):
                seeded = (stage.randomness.layer_call(step_seed, stage.first_layer + offset,
                                                      m, layer)
                          if step_seed is not None else contextlib.nullcontext())
                with seeded:
                    h = layer(h)
            return h

        output = stage.layers(given, loop)
        if k < schedule.num_stages - 1:
            for j, value in stage.route(output, schedule.forward_to(k)).items():
                received.setdefault(j, {})[k] = value
    return output


def _moved(tree: Any, device: torch.device) -> Any:
    """``tree``'s tensors on ``device``, in the autograd graph (not detached)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), tree)


@contextlib.contextmanager
def _kept_state(runtime: Runtime, devices: Sequence[torch.device]) -> Iterator[None]:
    """Torch's random streams forked, every buffer of the stages' modules put back
    (the same objects, their values) after the body."""
    kept: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for stage in runtime.stages.values():
        for module in stage.layers.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and id(buffer) not in seen:
                    seen.add(id(buffer))
                    kept.append((module._buffers, name, buffer, buffer.detach().clone()))
        for bound in _bound_modules(stage):
            for name, buffer in list(bound._buffers.items()):
                if buffer is not None and id(buffer) not in seen:
                    seen.add(id(buffer))
                    kept.append((bound._buffers, name, buffer, buffer.detach().clone()))
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, value in kept:
                owner[name] = buffer
                buffer.copy_(value)


def _bound_modules(stage: Any) -> list[nn.Module]:
    """The modules a traced stage binds (the model's, outside the stage's own tree)."""
    found: list[nn.Module] = []
    for layer in stage.layers:
        bound: Callable[[], list[nn.Module]] | None = getattr(layer, "bound_modules", None)
        if bound is not None:
            found += bound()
    return found
