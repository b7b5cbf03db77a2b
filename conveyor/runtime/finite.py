"""The check of a step's gradients (``check_finite=True``, the default): a NaN or an
infinity in any stage's gradients is refused on every rank before ``.grad`` takes it,
so that it never reaches an optimizer.

Its cost is a norm per gradient, all in one call
(:func:`conveyor.engine.loss.all_finite`), one host sync per stage and device, and under
torchrun one small all-reduce, or none where the pipeline is the whole job (the flags
then ride in the loss's: :func:`conveyor.runtime.steps.finish_step`); see ``python
benchmarks/check_finite.py``. The loss's check is one ``float()`` per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from conveyor.distributed.gradients import local_shard
from conveyor.engine.loss import all_finite, by_device
from conveyor.errors import NonFiniteGradientError
from conveyor.runtime.runtime import Runtime

__all__: list[str] = []


def check_gradients(runtime: Runtime, params: Sequence[nn.Parameter], step: int) -> None:
    """Raises on every rank where any stage's gradients of this step hold a NaN or an
    infinity (a collective under torchrun: every rank calls it).

    Raises:
        NonFiniteGradientError: naming the step, the stages and a parameter of each.
    """
    flags, named = gradient_flags(runtime)
    if runtime.topology.distributed:
        runtime.all_reduce(flags, None, "the agreement that a step's gradients are finite",
                           dist.ReduceOp.MAX)
    refuse_non_finite(flags, named, step)


def gradient_flags(runtime: Runtime) -> tuple[torch.Tensor, dict[int, str]]:
    """This rank's findings: per stage of the pipeline, 1 where the stage runs here and
    its gradients hold a NaN or an infinity (else 0), and a parameter of each such stage
    by name (this rank's shard of a sharded gradient). Summed or maxed over every rank, a
    flag that is not 0 is a stage to refuse."""
    flags = torch.zeros(runtime.schedule.num_stages, dtype=torch.float32, device=runtime.device)
    named: dict[int, str] = {}
    for index, stage in runtime.stages.items():
        # A DTensor's (FSDP's, tensor parallelism's) by this rank's shard, where each
        # DTensor op would be a collective; the flags are summed over every rank after.
        grads = [local_shard(p.grad) for p in stage.trainable_parameters()
                 if p.grad is not None]
        if all(all_finite(same) for same in by_device(grads)):
            continue
        flags[index] = 1.0
        named[index] = _first_bad(stage)
    return flags, named


def refuse_non_finite(flags: torch.Tensor, named: dict[int, str], step: int) -> None:
    """Raises if any of the ranks' ``flags`` (:func:`gradient_flags`, added up) is set.

    Raises:
        NonFiniteGradientError: naming the step, the stages and a parameter of each
            that runs on this rank.
    """
    bad = [index for index, flag in enumerate(flags.tolist()) if flag]
    if not bad:
        return
    where = ", ".join(f"stage {s}" + (f" ({named[s]})" if s in named else "") for s in bad)
    raise NonFiniteGradientError(
        f"the gradients of {where} are not finite in step {step} of this pipeline (the "
        "loss of every micro-batch was finite); stopping before they reach the weights: "
        ".grad is as it was before the step (check_finite=False lets them through)")


def _first_bad(stage: object) -> str:
    """The name of a parameter of ``stage`` whose gradient (this rank's shard of it) is
    not finite: read on this rank alone, which another's shard may not share."""
    layers = getattr(stage, "layers", None)
    if isinstance(layers, nn.Module):
        for name, parameter in layers.named_parameters():
            if parameter.grad is not None and not bool(
                    torch.isfinite(local_shard(parameter.grad)).all()):
                return name
    return "a parameter"


def check_output_gradients(grads: Sequence[Sequence[torch.Tensor | None]], step: int) -> None:
    """Raises where the gradient that reaches the pipeline's output (``GPipe``: from the
    caller's loss) of a micro-batch holds a NaN or an infinity, before any backward runs.

    Raises:
        NonFiniteGradientError: naming the micro-batch and the step.
    """
    for m, leaves in enumerate(grads):
        if not all(all_finite(same) for same in by_device([g for g in leaves if g is not None])):
            raise NonFiniteGradientError(
                f"the gradient of the output of micro-batch {m} is not finite in call {step} "
                "of this pipeline (a loss that is NaN or inf?); stopping before it reaches "
                "the weights: .grad is as it was (check_finite=False lets it through)")
