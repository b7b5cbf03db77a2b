"""The two runs of :func:`conveyor.check` side by side: each kind of value compared
in the order a step runs, the first difference of each kind kept as a :class:`Finding`
with its likely cause (:mod:`conveyor.checking.causes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.engine.microbatch import microbatch_sizes, split
from conveyor.errors import StageError
from conveyor.checking import causes
from conveyor.checking.plain import Leaves, PlainRun, leaves, whole_loss
from conveyor.checking.runs import Layer, PipelineRun
from conveyor.checking.ties import hidden_ties, undeclared_ties
from conveyor.schedules import Kind

__all__: list[str] = []


@dataclass
class Finding:
    """One difference between the pipeline and the plain model.

    Attributes:
        kind: "error" (the pipeline failed), "forward", "recomputation", "loss",
            "gradient" or "buffer".
        where: the place, in words.
        stage: the stage it happened in (None: the loss, or unknown).
        layer: the layer's name in the model (a submodule's, for a traced model), if known.
        microbatch: the micro-batch, for outputs.
        name: the parameter's or buffer's name, for gradients and buffers.
        max_abs: the largest absolute difference (None: no numbers to compare).
        max_rel: ``max_abs`` relative to the largest value of the plain model's.
        count: how many of its kind differ (layers, gradients, buffers).
        cause: the likely cause and what to do.
    """

    kind: str
    where: str
    stage: int | None = None
    layer: str | None = None
    microbatch: int | None = None
    name: str | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    count: int = 1
    cause: str = ""

    def __str__(self) -> str:
        size = ("" if self.max_abs is None or self.max_rel is None else
                f": max abs diff {self.max_abs:.3g}, relative {self.max_rel:.3g}")
        return f"{self.kind} of {self.where}{size}"


@dataclass
class Gap:
    """How two values differ: the largest differences (None: not numbers, or their
    shapes or structures differ), and where (the leaf's path, or what differs)."""

    max_abs: float | None
    max_rel: float | None
    note: str = ""


def difference(got: Leaves, want: Leaves, rtol: float, atol: float) -> Gap | None:
    """How ``got`` differs from ``want`` beyond tolerance (None: it does not)."""
    if [p for p, _ in got] != [p for p, _ in want]:
        return Gap(None, None, f"structure {[p for p, _ in got]} vs {[p for p, _ in want]}")
    worst: Gap | None = None
    for (path, a), (_, b) in zip(got, want):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return Gap(None, None, f"{path}: {a!r} vs {b!r}")
            continue
        if a.shape != b.shape:
            return Gap(None, None, f"{path}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        if a.numel() == 0:
            continue
        a, b = a.double(), b.double()
        if not torch.equal(a.isnan(), b.isnan()):
            return Gap(float("nan"), float("nan"), f"{path}: NaN in one run only")
        a, b = a.nan_to_num(), b.nan_to_num()
        diff, scale = float((a - b).abs().max()), float(b.abs().max())
        if diff > atol + rtol * scale and (worst is None or diff > (worst.max_abs or 0)):
            worst = Gap(diff, diff / scale if scale else float("inf"), path)
    return worst


class Comparison:
    """The two runs side by side, compared in the order a step runs."""

    def __init__(self, run: PipelineRun, reference: PlainRun, plain: nn.Module, targets: Any,
                 *, loss_fn: Callable[[Any, Any], Any], chunks: int, rows: int, rtol: float,
                 atol: float, traced: bool, declared: list[tuple[str, ...]],
                 builder: bool) -> None:
        self.run, self.reference, self.plain, self.targets = run, reference, plain, targets
        self.loss_fn, self.chunks, self.traced = loss_fn, chunks, traced
        self.sizes = microbatch_sizes(rows, chunks)
        self.rows, self.rtol, self.atol = rows, rtol, atol
        self.declared, self.builder = declared, builder
        self.counts: dict[str, int] = {}
        self.by_name = {layer.name: layer for layer in run.layers}

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        for step in (self._error, self._forward, self._recomputed, self._loss,
                     self._gradients, self._buffers):
            finding = step(found)
            if finding is not None:
                found.append(finding)
        return found

    def compared(self) -> str:
        c = self.counts
        return (f"{c.get('forward', 0)} layer outputs, {c.get('recomputation', 0)} "
                f"recomputations, the loss, {c.get('gradient', 0)} gradients, "
                f"{c.get('buffer', 0)} buffers")

    def _slice(self, whole: Leaves, m: int) -> Leaves:
        start = sum(self.sizes[:m])
        return [(path, leaf[start:start + self.sizes[m]]
                 if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == self.rows
                 else leaf) for path, leaf in whole]

    def _where(self, layer: Layer, m: int | None = None) -> str:
        at = "" if m is None else f", micro-batch {m}"
        if self.traced:
            return f"the model's output (stage {layer.stage}){at}"
        return f"stage {layer.stage}, {layer.describe()}{at}"

    def _layer_cause(self, layer: Layer, *, recomputation: bool) -> tuple[str, str | None]:
        """The likely cause for ``layer``'s output, and the culprit's name."""
        probe = self.reference.probes.get(-1 if self.traced else layer.index)
        mutated = (layer.stage if layer.first and not self.traced
                   and self._changes_input(layer) else None)
        where = "the model" if self.traced else layer.describe()
        culprit = layer.name if not self.traced else None
        if probe is not None and self.traced:
            for fact in ("own_generator", "changed", "batch_norm"):
                culprit = culprit or next(iter(probe.where(fact)), None)
            culprit = probe.unrepeatable or culprit
        if self.run.shared:
            return causes.shared_across_stages(self.run.shared), culprit
        if layer.index in self.run.split_inputs:
            return causes.split_input(where, self.run.split_inputs[layer.index]), culprit
        text = causes.of_layer(where, probe, mutated_stage_input=mutated,
                               recomputation=recomputation)
        return text, culprit

    def _changes_input(self, layer: Layer) -> bool:
        """Whether ``layer`` changed its input in place, in the pipeline or its probe."""
        probe = self.reference.probes.get(layer.index)
        return layer.index in self.run.mutated or (
            probe is not None and layer.name in probe.modules
            and probe.modules[layer.name].mutated_input)

    def _error(self, found: list[Finding]) -> Finding | None:
        error = self.run.error
        if error is None:
            return None
        stage = getattr(error, "stage", None)
        index = getattr(error, "layer", None) if isinstance(error, StageError) else None
        layer = next((x for x in self.run.layers if x.index == index), None)
        if layer is None:  # failed in backward: a stage input changed in place?
            layer = next((x for x in self.run.layers if x.first and self._changes_input(x)),
                         None)
        cause = "the error says where the pipeline failed; the plain model ran this batch"
        if layer is not None:
            cause, _ = self._layer_cause(layer, recomputation=False)
        return Finding("error", f"the pipeline's step: {type(error).__name__}: {error}",
                       stage=stage, layer=layer.name if layer else None, cause=cause)

    def _forward(self, found: list[Finding]) -> Finding | None:
        first: Finding | None = None
        differing = 0
        for layer in self.run.layers:
            whole = self.reference.outputs.get(layer.index)
            if whole is None:
                continue
            per = self.reference.probes.get(layer.index)
            if (per is not None and layer.index in self.reference.per_microbatch
                    and per.where("batch_norm") and self.chunks > 1 and first is None):
                first = Finding("forward", self._where(layer) + ", which the check can only "
                                "compare micro-batch by micro-batch", stage=layer.stage,
                                layer=layer.name, cause=causes.random_with_batch_norm(
                                    layer.describe(), per.where("batch_norm")))
            gaps = []
            for m in range(self.chunks):
                got = self.run.forward.get((layer.index, m))
                if got is None:
                    continue
                self.counts["forward"] = self.counts.get("forward", 0) + 1
                gap = difference(got, self._slice(whole, m), self.rtol, self.atol)
                if gap is not None:
                    gaps.append((m, gap))
            if not gaps:
                continue
            differing += 1
            if first is None:
                m, gap = gaps[0]
                cause, culprit = self._layer_cause(layer, recomputation=False)
                first = Finding("forward", self._where(layer, m) + _note(gap),
                                stage=layer.stage, layer=culprit, microbatch=m,
                                max_abs=gap.max_abs, max_rel=gap.max_rel, cause=cause)
        if first is not None:
            first.count = max(differing, 1)
        return first

    def _recomputed(self, found: list[Finding]) -> Finding | None:
        order = {layer.index: n for n, layer in enumerate(self.run.layers)}
        keys = sorted(self.run.recomputed, key=lambda k: (order[k[0]], k[1]))
        self.counts["recomputation"] = len(keys)
        for index, m in keys:
            gap = difference(self.run.recomputed[(index, m)],
                             self.run.forward.get((index, m), []), self.rtol, self.atol)
            if gap is None:
                continue
            layer = self.run.layers[order[index]]
            cause, culprit = self._layer_cause(layer, recomputation=True)
            where = f"stage {layer.stage}, {layer.describe()}, micro-batch {m}, against its " \
                    f"first forward"
            return Finding("recomputation", where + _note(gap), stage=layer.stage,
                           layer=culprit, microbatch=m, max_abs=gap.max_abs,
                           max_rel=gap.max_rel, cause=cause)
        return None

    def _loss(self, found: list[Finding]) -> Finding | None:
        if self.run.loss is None or self.reference.loss is None:
            return None
        got, want = self.run.loss.detach(), self.reference.loss.detach()
        gap = difference([("", got)], [("", want)], self.rtol, self.atol)
        if gap is None:
            return None
        if found:
            cause = causes.follows(found[0].kind)
        else:
            weighted = self._weighted_loss()
            if difference([("", got)], [("", torch.tensor(weighted, dtype=got.dtype))],
                          self.rtol, self.atol) is None:
                cause = causes.loss_average(float(want), weighted)
            else:
                cause = ("every layer's output matches, but the loss does not: loss_fn "
                         "reads something besides the output and the targets (state, the "
                         "batch's size)")
        return Finding("loss", f"the step ({float(got):.10g} in the pipeline, "
                       f"{float(want):.10g} in the plain model)", max_abs=gap.max_abs,
                       max_rel=gap.max_rel, cause=cause)

    def _weighted_loss(self) -> float:
        """The plain model's loss as the pipeline forms it: per micro-batch, weighted
        by each micro-batch's share of the samples."""
        outputs = split(self.reference.final, self.chunks)
        targets = split(self.targets, self.chunks)
        with torch.no_grad():
            return sum(float(whole_loss(self.loss_fn, o, t)) * n / self.rows
                       for o, t, n in zip(outputs, targets, self.sizes))

    def _gradients(self, found: list[Finding]) -> Finding | None:
        differing = []
        for name, grad in self.run.gradients.items():
            want = _grad(self.plain.get_parameter(name))
            self.counts["gradient"] = self.counts.get("gradient", 0) + 1
            gap = difference(leaves(grad), leaves(want), self.rtol, self.atol)
            if gap is not None:
                differing.append((name, grad, gap))
        if not differing:
            return None
        name, _, gap = differing[0]
        stage, layer = self._owner(name)
        hidden = hidden_ties(self.run)
        undeclared = undeclared_ties(self.run, self.plain, self.declared) \
            if self.builder else {}
        if name in self.run.disagree:
            cause = causes.tensor_ranks_disagree(name, self.run.disagree[name])
        elif name in hidden:
            cause = hidden[name]
        elif name in undeclared:
            cause = causes.undeclared_tie(undeclared[name])
        elif found:
            cause = causes.follows(found[0].kind)
        else:
            cause = self._counted_twice([(n, p) for n, p, _ in differing]) or (
                f"the forward of every layer matches but the gradient of {name!r} "
                "does not: a custom backward that reads state, or a weight that "
                "two stages use without a tie (name both uses in tie_weights=)")
        owner = self.by_name.get(layer) if not self.traced else None
        at = f"stage {stage}, {owner.describe()}" if owner else f"stage {stage}"
        return Finding("gradient", f"{name!r} ({at})", stage=stage, layer=layer, name=name,
                       max_abs=gap.max_abs, max_rel=gap.max_rel, count=len(differing),
                       cause=cause)

    def _counted_twice(self, differing: list[tuple[str, torch.Tensor]]) -> str | None:
        """The cause when a value the model returns from an earlier stage had its
        gradient counted twice (or lost) by a split backward with recomputation: the
        schedule splits backward, stages recompute, and every differing gradient is of a
        parameter upstream of such a value, up to 2x (or 0x) the plain model's."""
        pipe = self.run.pipe
        if not self.traced or pipe.recompute == "never" or \
                not any(a.kind is Kind.INPUT for a in pipe.schedule.actions):
            return None
        early = causes.returned_early(self.run.programs)
        if not early:
            return None
        upstream = max(stage for _, stage in early)
        got, want = [], []
        for name, grad in differing:
            stage, _ = self._owner(name)
            if stage is None or stage > upstream:
                return None
            got.append(grad.flatten())
            want.append(_grad(self.plain.get_parameter(name)).flatten())
        g, w = torch.cat(got).double(), torch.cat(want).double()
        if not w.any():
            return None
        ratio = float(g @ w / (w @ w))
        # 2x where the loss reads only what is made from the value and every backward
        # of the last stage is split and recomputed; between 1x and 2x where the loss
        # reads the value too (only the part through the last stage doubles) or some
        # micro-batches keep their graph. 0x: the gradient is lost.
        return causes.counted_twice(early, ratio) if (
            1.0 + 1e-6 < ratio <= 2.0 + 1e-6 or abs(ratio) <= 0.1) else None

    def _buffers(self, found: list[Finding]) -> Finding | None:
        first: Finding | None = None
        differing = 0
        for name, buffer in self.run.buffers.items():
            try:
                want = self.plain.get_buffer(name)
            except AttributeError:
                continue
            self.counts["buffer"] = self.counts.get("buffer", 0) + 1
            gap = difference(leaves(buffer), leaves(want), self.rtol, self.atol)
            if gap is None:
                continue
            differing += 1
            if first is None:
                owner = name.rpartition(".")[0]
                stage, layer = self._owner(name)
                module = self.plain.get_submodule(owner)
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    cause = ("batch norm updates its running statistics once per micro-batch, "
                             "from that micro-batch; pass deferred_batch_norm=True to update "
                             "them once per step from the whole batch's statistics")
                elif self.run.shared:
                    cause = causes.shared_across_stages(self.run.shared)
                else:
                    cause = causes.follows(found[0].kind) if found else \
                        "the forward updates this buffer on every call (once per micro-batch)"
                first = Finding("buffer", f"{name!r} after the step", stage=stage,
                                layer=layer, name=name, max_abs=gap.max_abs,
                                max_rel=gap.max_rel, cause=cause)
        if first is not None:
            first.count = differing
        return first

    def _owner(self, name: str) -> tuple[int | None, str]:
        """The stage and layer (a submodule, for a traced model) a parameter or buffer
        belongs to."""
        if not self.traced:
            layer = self.by_name.get(name.split(".", 1)[0])
            return (layer.stage if layer else None), name.split(".", 1)[0]
        return self.run.owners.get(name), name.rpartition(".")[0]


def _note(gap: Gap) -> str:
    if not gap.note:
        return ""
    return f" at output{gap.note}" if gap.note.startswith("[") else f" ({gap.note})"


def _grad(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, zeros where it has none."""
    return param.grad.detach() if param.grad is not None else torch.zeros_like(param)
