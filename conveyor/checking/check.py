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
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.engine.microbatch import batch_size, split
from conveyor.engine.recompute.replay import recompute_mode
from conveyor.errors import BalanceError, ConfigError, MicroBatchError, ScheduleError
from conveyor.graph.source import LayerBuilder
from conveyor.checking.floor import Floor, noise_floor
from conveyor.checking.plain import float64, forward_whole, plain_model, run_plain
from conveyor.checking.runs import build_pipeline, traced
from conveyor.checking.compare import Comparison, Finding
from conveyor.schedules import Schedule

__all__ = ["CheckReport", "check"]


@dataclass
class CheckReport:
    """What :func:`check` found: ``ok`` when everything matched.

    Attributes:
        setup: the pipeline that was checked, in words.
        compared: what was compared, in words.
        findings: the first difference of each kind, in the order a step runs.
        rtol: the relative tolerance the values were compared with: the one asked
            for, or the plain model's own noise floor times its margin where the model
            computes below float64 inside (see :mod:`conveyor.checking.floor`).
        floor: how far the plain model differs from itself, and why.
    """

    setup: str
    compared: str
    findings: list[Finding] = field(default_factory=list)
    rtol: float = 0.0
    floor: Floor = field(default_factory=Floor)

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        lines = [f"conveyor check: {self.setup}", f"compared with the plain model on the "
                 f"whole batch (float64, rtol {self.rtol:g}): {self.compared}"]
        if self.floor.elevated:
            lines.append(_indent("the plain model's own noise floor: " + self.floor.cause()))
        if self.ok:
            return "\n".join([*lines, "MATCH: the pipeline computes what the plain model does"])
        first, *rest = self.findings
        lines += ["DIFFERS", f"first difference: {first}{_more(first)}",
                  _indent("likely cause: " + first.cause)]
        if rest:
            lines.append("then:")
        for finding in rest:
            said = finding.cause == first.cause
            lines += [f"  {finding}{_more(finding)}",
                      _indent("the same cause" if said else finding.cause, 4)]
        return "\n".join(lines)


_COUNTED = {"forward": "layers", "gradient": "gradients", "buffer": "buffers"}


def _more(finding: Finding) -> str:
    counted = _COUNTED.get(finding.kind)
    return f" ({finding.count} {counted} differ)" if counted and finding.count > 1 else ""


def _indent(text: str, by: int = 2) -> str:
    return textwrap.fill(text, 92, initial_indent=" " * by, subsequent_indent=" " * (by + 2))


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

    Returns:
        A :class:`CheckReport`; ``print`` it, or read ``ok`` and ``findings``.

    Raises:
        BalanceError, ModelError, ScheduleError, MicroBatchError: the options do not
            fit the model or the batch.
    """
    count = _stage_count(stages, balance, split_at, virtual_stages)
    mode = recompute_mode(recompute, checkpoint)
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
                             deferred_batch_norm=deferred_batch_norm)
        run.step(float64(inputs), float64(targets), seed)
        if isinstance(run.error, (MicroBatchError, BalanceError, ScheduleError, ConfigError)):
            raise run.error
        pipe = run.pipe
        if cut:  # as given, or chosen among the model's blocks
            split_at = pipe.split_at
        before, again = copy.deepcopy(plain), float64(inputs)  # as yet unchanged
        indices = [layer.index for layer in run.layers]
        reference = run_plain(plain, indices, inputs, targets, loss_fn=loss_fn,
                              chunks=chunks, seed=seed, split_at=split_at)
        floor = noise_floor(before, reference, indices, again, targets, loss_fn=loss_fn,
                            chunks=chunks, seed=seed, split_at=split_at,
                            call=lambda m: forward_whole(m, float64(again), cut))
        comparison = Comparison(run, reference, plain, targets, loss_fn=loss_fn,
                                chunks=chunks, rows=batch_size(inputs),
                                rtol=floor.rtol(rtol), atol=atol,
                                traced=cut, declared=[tuple(g) for g in tie_weights],
                                builder=builder)
        findings = comparison.findings()
    where = (f"split at {list(split_at)}" if split_at is not None else f"balance {pipe.balance}")
    shape = (f"{count} ranks ({pipe.schedule.num_stages} stages)" if virtual_stages > 1
             else f"{count} stages")
    setup = (f"{shape}, {where}, {pipe.schedule.name}, {chunks} micro-batches, "
             f"recompute {mode!r}; one CPU thread per rank")
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
