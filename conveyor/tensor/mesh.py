"""A stage's tensor group, from the mesh built where the ranks are wired, and the
split of a model over it before the cut (what the stage builder calls)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from conveyor.distributed.topology import Topology
from conveyor.errors import TensorParallelError
from conveyor.distributed.sharding import Sharding
from conveyor.tensor import regions
from conveyor.tensor.apply import Group, apply_plan, summed_parameters
from conveyor.tensor.plan import resolve_plan, with_split_head

__all__: list[str] = []


@dataclass
class TensorSplit:
    """A model split over its stage's tensor group: the group and each planned
    module's style (to hook the gradients of those kept whole once the model is cut)."""

    group: Group
    styles: dict[str, str]

    def after_cut(self, owner: nn.Module, sharding: Sharding | None = None) -> None:
        """Sums over the group the gradients of the weights kept whole whose gradient
        each rank sees a part of, among those ``owner`` now holds: as each is computed,
        or with FSDP over the replicas (whose gathered copies autograd fills, not the
        parameters), once ``sharding`` has reduce-scattered them."""
        summed = summed_parameters(owner, self.styles)
        if sharding is None:
            for param in summed:
                regions.grad_sum(param, self.group.name, self.group.seconds)
        else:
            sharding.sum_over(summed, self.group.name, self.group.seconds)


def split_model(module: Any, topology: Topology, tp_plan: str | Mapping[str, Any] | None,
                seconds: float, *, untried: Mapping[str, bool] | None = None,
                split_head: str | None = None) -> TensorSplit | None:
    """Splits ``module`` over ``topology``'s tensor group as ``tp_plan`` says, in place,
    before the cut (None: no tensor parallelism). ``untried`` names the options given
    that tensor parallelism does not take yet (each refused by name); ``split_head``
    names a head to split column-wise whatever the plan says, its logits left split
    (a vocabulary-parallel cross-entropy's).

    Raises:
        TensorParallelError: the model is a layer function, an untried option is given,
            or the plan cannot split it (see :func:`conveyor.tensor.apply.apply_plan`).
    """
    if topology.tensor_size == 1:
        return None
    given = [name for name, on in (untried or {}).items() if on]
    if given:
        raise TensorParallelError(
            f"tensor_parallel={topology.tensor_size} does not take {', '.join(given)} yet; "
            "leave it out, or use tensor_parallel=1")
    if not isinstance(module, nn.Module):
        raise TensorParallelError("tensor_parallel splits a model's modules: give the "
                                  "nn.Module (possibly on the meta device), not a function "
                                  "that builds layers")
    group = Group(topology.tensor_group.group_name, topology.tensor_size,
                  topology.tensor_rank, seconds)
    plan: str | Mapping[str, Any] | None = tp_plan
    if split_head is not None:
        plan = with_split_head(module, resolve_plan(module, tp_plan), split_head)
    return TensorSplit(group, apply_plan(module, plan, group=group))
