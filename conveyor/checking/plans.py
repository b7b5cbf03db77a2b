"""Checking a plan before it is recommended: each of its schedules run once beside the
plain model (:func:`conveyor.check`), until one is exact."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.checking.check import check
from conveyor.checking.plain import float64, plain_model
from conveyor.engine.microbatch import batch_size, gather
from conveyor.errors import ModelError
from conveyor.graph.calls import as_call
from conveyor.observe.plan import Exactness, Plan
from conveyor.torchprivate import pytree

__all__: list[str] = []


def verify_plans(plans: Sequence[Plan | Any], model: nn.Module, sample: Any, *,
                 split_at: Sequence[str], recompute: str | Sequence[str] = "except_last",
                 seed: int = 0, ranks: int | None = None) -> dict[str, Exactness]:
    """Checks the schedules of ``plans`` in their order with :func:`conveyor.check`
    until one is exact (a plan is anything with a ``schedule``: the ranked plans of
    :func:`conveyor.observe.plan.rank_plans`, or :class:`conveyor.planner.PipelinePlan`):
    the verdict of each schedule checked, by name. Each check runs
    one step of ``max(2, K)`` micro-batches, each one ``sample``, cut at ``split_at``,
    under a loss that reads every floating output the model returns (a fixed random
    projection of each, averaged over samples), so a gradient that any output gets
    wrong shows. A plan whose schedule was found inexact is not one to recommend.
    ``ranks``: the pipeline's ranks where each holds two stages of the cut (a V shape).

    Raises:
        ModelError: the model is on the meta device (there is nothing to run), or
            returns no floating tensor with the batch's rows.
    """
    stages = len(split_at) + 1
    chunks = max(2, stages)
    inputs = gather([sample] * chunks)
    targets, loss_fn = _projection(model, inputs, seed)
    found: dict[str, Exactness] = {}
    for candidate in plans:
        if candidate.schedule in found:
            continue
        report = check(model, inputs, targets, loss_fn=loss_fn, split_at=split_at,
                       sample=sample, chunks=chunks, schedule=candidate.schedule,
                       recompute=recompute, seed=seed, stages=ranks)
        if report.ok:
            found[candidate.schedule] = Exactness(
                candidate.schedule, True, f"{chunks} micro-batches of the sample, recompute "
                f"{recompute!r}: {report.compared}")
            break
        first = report.findings[0]
        found[candidate.schedule] = Exactness(candidate.schedule, False,
                                              f"{first}; likely cause: {first.cause}")
    return found


def _projection(model: nn.Module, inputs: Any,
                seed: int) -> tuple[list[torch.Tensor], Callable[[Any, Any], torch.Tensor]]:
    """Targets and a loss for checking: per floating output leaf with the batch's rows,
    a fixed random tensor of its shape, and the sum of the products averaged over rows."""
    rows = batch_size(inputs)
    with torch.no_grad():
        args, kwargs = as_call(float64(inputs))
        output = plain_model(model, None)(*args, **kwargs)
    picked = [i for i, leaf in enumerate(pytree.tree_leaves(output))
              if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim()
              and leaf.shape[0] == rows]
    if not picked:
        raise ModelError(f"{type(model).__name__} returns no floating tensor with the "
                         "batch's rows, whose gradient a check could compare")
    generator = torch.Generator().manual_seed(seed)
    leaves = pytree.tree_leaves(output)
    targets = [torch.randn(leaves[i].shape, generator=generator, dtype=torch.float64)
               for i in picked]

    def loss_fn(out: Any, target: list[torch.Tensor]) -> torch.Tensor:
        got = pytree.tree_leaves(out)
        total = sum((got[i] * t).sum() for i, t in zip(picked, target, strict=True))
        return torch.as_tensor(total) / target[0].shape[0]

    return targets, loss_fn
