"""A pipeline's training step, top to bottom, and the work after its actions; its
inference pass; and clipping its gradients by their norm over every rank.

::

    split the batch ─ run the table ─ the step's loss ─ reduce gradients ─ commit
      inputs, targets   F, B, I, W       from the last     sharded: reduce-scatter     add to
      into M micro-     on every local   stage, over the   else: tie sums, replica     .grad,
      batches           rank             replicas          averaging; fp16 overflow    or drop

Until the end, the step's gradients stand apart from what ``.grad`` held before
(:class:`~conveyor.engine.backward.accumulation.SetAside`): a step that fails, or whose float16
gradients overflow on any rank, leaves ``.grad`` as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.distributed.faults.peerfailure import as_everywhere
from conveyor.distributed.gradients import clip_grad_norm, local_shard, reduce_across_replicas
from conveyor.distributed.sharding import Sharding
from conveyor.engine.backward.accumulation import SetAside
from conveyor.engine.loss import LossFn, LossScaler, autocast
from conveyor.engine.microbatch import (
    batch_size,
    gather,
    microbatch_count,
    microbatch_sizes,
    split,
)
from conveyor.engine.step import StepState, new_step
from conveyor.engine.ties import sum_tied_gradients
from conveyor.errors import ConveyorError, MicroBatchError
from conveyor.graph.weights import SHARD
from conveyor.runtime.finite import check_gradients, gradient_flags, refuse_non_finite
from conveyor.runtime.runtime import Runtime
from conveyor.runtime.verify import Certificate
from conveyor.schedules import Kind

__all__: list[str] = []

_TIES = "the all-reduce of the tied weights' gradients"


@dataclass
class TrainingStep:
    """How a pipeline trains: what its steps need besides the batch.

    Attributes:
        chunks: micro-batches per batch.
        recompute: the recompute mode.
        check_finite: stop a step whose loss is not finite (on every rank).
        dtype: the autocast dtype of ``precision=`` (None: none).
        scaler: float16's loss scaler (None: no loss scaling).
        sharding: FSDP2's shards of the stages (None: whole copies).
        certificate: ``verify_every=``'s checks of every N-th step (None: off).
    """

    chunks: int
    recompute: str | tuple[str, ...]
    check_finite: bool
    dtype: torch.dtype | None
    scaler: LossScaler | None
    sharding: Sharding | None
    certificate: Certificate | None = None
    steps: int = 0  # the steps begun, for messages


def train_step(runtime: Runtime, how: TrainingStep, inputs: Any, targets: Any, *,
               loss_fn: LossFn | None, params: Sequence[nn.Parameter], training: bool,
               microbatches: Sequence[tuple[Any, Any]] | None = None) -> torch.Tensor:
    """One training step of ``runtime``'s stages on a batch, under ``loss_fn``, or on
    the ``microbatches`` given, each its own ``(inputs, targets)`` of any shape (at most
    the table's M: its first actions run); returns its loss.

    Raises:
        MicroBatchError: the targets' rows differ from the inputs', or more micro-batches
            than the table's M (or, under torchrun, another count than stage 0's).
        StageError, PeerFailure, StepTimeout: the step failed (on every rank).
        NonFiniteLossError: with ``check_finite``, a loss was not finite (every rank).
        ConveyorError: the counts of a ``(loss_sum, count)`` loss add up to 0.
    """
    how.steps += 1
    if microbatches is None:
        state, count = _new_state(runtime, how, inputs, targets, loss_fn, training), None
    else:
        state, count = _given_state(runtime, how, microbatches, loss_fn, training)
    earlier = SetAside(params)  # this step's gradients alone, until they are reduced
    try:
        with autocast(runtime.devices, how.dtype):
            runtime.run([Kind.FORWARD, Kind.BACKWARD, Kind.INPUT, Kind.WEIGHT], state,
                        microbatches=count)
        loss, overflowed = finish_step(runtime, how, state, params)
    except BaseException as exc:
        if how.sharding is not None:
            how.sharding.discard()
        earlier.restore()
        runtime.explain(exc)  # a collective's failure too, not only the run's
        everywhere = as_everywhere(exc)
        if everywhere is not exc:
            raise everywhere from exc
        raise
    if overflowed:  # dropped, on every rank alike
        earlier.restore()
    else:
        earlier.add_back()
    return loss


def _new_state(runtime: Runtime, how: TrainingStep, inputs: Any, targets: Any,
               loss_fn: LossFn | None, training: bool) -> StepState:
    """The state of a step: stage 0's micro-batches, the last stage's targets and each
    micro-batch's share of the batch (where those stages run here)."""
    stages = runtime.stages
    state = new_step(split(inputs, how.chunks) if 0 in stages else [], chunks=how.chunks,
                     recompute=how.recompute, grad_enabled=True, training=training,
                     loss_fn=loss_fn, check_finite=how.check_finite, step=how.steps,
                     grad_scale=how.scaler.scale if how.scaler else 1.0)
    if runtime.schedule.num_stages - 1 in stages:
        batch = batch_size(targets)
        if 0 in stages and batch_size(inputs) != batch:
            raise MicroBatchError(
                f"the targets have {batch} rows but the inputs {batch_size(inputs)}: "
                "dim 0 is the batch in both; give one target per sample")
        state.targets = split(targets, how.chunks)
        state.loss_scale = [n / batch for n in microbatch_sizes(batch, how.chunks)]
    return state


def _given_state(runtime: Runtime, how: TrainingStep, given: Sequence[tuple[Any, Any]],
                 loss_fn: LossFn | None, training: bool) -> tuple[StepState, int]:
    """The state of a step on micro-batches the caller made (packed sequences, or each
    its own length), and their count: each one's share of a scalar loss is its rows'
    share of all their rows, as if they were one batch.

    Raises:
        MicroBatchError: not (inputs, targets) pairs, none, more than the table's M,
            rows that differ within a pair, or another count than stage 0's rank's.
    """
    pairs = list(given)
    if not pairs or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise MicroBatchError("microbatches= takes a non-empty list of (inputs, targets) "
                              "pairs, one per micro-batch")
    if len(pairs) > how.chunks:
        raise MicroBatchError(
            f"{len(pairs)} micro-batches given, but the pipeline's table runs at most "
            f"chunks={how.chunks}; make the pipeline with chunks={len(pairs)} (fewer are "
            "fine: the table's first actions run)")
    count = runtime.from_first_stage(len(pairs))
    if count != len(pairs):
        raise MicroBatchError(f"this rank was given {len(pairs)} micro-batches, stage 0's "
                              f"rank {count}: every rank passes the same micro-batches")
    state = new_step([x for x, _ in pairs] if 0 in runtime.stages else [], chunks=count,
                     recompute=how.recompute, grad_enabled=True, training=training,
                     loss_fn=loss_fn, check_finite=how.check_finite, step=how.steps,
                     grad_scale=how.scaler.scale if how.scaler else 1.0)
    if runtime.schedule.num_stages - 1 in runtime.stages:
        rows = [batch_size(y) for _, y in pairs]
        for m, ((x, _), n) in enumerate(zip(pairs, rows)):
            if 0 in runtime.stages and batch_size(x) != n:
                raise MicroBatchError(f"micro-batch {m}: the targets have {n} rows but the "
                                      f"inputs {batch_size(x)}; give one target per sample")
        state.targets = [y for _, y in pairs]
        state.loss_scale = [n / sum(rows) for n in rows]
    return state, count


def finish_step(runtime: Runtime, how: TrainingStep, state: StepState,
                params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, bool]:
    """The work after a step's actions (collectives: every rank calls it): the step's
    loss, the gradients reduced (sharded: reduce-scattered once, after the last
    backward; else the tied copies summed and the replicas averaged), with loss
    scaling whether they overflowed on any rank, and with ``check_finite`` their check.

    Where the pipeline's ranks are the whole job and nothing but the ties' sum and the
    loss's count changes the gradients after the actions (:func:`final_once_tied`), the
    tied copies are summed first and the check's flags ride in the loss's all-reduce: a
    step of gloo's has one collective fewer.

    Raises:
        NonFiniteGradientError: with ``check_finite``, a stage's gradients are not
            finite (on every rank).
    """
    topology, ties = runtime.topology, runtime.layout.ties

    def tie_sum(total: torch.Tensor, group: Any) -> None:
        runtime.all_reduce(total, group, _TIES)

    riding = how.check_finite and final_once_tied(runtime, how)  # (alike on every rank)
    flags: torch.Tensor | None = None
    named: dict[int, str] = {}
    if riding:  # the flags see the gradients as they stay (but for the count's division)
        sum_tied_gradients(ties, tie_sum)
        flags, named = gradient_flags(runtime)
    loss, divisor = step_loss(state, runtime, flags)
    if how.sharding is not None:
        how.sharding.reduce(divisor, tie_sum)
    else:
        if not riding:
            sum_tied_gradients(ties, tie_sum)
        group, replicas, reduced = topology.data_group, topology.data_size, params
        if topology.replicas is not None:  # a replicated stage: each ran a share
            group, replicas = topology.replica_group, topology.stage_replicas
            tied = {id(p) for tie in ties if tie.group is not None  # summed over every
                    for p in tie.copies}                            # replica already
            for p in params:
                if id(p) in tied and p.grad is not None:
                    p.grad.div_(divisor)
            reduced = [p for p in params if id(p) not in tied]
        reduce_across_replicas(
            reduced, group, replicas, divisor,
            lambda flat, op: runtime.all_reduce(flat, group, "the replicas' gradient sum", op))
    overflowed = how.scaler is not None and overflowed_on_any_rank(how.scaler, params,
                                                                   runtime)
    if flags is not None:
        refuse_non_finite(flags, named, how.steps)
    # (a count below 1 divides the gradients into larger ones, which may overflow)
    if how.check_finite and not overflowed and (flags is None or divisor < 1):
        check_gradients(runtime, params, how.steps)
    return loss, overflowed


def final_once_tied(runtime: Runtime, how: TrainingStep) -> bool:
    """Whether the pipeline's ranks are every rank of the job and nothing but the sum of
    tied copies and the division by the loss's count changes the step's gradients once
    its actions end: no shards, replicas, tensor ranks or loss scale. The same on every
    rank (the job's shape and options alone)."""
    topology = runtime.topology
    return (how.sharding is None and how.scaler is None and topology.data_size == 1
            and topology.replicas is None and topology.tensor_size == 1)


def step_loss(state: StepState, runtime: Runtime, flags: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, float]:
    """The step's loss on every rank, and what its gradients are to be divided by
    once summed over the data-parallel replicas (collectives: every rank calls it).

    The last stage's rank shares ``[sum, count, paired]`` over the pipeline, and the
    replicas add theirs up: float64 whatever the model's dtype, which every rank
    must agree on before the last stage has computed anything, and which keeps a
    float64 model's loss exact. ``flags`` (a rank's own, see
    :func:`~conveyor.runtime.finite.gradient_flags`) ride along, summed over the
    pipeline in place.

    Raises:
        ConveyorError: the counts of a ``(loss_sum, count)`` loss add up to 0.
    """
    totals = torch.zeros(3, dtype=torch.float64, device=runtime.device)
    if runtime.schedule.num_stages - 1 in runtime.stages:
        # (a replicated last stage has its micro-batches' alone; the sum adds them up)
        ran = sorted(state.losses)
        losses = torch.stack([state.losses[m] for m in ran]).to(totals)
        if state.counts:
            counts = torch.stack([state.counts[m] for m in ran]).to(totals)
            totals = torch.stack([losses.sum(), counts.sum(), totals.new_tensor(1.0)])
        else:
            totals[0] = (losses * losses.new_tensor([state.loss_scale[m] for m in ran])).sum()
    if flags is None:
        totals = runtime.from_last_stage(totals)
    else:  # every rank adds its flags; the loss's parts are zeros but the last stage's
        totals = torch.cat([totals, flags.to(totals)])
        runtime.sum_over_pipeline(totals, "the all-reduce of the step's loss from the last "
                                          "stage and of its gradients' finite check")
        flags.copy_(totals[3:])
    replicas = runtime.topology.data_size
    if replicas > 1:
        runtime.all_reduce(totals, runtime.topology.data_group, "the replicas' loss total")
    if not totals[2]:  # scalar losses: the replicas' mean
        return (totals[0] / replicas).detach(), replicas
    count = float(totals[1])
    if count <= 0:
        raise ConveyorError(
            f"loss_fn's counts add up to {count:g} over the whole batch"
            f"{f' and its {replicas} replicas' if replicas > 1 else ''}, so the loss "
            "(loss_sum / count) is undefined; every target is padding?"
        )
    return (totals[0] / count).detach(), count


def overflowed_on_any_rank(scaler: LossScaler, params: Sequence[nn.Parameter],
                           runtime: Runtime) -> bool:
    """Unscales this step's gradients (float16 loss scaling) and updates the scale;
    whether a NaN or inf was found on any stage of any rank (every rank gets the same
    answer, so that all drop the step or none)."""
    topology = runtime.topology

    def agree(flag: torch.Tensor) -> None:
        for group in (topology.pipeline_group, topology.data_group, topology.tensor_group):
            if group is not None:
                runtime.all_reduce(flag, group, "the agreement on overflowing gradients",
                                   dist.ReduceOp.MAX)

    # each rank unscales and checks its shard of a sharded gradient (no collective each)
    found = scaler.unscale([local_shard(p.grad) for p in params if p.grad is not None],
                           agree if topology.distributed else None)
    scaler.record(found)
    return found


def infer(runtime: Runtime, how: TrainingStep, inputs: Any, *, training: bool) -> Any:
    """The pipelined forward of a batch, without gradients or recomputation: the
    gathered output where the last stage runs, None elsewhere. A batch of fewer
    samples than the chunks runs as one micro-batch per sample; under torchrun, stage
    0's rank decides their number and tells the others (every rank calls it)."""
    first = 0 in runtime.stages  # under torchrun, its rank counts for all
    count = runtime.from_first_stage(
        microbatch_count(inputs, how.chunks) if first else how.chunks)
    state = new_step(split(inputs, count) if first else [], chunks=count,
                     recompute=how.recompute, grad_enabled=False, training=training)
    with torch.no_grad(), autocast(runtime.devices, how.dtype):
        runtime.run([Kind.FORWARD], state, microbatches=count)
    if how.sharding is not None:
        how.sharding.reshard()
    if runtime.schedule.num_stages - 1 not in runtime.stages or not state.outputs:
        return None  # (a replica of the last stage other than the first: None too)
    return gather([state.outputs[m] for m in range(count)])


def clip_gradients(runtime: Runtime, params: Sequence[nn.Parameter], max_norm: float,
                   norm_type: float, *, sharded: bool) -> torch.Tensor:
    """Clips ``params``' gradients by their norm over every stage and rank (a tied
    weight counted once; sharded, each stage's norm first summed over its shards; with
    tensor parallelism, over its tensor group, a weight kept whole counted once);
    returns the norm before clipping."""
    duplicates = {id(d) for tie in runtime.layout.ties for d in tie.duplicates()}
    topology = runtime.topology
    groups = [topology.data_group] if sharded else []
    groups.append(topology.pipeline_group)
    tensors = topology.tensor_size
    if tensors > 1:  # a shard's norm is part of its weight's, a whole weight's is T copies
        groups.append(topology.tensor_group)

    def reduce(norm: torch.Tensor, op: Any) -> None:
        for group in groups:
            runtime.all_reduce(norm, group, "the all-reduce of the gradients' norm", op,
                               seconds=runtime.deadlines.opening)

    share = 1 / topology.stage_replicas  # a replicated stage's gradients: counted once
    return clip_grad_norm(params, [p for p in params if id(p) not in duplicates], max_norm,
                          norm_type, topology.pipeline_group, reduce, share,
                          parts=lambda p: 1 if hasattr(p, SHARD) else tensors)
