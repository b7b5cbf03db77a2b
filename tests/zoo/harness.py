"""One family of the zoo pipelined and compared with its plain model: the reference step
once per family, then a Pipeline (from its own deep copy of the model) per split and
schedule, each gradient against the reference's."""

from __future__ import annotations

import copy
import re
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import conveyor
from conveyor.engine.microbatch import split
from tests.zoo.families import CHUNKS, Family

__all__ = ["AUTO", "BF16_TOLERANCE", "SCHEDULES", "Outcome", "Prepared", "bf16_run",
           "prepare", "pipelined", "tolerance"]

AUTO = "auto"  # the split chosen by stages=2
RUN_LIMIT = 300  # seconds a run may take (build, trace, step) before the zoo gives up
#: The schedules each split runs under, with their recomputation.
SCHEDULES = {"1f1b": "except_last", "zero-bubble": "always"}


#: ``precision="bf16"`` against the plain float32 model under the caller's own bfloat16
#: autocast: the same operations in bfloat16, summed in another order (micro-batches).
BF16_TOLERANCE = 3e-2


def tolerance(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5


@dataclass
class Prepared:
    """A family built once: the model as built (never stepped), its batch in the family's
    dtype, and the plain model's loss and gradients on the whole batch."""

    family: Family
    model: nn.Module
    inputs: Any
    targets: torch.Tensor
    loss_fn: Any
    split_at: list[str]
    loss: float
    grads: dict[str, torch.Tensor | None]
    aliases: list[set[str]]


@dataclass
class Outcome:
    """One pipeline: where it was cut, and its largest relative error, or what failed."""

    split: str
    schedule: str
    cut: list[str] | None = None
    error: float | None = None
    float32_error: float | None = None  # of the family's float32_grads, if any
    failure: str | None = None
    seconds: float = 0.0

    def exact(self, dtype: torch.dtype) -> bool:
        return (self.error is not None and self.error <= tolerance(dtype)
                and (self.float32_error or 0.0) <= tolerance(torch.float32))


def cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, dict):
        return {k: cast(v, dtype) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def prepare(family: Family) -> Prepared:
    """Builds the family and takes the plain model's step on a deep copy: the loss over
    the whole batch (over the pipeline's micro-batches, averaged, for a model that
    normalises over its batch)."""
    case = family.build()
    model = case.model.to(family.dtype)
    inputs, targets = cast(case.inputs, family.dtype), cast(case.targets, family.dtype)
    plain = copy.deepcopy(model)
    if family.per_microbatch:
        parts = zip(split(inputs, CHUNKS), split(targets, CHUNKS))
        loss = torch.stack([case.loss(call(plain, x), y) for x, y in parts]).mean()
    else:
        loss = case.loss(call(plain, inputs), targets)
    loss.backward()
    grads, aliases = {}, dict[int, set[str]]()
    for name, param in plain.named_parameters(remove_duplicate=False):
        grads[name] = None if param.grad is None else param.grad.detach()
        aliases.setdefault(id(param), set()).add(name)
    return Prepared(family, model, inputs, targets, case.loss, case.split_at,
                    float(loss.detach()), grads, list(aliases.values()))


def out_of_time(signum: int, frame: Any) -> None:
    raise TimeoutError(f"gave up after {RUN_LIMIT} s (python -m tests.zoo's limit per run)")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def pipelined(prepared: Prepared, split_name: str, schedule: str) -> Outcome:
    """A Pipeline of two stages on threads, cut by ``stages=2`` (``AUTO``) or at the
    family's named split, one step of ``CHUNKS`` micro-batches under ``schedule``."""
    outcome = Outcome(split_name, schedule)
    start = time.perf_counter()
    try:
        signal.signal(signal.SIGALRM, out_of_time)
        signal.alarm(RUN_LIMIT)
        model = copy.deepcopy(prepared.model)
        pipe = conveyor.Pipeline(
            model, stages=2, split_at=None if split_name == AUTO else prepared.split_at,
            sample=split(prepared.inputs, CHUNKS)[0], devices=["cpu", "cpu"], chunks=CHUNKS,
            schedule=schedule, recompute=SCHEDULES[schedule], loss_fn=prepared.loss_fn)
        outcome.cut = list(pipe.split_at or [])
        loss = float(pipe.step(prepared.inputs, prepared.targets))
        pattern = re.compile(prepared.family.float32_grads or "(?!)")
        errors = gradient_errors(pipe, prepared)
        outcome.error = max([abs(loss - prepared.loss) / abs(prepared.loss)]
                            + [e for name, e in errors.items() if not pattern.search(name)])
        if prepared.family.float32_grads:
            outcome.float32_error = max(e for name, e in errors.items()
                                        if pattern.search(name))
    except Exception as error:  # noqa: BLE001 - the zoo reports every failure
        outcome.failure = first_line(error)
    finally:
        signal.alarm(0)
    outcome.seconds = time.perf_counter() - start
    return outcome


def gradient_errors(pipe: nn.Module, prepared: Prepared) -> dict[str, float]:
    """Each pipeline parameter's relative gradient error, measured against the larger of
    its own norm and 1e-6 of all gradients' norm (a gradient zero in theory is roundoff in
    practice). A gradient one side has and the other lacks (but for zeros) is an error of
    1, and so is a parameter of the plain model under none of its names in the pipeline
    (as ``"<missing>"``)."""
    grads = prepared.grads
    scale = torch.stack([g.norm() for g in grads.values() if g is not None]).norm()
    names = dict(pipe.named_parameters())
    errors = {"<missing>": float(not set(names) <= set(grads)
                                 or any(not group & set(names) for group in prepared.aliases))}
    for name, param in names.items():
        want, got = grads.get(name), param.grad
        if want is None or got is None:
            stray = got if got is not None else want
            errors[name] = float(stray is not None and bool(stray.abs().sum() > 0))
        else:
            denominator = max(float(want.norm()), 1e-6 * float(scale))
            errors[name] = float((got - want).norm()) / denominator
    return errors


def bf16_run(family: Family, schedule: str) -> Outcome:
    """The family in float32, pipelined at its named split with ``precision="bf16"``,
    against the plain model under ``torch.autocast("cpu", torch.bfloat16)`` over the
    same micro-batches: its largest relative error (loss and gradients), or what failed."""
    case = family.build()
    model = case.model.float()
    inputs, targets = cast(case.inputs, torch.float32), cast(case.targets, torch.float32)
    plain = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = list(zip(split(inputs, CHUNKS), split(targets, CHUNKS)))
        losses = [case.loss(call(plain, x), y) * (len(y) / len(targets)) for x, y in parts]
    loss = torch.stack([part.float() for part in losses]).sum()
    loss.backward()
    grads: dict[str, torch.Tensor | None] = {}
    aliases: dict[int, set[str]] = {}
    for name, param in plain.named_parameters(remove_duplicate=False):
        grads[name] = None if param.grad is None else param.grad.detach()
        aliases.setdefault(id(param), set()).add(name)
    prepared = Prepared(family, model, inputs, targets, case.loss, case.split_at,
                        float(loss.detach()), grads, list(aliases.values()))
    outcome = Outcome("named", schedule)
    try:
        pipe = conveyor.Pipeline(
            copy.deepcopy(model), split_at=case.split_at, sample=split(inputs, CHUNKS)[0],
            devices=["cpu", "cpu"], chunks=CHUNKS, schedule=schedule,
            recompute=SCHEDULES[schedule], loss_fn=case.loss, precision="bf16")
        got = float(pipe.step(inputs, targets))
        outcome.error = max([abs(got - prepared.loss) / abs(prepared.loss),
                             *gradient_errors(pipe, prepared).values()])
    except Exception as error:  # noqa: BLE001 - the zoo reports every failure
        outcome.failure = first_line(error)
    return outcome
