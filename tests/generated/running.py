"""The run of a generated case (:mod:`tests.generated.cases`) against the plain model
in float64: :func:`run_case` returns the worst error over the loss, every parameter's
gradient and every buffer, measured against the gradients' overall scale (a parameter
whose true gradient is exactly zero, as an attention key bias has, counts no more than
roundoff), or the exception the pipeline raised.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import conveyor
from conveyor.engine.backward import accumulation
from conveyor.engine.microbatch import split
from conveyor.engine.recompute.rng import draw_step_seed
from conveyor.graph.binding import COPY_MARK, restore_ties
from conveyor.checking.plain import traced_per_microbatch
from conveyor.schedules.table import Schedule
from tests.generated.cases import VARIANTS, Case, Result, draw_cases, mixed_table
from tests.generated.models import (
    CLASSES,
    ORDERED,
    Block,
    Generated,
    loss_fn,
    sequential_model,
    share_state,
)
from tests.support.models import seeded_per_layer

__all__ = ["run_case", "quiet", "run_cases", "run_seed"]


@contextlib.contextmanager
def fusing(case: Case) -> Iterator[None]:
    """The case's small linear layers fuse their weight gradients while the body runs,
    where it says so."""
    before = accumulation.FUSED_MIN_ELEMENTS
    accumulation.FUSED_MIN_ELEMENTS = 0 if case.fused else before
    try:
        yield
    finally:
        accumulation.FUSED_MIN_ELEMENTS = before


def build_model(case: Case) -> nn.Module:
    """The case's model in float64, seeded by the spec."""
    torch.manual_seed(case.spec.weights_seed)
    model = sequential_model(case.spec) if case.cut == "sequential" else Generated(case.spec)
    model = model.double()
    share_state(model)  # (after double(), which copies each buffer)
    return model


def set_mode(model: nn.Module, case: Case) -> None:
    """Train or eval mode, as the case says."""
    model.train(case.train)
    if case.train and case.chunks > 1:
        # Batch statistics of a micro-batch are not those of the batch: a model trained
        # in micro-batches keeps its batch norms frozen (as fine-tuning often does).
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.eval()


def batch_of(case: Case) -> tuple[Any, torch.Tensor]:
    """Inputs (a dict when the model takes a keyword argument) and class targets."""
    g = torch.Generator().manual_seed(case.seed * VARIANTS + case.variant)
    spec = case.spec
    if spec.vocab:
        x = torch.randint(0, spec.vocab, (case.batch, spec.length), generator=g)
    else:
        x = torch.randn(case.batch, spec.length, 3, generator=g, dtype=torch.float64)
    targets = torch.randint(0, spec.vocab if spec.tie_head else CLASSES, (case.batch,),
                            generator=g)
    inputs = {"x": x, "scale": 0.5} if spec.scale else x
    return inputs, targets


def make_pipeline(case: Case, model: nn.Module, inputs: Any,
                  device: str = "cpu") -> conveyor.Pipeline:
    schedule: str | Schedule = case.schedule
    if case.schedule == "mixed":
        schedule = mixed_table(case.ranks, case.chunks, case.mixed_seed)
    options: dict[str, Any] = {}
    if case.cut == "sequential":
        edges = (0, *case.boundaries, len(model))
        options["balance"] = [b - a for a, b in zip(edges, edges[1:])]
    else:
        # Two rows, whatever the batch: the variants of a seed share the trace.
        options["sample"] = pytree.tree_map_only(torch.Tensor, lambda t: t[:2], inputs)
        if case.cut == "split_at":
            options["split_at"] = [f"blocks.{i}" for i in case.boundaries]
        else:
            options["stages"] = case.ranks  # the pipeline's ranks: V stages on each
    if case.schedule == "interleaved-1f1b":
        options["virtual_stages"] = case.virtual
    if not torch.distributed.is_initialized():  # else a rank of a process group
        options["devices"] = [device] * case.ranks
    return conveyor.Pipeline(model, loss_fn=loss_fn, chunks=case.chunks, schedule=schedule,
                             recompute=case.recompute, timeout=60, compile=case.compiled,
                             offload="activations" if case.offload else None, **options)


def expected_refusal(case: Case) -> str | None:
    """What the pipeline must say to refuse the case's hazard (see HAZARDS), or None
    where it must be exact."""
    blocks, traced = case.spec.blocks, case.cut != "sequential"
    if "noise" in blocks and traced:  # torch.export cannot trace it
        return r"is a torch\.Generator that the model holds"
    if "log" in blocks and traced:  # torch.export drops the change
        return r"a container changed in place"
    if "log" in blocks and (case.recompute == "always"
                            or case.recompute == "except_last" and case.chunks > 1):
        return r"seen \(list, Block\) in place, and the stage recomputes"
    if "clamp" in blocks:
        return r"changed the parameter \S+ in place"
    if "write" in blocks and "read" in blocks and not traced:  # (traced: carried)
        layers = [blocks.index("write") + 1, blocks.index("read") + 1]
        stages = {sum(b <= layer for b in case.boundaries) for layer in layers}
        return r"changed one tensor object held as" if len(stages) > 1 else None
    return None


def _per_microbatch(model: nn.Module) -> bool:
    """Whether the plain model must run micro-batch by micro-batch to be what the
    pipeline promises: it draws random numbers, or its blocks change their buffers."""
    return any(isinstance(m, Block) and m.kind in ORDERED for m in model.modules()) or (
        model.training and any(
            (isinstance(m, nn.Dropout) and m.p > 0)
            or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
            for m in model.modules()))


def reference_output(case: Case, plain: nn.Module, inputs: Any,
                     split_at: list[str] | None, step_seed: int) -> Any:
    """The plain model's output on the whole batch; a model that draws random numbers
    or changes its state runs micro-batch by micro-batch, in order, with the pipeline's
    streams, as the pipeline promises."""
    if not _per_microbatch(plain):
        return plain(**inputs) if isinstance(inputs, dict) else plain(inputs)
    if split_at is not None:
        return traced_per_microbatch(plain, inputs, case.chunks, step_seed, split_at)
    assert isinstance(plain, nn.Sequential)
    return seeded_per_layer(plain, inputs, case.chunks, step_seed)


def compare(pipe: nn.Module, plain: nn.Module, loss: torch.Tensor,
            expected: torch.Tensor) -> Result:
    """The worst error of the loss, the gradients and the buffers, on the overall scale."""
    worst = Result(abs(loss.item() - expected.item()) / max(abs(expected.item()), 1e-30),
                   "the loss")
    reference = dict(plain.named_parameters(remove_duplicate=False))
    grads = [p.grad for p in plain.parameters() if p.grad is not None]
    scale = max((float(g.abs().max()) for g in grads), default=0.0) or 1.0
    for name, param in pipe.named_parameters():
        want = reference[name.split(COPY_MARK)[0]].grad  # a tie's copy: the parameter's
        got = param.grad
        want = torch.zeros_like(param) if want is None else want
        got = torch.zeros_like(param) if got is None else got
        error = float((got - want).abs().max()) / scale
        if error > worst.error:
            worst = Result(error, f"the gradient of {name}")
    buffers = dict(plain.named_buffers())
    for name, buffer in pipe.state_dict().items():
        if name in buffers and buffer.is_floating_point():
            want = buffers[name]
            error = float((buffer - want).abs().max()) / max(float(want.abs().max()), 1.0)
            if error > worst.error:
                worst = Result(error, f"the buffer {name}")
    return worst


def run_case(case: Case, device: str = "cpu") -> Result:
    """Runs one step of the case's pipeline and of the plain model, both on ``device``
    (every stage there); compares them."""
    return _run_on(case, build_model(case).to(device), device)


def run_cases(cases: Sequence[Case], device: str = "cpu") -> list[Result]:
    """:func:`run_case` of each of a seed's cases, on one model (its trace shared)."""
    model = build_model(cases[0]).to(device)
    return [_run_on(case, model, device) for case in cases]


def _run_on(case: Case, model: nn.Module, device: str) -> Result:
    restore_ties(model)  # as the model was built, if an earlier case's pipeline cut it
    model.zero_grad(set_to_none=True)
    set_mode(model, case)
    plain = copy.deepcopy(model)
    inputs, targets = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device),
                                           batch_of(case))
    try:
        with fusing(case):
            pipe = make_pipeline(case, model, inputs, device)
            torch.manual_seed(case.seed)
            if case.given:
                loss = pipe.step(microbatches=list(zip(split(inputs, case.chunks),
                                                       split(targets, case.chunks))))
            else:
                loss = pipe.step(inputs, targets)
    except Exception as exc:  # noqa: BLE001 - the generator reports any failure
        refusal = expected_refusal(case)
        if refusal and isinstance(exc, conveyor.ModelError) and re.search(refusal, str(exc)):
            return Result(0.0, "refused as expected")
        return Result(float("inf"), "the pipeline", exc)
    if expected_refusal(case):
        return Result(float("inf"), f"the pipeline ran; expected it to refuse with "
                      f"{expected_refusal(case)!r}")
    torch.manual_seed(case.seed)
    step_seed = draw_step_seed()
    expected = loss_fn(reference_output(case, plain, inputs, pipe.split_at, step_seed), targets)
    expected.backward()
    return compare(pipe, plain, loss.detach(), expected.detach())


def run_seed(seed: int, compiled: bool = False) -> list[tuple[Case, Result]]:
    """The cases of ``seed`` and their results, for a worker process: one thread, and
    each exception as its text (not every exception pickles)."""
    quiet()
    torch.set_num_threads(1)
    cases = draw_cases(seed, compiled=compiled)
    results = []
    for case, result in zip(cases, run_cases(cases)):
        if result.exception is not None:
            result = Result(result.error, result.where, RuntimeError(
                f"{type(result.exception).__name__}: {result.exception}"))
        results.append((case, result))
    return results


def quiet() -> None:
    """Keep torch.export's notes about specialised shapes out of a long run's output."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    logging.getLogger("conveyor").setLevel(logging.ERROR)
