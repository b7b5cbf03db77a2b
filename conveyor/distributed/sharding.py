"""Sharding the data-parallel replicas of each stage with torch's FSDP2 (``fully_shard``).

With ``Pipeline(..., data_parallel=D, sharding="fsdp")`` the D replicas of a stage
hold 1/D of its parameters, gradients and optimizer state each, as DTensors sharded
along dim 0 over the "data" dimension of the (pipeline, data) DeviceMesh. Each layer
of a stage is one FSDP unit (all-gathered in one collective), and the stage's
``Partition`` is the root that takes whatever the layers leave (a weight that two
layers of the stage share). In a step::

    forward m=0   all-gather each layer (once per step, or per forward: see below)
    F / B ...     backward accumulates *unsharded* gradients, no communication
    last B        (every micro-batch done) reduce-scatter each layer's gradient once,
                  sum tied weights' shards, divide by the step's divisor, reshard

The reduce-scatter thus runs once per step, not once per micro-batch: FSDP's gradient
sync is off during the schedule and the post-backward of every unit is run by hand
after the last backward, as torch.distributed.pipelining's ``perform_reduce_grad``
does (FSDP2 offers no public call for it). FSDP sums (``set_gradient_divide_factor(1)``
with sum-only reductions, which gloo supports); :meth:`Sharding.reduce` divides by
what the replicated pipeline divides by (the replicas, or a ``(loss_sum, count)``
loss's count over the whole batch), so both give the plain model's gradients.

Reshard after forward, per schedule (:data:`RESHARD_AFTER_FORWARD`): GPipe runs every
forward before any backward and peaks at the turn, holding every micro-batch's
activations; freeing each layer's gathered parameters after its forward keeps at most
one layer gathered during the fill, for M all-gathers per layer in forward instead of
one. 1F1B and interleaved 1F1B alternate forwards and backwards, so resharding would
all-gather every layer twice per micro-batch; they keep the parameters gathered from
the first forward to the end of the step. No schedule reshards after a backward within
the step (the next backward needs the same parameters).

Tied weights are sharded like any other: both copies of a weight have one shape and
the same placement over a data dimension of the same size, so replica d's shards of
the two copies hold the same rows, and the tie's sum runs over the local shards.

Split backwards (``I``/``W``: zero-bubble and the V shapes) run as the others do: none
of them reshards after forward, so a ``W`` computes its weight gradients into the
unsharded parameters forward used, where FSDP accumulates them, and the reduce-scatter
runs by hand after the last backward, as for every schedule.

A traced stage (``split_at=``) calls no modules: its graph reads the model's parameters
from their modules as it runs. So each module it reads is a unit of its own and a root,
gathered by hand (``unshard``) before the graph's first call of a step, from a forward
pre-hook on the stage; it stays gathered until the post-backward by hand reshards it.

Limits: a traced stage whose modules share or tie a weight (a tied embedding and head)
is refused. Under FSDP every all-gather is a collective of a stage's replicas, so one
replica that fails in the middle of a forward leaves the others waiting in an
all-gather until the process group's timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.distributed.faults import collective
from conveyor.distributed.gradients import local_shard
from conveyor.distributed.topology import Topology
from conveyor.engine.stage import Stage
from conveyor.engine.ties import TiedParameter
from conveyor.errors import ConveyorError, ModelError, ScheduleError
from conveyor.graph.tracedstage import GraphStage
from conveyor.schedules import Kind, Schedule
from conveyor.torchprivate import (
    fsdp_drop_unsharded_grads,
    fsdp_lazy_init,
    fsdp_post_backward,
    process_group_named,
)

__all__: list[str] = []

_log = logging.getLogger("conveyor")

SHARDINGS = ("replicate", "fsdp")

#: Whether a stage's FSDP units free their gathered parameters after each forward, by
#: schedule name (tables of other names: False, as 1F1B).
RESHARD_AFTER_FORWARD = {"gpipe": True, "1f1b": False, "interleaved-1f1b": False}


def check_sharding(sharding: str, schedule: Schedule, topology: Topology) -> bool:
    """Whether ``sharding`` asks for FSDP, after checking that it can run here.

    Raises:
        ConveyorError: an unknown ``sharding``, or FSDP in one process.
        ScheduleError: FSDP with a schedule that splits backwards (I and W) and
            reshards after forward (a W would find its parameters freed).
    """
    if sharding not in SHARDINGS:
        raise ConveyorError(f"sharding={sharding!r} is not a way to hold the replicas; use "
                            "'replicate' (a whole copy each) or 'fsdp' (a shard each)")
    if sharding == "replicate":
        return False
    split = sorted({str(a) for column in schedule.columns for a in column
                    if a.kind in (Kind.INPUT, Kind.WEIGHT)})
    if split and RESHARD_AFTER_FORWARD.get(schedule.name, False):
        raise ScheduleError(
            f"sharding='fsdp' cannot run schedule {schedule.name!r}: its split backwards "
            f"({', '.join(split[:4])}{', ...' if len(split) > 4 else ''}) need the "
            "parameters gathered until their W, but it reshards them after each forward")
    if not topology.distributed:
        raise ConveyorError("sharding='fsdp' shards each stage over its data-parallel "
                            "processes; launch with torchrun (world = stages x "
                            "data_parallel) or use sharding='replicate'")
    return True


class Sharding:
    """FSDP2 over the data dimension for this process's stages.

    Args:
        stages: this process's stages (each a sequence of layers).
        topology: where the process sits; its mesh's "data" dimension shards.
        schedule: the pipeline's table (its name picks reshard-after-forward).
        ties: the pipeline's tied weights (their shards are summed over each tie).

    Raises:
        ModelError: a traced stage whose modules share or tie a weight.
    """

    def __init__(self, stages: Mapping[int, Stage], topology: Topology, schedule: Schedule,
                 ties: Sequence[TiedParameter]) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.topology = topology
        self.ties = list(ties)
        #: weights kept whole by a tensor plan whose gradient is summed over the tensor
        #: group, each as (its parameters, the group's name, the seconds it may wait)
        self._group_sums: list[tuple[list[nn.Parameter], str, float]] = []
        self.reshard_after_forward = RESHARD_AFTER_FORWARD.get(schedule.name, False)
        mesh = topology.mesh["data"]
        self.roots: list[Any] = []
        before = {index: dict(stage.layers.named_parameters())
                  for index, stage in stages.items()}
        for index, stage in sorted(stages.items()):
            graphs = [layer for layer in stage.layers if isinstance(layer, GraphStage)]
            if graphs:
                self.roots += _shard_traced(index, graphs, mesh, ties)
                continue
            units = _units(stage.layers)
            for layer in units:
                fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
            self.roots.append(fully_shard(stage.layers, mesh=mesh,
                                          reshard_after_forward=self.reshard_after_forward))
            _log.debug("stage %d: %d FSDP units over %d replicas, reshard after forward: %s",
                       index, len(units), topology.data_size, self.reshard_after_forward)
        _follow_ties(self.ties, before, {index: dict(stage.layers.named_parameters())
                                         for index, stage in stages.items()})
        for root in self.roots:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)  # sum; reduce() divides
                    module.set_force_sum_reduction_for_comms(True)
        self._defer()

    def _defer(self) -> None:
        """Backwards of the step accumulate unsharded gradients, without communication."""
        for root in self.roots:
            root.set_requires_gradient_sync(False)
            root.set_reshard_after_backward(False)
            root.set_is_last_backward(False)

    def _post_backward(self, *, reduce: bool) -> None:
        """Runs every unit's post-backward by hand (reduce-scatter if ``reduce``) and the
        root's end-of-backward, which resets FSDP's per-step state and reshards."""
        for root in self.roots:
            root.set_requires_gradient_sync(reduce)
            root.set_reshard_after_backward(True)
            root.set_is_last_backward(True)
            fsdp_post_backward(root)
        self._defer()

    def sum_over(self, params: Sequence[nn.Parameter], group: str, seconds: float) -> None:
        """After each reduce-scatter, sums the gradient shards of ``params`` (FSDP's, by
        the names they had before sharding) over the process group named ``group``."""
        self._group_sums.append((list(params), group, seconds))

    def reduce(self, divisor: float, tie_reduce: Callable[[torch.Tensor, Any], None]) -> None:
        """After the step's last backward: reduce-scatters each unit's gradient (summed
        over the replicas), sums the gradient shards :meth:`sum_over` names over their
        group, sums the shards of tied weights over each tie (with
        ``tie_reduce(total, group)``), and divides every gradient by ``divisor``. A
        collective of every rank."""
        self._post_backward(reduce=True)
        for params, group, seconds in self._group_sums:
            for param in params:
                if param.grad is not None:
                    collective.all_reduce(
                        local_shard(param.grad), group=process_group_named(group),
                        seconds=seconds, what="the tensor group's sum of a replicated "
                                              "weight's gradient shard")
        for tie in self.ties:
            _sum_tie_shards(tie, tie_reduce)
        for root in self.roots:
            for p in root.parameters():
                if p.grad is not None and divisor != 1:
                    p.grad.div_(divisor)

    def discard(self) -> None:
        """After a step that failed: drops the unsharded gradients it accumulated and
        reshards, so that the next step starts as if this one never ran."""
        self._post_backward(reduce=False)
        for root in self.roots:
            fsdp_drop_unsharded_grads(root)

    def reshard(self) -> None:
        """Frees the gathered parameters (after a forward without backward)."""
        from torch.distributed.fsdp import FSDPModule

        for root in self.roots:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def _shard_traced(index: int, graphs: Sequence[GraphStage], mesh: Any,
                  ties: Sequence[TiedParameter]) -> list[Any]:
    """FSDP units of a traced stage, which calls no modules: each module whose
    parameters its graph reads (the model's, under their own names) is a unit of its own
    and a root, gathered by hand before the graph's first call of a step (kept gathered
    to the step's end; the post-backward, by hand, reshards it).

    Raises:
        ModelError: the stage's modules share a weight or hold a tied one, or one such
            module holds another.
    """
    from torch.distributed.fsdp import fully_shard

    units = [m for graph in graphs for m in graph.bound_modules()
             if any(True for _ in m.parameters(recurse=False))]
    tied = {id(p) for tie in ties for p in tie.copies}
    seen: dict[int, nn.Module] = {}
    for unit in units:
        for p in unit.parameters():
            if id(p) in tied or seen.setdefault(id(p), unit) is not unit:
                raise ModelError(
                    f"sharding='fsdp' shards each module traced stage {index} reads, but a "
                    f"weight of its {type(unit).__name__} is tied or shared with another "
                    "module (a tied embedding and head): untie it (tie_word_embeddings="
                    "False), or use sharding='replicate'")
    inside = [u for u in units for other in units if other is not u and u in other.modules()]
    if inside:
        raise ModelError(
            f"sharding='fsdp' shards each module traced stage {index} reads, but its "
            f"{type(inside[0]).__name__} lies inside another such module; use "
            "sharding='replicate'")
    roots: list[Any] = [fully_shard(unit, mesh=mesh, reshard_after_forward=False)
                        for unit in units]
    for root in roots:
        fsdp_lazy_init(root)

    def gather(*_: Any) -> None:
        for root in roots:
            root.unshard()

    for graph in graphs:
        graph.register_forward_pre_hook(gather)
    _log.debug("stage %d (traced): %d FSDP units", index, len(roots))
    return roots


def _units(partition: nn.Module) -> list[nn.Module]:
    """The layers of a stage that become FSDP units: those with parameters, except
    layers sharing a parameter with another (the root takes those)."""
    owners: dict[int, set[int]] = {}
    for layer in partition.children():
        for p in layer.parameters():
            owners.setdefault(id(p), set()).add(id(layer))
    return [layer for layer in partition.children()
            if any(True for _ in layer.parameters())
            and all(len(owners[id(p)]) == 1 for p in layer.parameters())]


def _follow_ties(ties: Sequence[TiedParameter], before: Mapping[int, Mapping[str, Any]],
                 after: Mapping[int, Mapping[str, nn.Parameter]]) -> None:
    """Points each tie's copies at the sharded parameters that replaced them."""
    replaced = {id(before[s][name]): after[s][name] for s in before for name in before[s]}
    for tie in ties:
        tie.copies[:] = [replaced.get(id(p), p) for p in tie.copies]


def _sum_tie_shards(tie: TiedParameter, reduce: Callable[[torch.Tensor, Any], None]) -> None:
    """Gives every copy of a tied weight the sum of all copies' gradient shards."""
    grads = [p.grad for p in tie.copies if p.grad is not None]
    if not grads:
        return
    total = torch.zeros_like(local_shard(grads[0]))
    for grad in grads:
        total += local_shard(grad)
    if tie.group is not None:
        reduce(total, tie.group)
    for p in tie.copies:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local_shard(p.grad).copy_(total)
