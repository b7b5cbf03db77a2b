"""``conveyor.check``: where a pipeline stops matching the plain model, and why.

::

    report = conveyor.check(model, inputs, targets, loss_fn=criterion, stages=4, chunks=8,
                            schedule="1f1b")
    print(report)        # MATCH, or the first difference: stage, layer, micro-batch, size,
    assert report.ok     # and its likely cause with what to do

The pipelined configuration runs as a K-rank torchrun job would (emulated on CPU
threads, :mod:`conveyor.checking.runs`) beside the plain model on the whole batch,
both on float64 copies of the model and batch (the model passed in is never run or
changed). They are compared in the order a step runs: each layer's output per
micro-batch (each traced stage's, for a model cut with ``split_at``: there the model's
output), each recomputation against its own forward, the loss, every parameter's
gradient and every buffer. The first difference beyond ``rtol`` gets a likely cause
(:mod:`conveyor.checking.causes`) from what the check can see: probes of each layer
(:mod:`conveyor.checking.probe`), inputs changed in place, weights shared out of sight.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.engine.microbatch import batch_size, split
from conveyor.engine.recompute.replay import recompute_mode
from conveyor.errors import BalanceError, ConfigError, MicroBatchError, ScheduleError
from conveyor.graph.source import LayerBuilder
from conveyor.checking.floor import noise_floor
from conveyor.checking.plain import float64, forward_whole, plain_model, run_plain
from conveyor.checking import spread
from conveyor.checking.runs import build_pipeline, traced
from conveyor.checking.compare import Comparison
from conveyor.checking.report import CheckReport
from conveyor.schedules import Schedule

__all__ = ["CheckReport", "check"]


def check(
    model: nn.Module | LayerBuilder,
    inputs: Any,
    targets: Any,
    *,
    loss_fn: Callable[[Any, Any], Any],
    chunks: int,
    stages: int | None = None,
    balance: Sequence[int] | str | None = None,
    split_at: Sequence[str] | None = None,
    sample: Any = None,
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    recompute: str | Sequence[str] | None = None,
    checkpoint: str | Sequence[str] | None = None,
    layers: int | None = None,
    tie_weights: Sequence[Sequence[str]] = (),
    deferred_batch_norm: bool = False,
    seed: int = 0,
    rtol: float = 1e-7,
    atol: float = 1e-12,
    tensor_parallel: int = 1,
    tp_plan: str | Mapping[str, Any] | None = None,
) -> CheckReport:
    """Runs one step of the pipelined configuration and of the plain model on the same
    batch, and reports the first place where they differ, with its likely cause.

    Takes the options of :class:`conveyor.Pipeline` (the stages run on CPU threads, as
    the ranks of a torchrun job would run). Torch's random state is left as it was.

    Args:
        model: the model, taken as ``Pipeline`` takes it: an ``nn.Sequential`` (cut by
            ``balance``), any other module (cut at ``split_at``, or among its blocks
            for ``stages=K``, traced on ``sample``: default, the first micro-batch), or
            a function that builds layer i (with ``layers``).
        inputs: one batch, as ``Pipeline.step`` takes it.
        targets: its targets, as ``Pipeline.step`` takes them.
        loss_fn: as for ``Pipeline``: a mean over the micro-batch's samples, or
            ``(loss_sum, count)``.
        seed: seeds the step's random streams (dropout) in both runs.
        rtol: a value differs when ``|pipeline - plain| > atol + rtol * max|plain|``;
            where the plain model differs from itself by more (a model that computes in
            float32 inside, :mod:`conveyor.checking.floor`), 10x that noise floor.
        atol: see ``rtol``.
        tensor_parallel: T tensor ranks per stage, its modules split by ``tp_plan`` (as
            for ``Pipeline``). The check then runs as the job does, under torchrun with
            stages x T processes, every rank calling ``check`` alike; rank 0 runs the
            plain model and compares, and every rank returns its report.
        tp_plan: with ``tensor_parallel``: "auto" (a Hugging Face model's own plan) or
            {module-name pattern: style}.

    Returns:
        A :class:`CheckReport`; ``print`` it, or read ``ok`` and ``findings``.

    Raises:
        BalanceError, ModelError, ScheduleError, MicroBatchError, TensorParallelError:
            the options do not fit the model or the batch.
        ConfigError: ``tensor_parallel`` in one plain process (it names the torchrun
            command), or ``tp_plan`` without it.
    """
    count = _stage_count(stages, balance, split_at, virtual_stages)
    mode = recompute_mode(recompute, checkpoint)
    if tensor_parallel > 1:
        spread.refuse_one_process(tensor_parallel, count)
    elif tp_plan is not None:
        raise ConfigError("tp_plan= splits modules over tensor_parallel=T ranks: give "
                          "tensor_parallel (2 or more) beside it")
    # Everything runs on the CPU: its generator is the only one the check reseeds.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        plain = plain_model(model, layers)
        inputs, targets = float64(inputs), float64(targets)
        builder = not isinstance(model, nn.Module)
        cut = traced(plain, builder=builder, balance=balance, split_at=split_at)
        if sample is None and (cut or balance == "time"):
            sample = split(inputs, chunks)[0]
        sample = float64(sample)  # traced as the float64 copy computes
        run = build_pipeline(plain, builder=builder, loss_fn=loss_fn,
                             stages=count, chunks=chunks, balance=balance, split_at=split_at,
                             sample=sample, schedule=schedule, virtual_stages=virtual_stages,
                             recompute=mode, tie_weights=tie_weights,
                             deferred_batch_norm=deferred_batch_norm,
                             tensor_parallel=tensor_parallel, tp_plan=tp_plan)
        run.step(float64(inputs), float64(targets), seed)
        compare = functools.partial(
            _compared, plain=plain, inputs=inputs, targets=targets, loss_fn=loss_fn,
            chunks=chunks, seed=seed, cut=cut, split_at=split_at, builder=builder,
            tie_weights=tie_weights, rtol=rtol, atol=atol)
        if tensor_parallel > 1:
            return spread.on_rank_0(run, compare)
        return compare(spread.Spread(run))


def _compared(whole: spread.Spread, *, plain: nn.Module, inputs: Any, targets: Any,
              loss_fn: Callable[[Any, Any], Any], chunks: int, seed: int, cut: bool,
              split_at: Sequence[str] | None, builder: bool,
              tie_weights: Sequence[Sequence[str]], rtol: float, atol: float) -> CheckReport:
    """The report of ``whole`` (the pipeline's run, every rank's put together) beside
    the plain model's run on the whole batch."""
    run = whole.run
    if isinstance(run.error, (MicroBatchError, BalanceError, ScheduleError, ConfigError)):
        raise run.error
    pipe = run.pipe
    if cut:  # as given, or chosen among the model's blocks
        split_at = pipe.split_at
    before, again = copy.deepcopy(plain), float64(inputs)  # as yet unchanged
    indices = [layer.index for layer in run.layers]
    reference = run_plain(plain, indices, inputs, targets, loss_fn=loss_fn,
                          chunks=chunks, seed=seed, split_at=split_at)
    whole.join(reference)
    floor = noise_floor(before, reference, indices, again, targets, loss_fn=loss_fn,
                        chunks=chunks, seed=seed, split_at=split_at,
                        call=lambda m: forward_whole(m, float64(again), cut))
    comparison = Comparison(run, reference, plain, targets, loss_fn=loss_fn,
                            chunks=chunks, rows=batch_size(inputs),
                            rtol=floor.rtol(rtol), atol=atol,
                            traced=cut, declared=[tuple(g) for g in tie_weights],
                            builder=builder)
    findings = comparison.findings()
    table = pipe.schedule
    where = (f"split at {list(split_at)}" if split_at is not None else f"balance {pipe.balance}")
    ranks = len(set(table.stage_ranks))
    shape = (f"{ranks} ranks ({table.num_stages} stages)" if table.num_stages > ranks
             else f"{ranks} stages")
    tensor = pipe.topology.tensor_size
    if tensor > 1:
        shape += f" x {tensor} tensor ranks"
    how = ("one process per rank (torchrun)" if tensor > 1 else "one CPU thread per rank")
    setup = (f"{shape}, {where}, {table.name}, {chunks} micro-batches, "
             f"recompute {pipe.recompute!r}; {how}")
    return CheckReport(setup, comparison.compared(), findings, floor.rtol(rtol), floor)


def _stage_count(stages: int | None, balance: Sequence[int] | str | None,
                 split_at: Sequence[str] | None, virtual_stages: int) -> int:
    if stages is not None:
        return stages
    if split_at is not None:
        return max(1, (len(split_at) + 1) // virtual_stages)
    if balance is not None and not isinstance(balance, str):
        return max(1, len(balance) // virtual_stages)
    raise BalanceError("give stages= (the number of pipeline ranks to emulate), a balance "
                       "list or split_at=")
