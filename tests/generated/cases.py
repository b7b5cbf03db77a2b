"""A case: a generated model, a way to cut it, a schedule and its options; and its run
against the plain model in float64.

A case is drawn from a seed alone, so ``python -m tests.generated --seed N`` rebuilds it
anywhere. :func:`run_case` returns the worst error over the loss, every parameter's
gradient and every buffer, measured against the gradients' overall scale (a parameter
whose true gradient is exactly zero, as an attention key bias has, counts no more than
roundoff), or the exception the pipeline raised.
"""

from __future__ import annotations

import copy
import logging
import random
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import conveyor
from conveyor.engine.microbatch import split
from conveyor.engine.recompute.rng import draw_step_seed
from conveyor.graph.binding import COPY_MARK, restore_ties
from conveyor.checking.plain import traced_per_microbatch
from conveyor.schedules.builders import SCHEDULES, V_SHAPES, build
from conveyor.schedules.table import Action, Kind, Schedule
from tests.generated.models import (
    CLASSES,
    CONTEXT_FREE,
    HAZARDS,
    ORDERED,
    PARAMETERLESS,
    Block,
    Generated,
    Spec,
    draw_spec,
    loss_fn,
    sequential_model,
    share_state,
    with_hazard,
)
from tests.support.models import seeded_per_layer

__all__ = ["TOLERANCE", "VARIANTS", "Case", "Result", "draw_case", "draw_cases", "run_case",
           "quiet", "run_cases", "run_seed"]

TOLERANCE = 1e-10
#: Ways to run each generated model (see :func:`draw_cases`).
VARIANTS = 4
RECOMPUTE = ("always", "except_last", "never")
#: V shapes drawn in ZB-V's place, by a generator of their own, so that every seed drawn
#: before them (the fixed tests, the runs of ``make fuzz``) still draws what it did.
MEMORY_V = ("v-half", "v-min")
#: The share of cases that offload their activations, and that give the step their
#: micro-batches (the batch split as the pipeline would split it).
OFFLOADED = GIVEN = 0.3
#: The schedule names, and "mixed": zero-bubble's table with some I+W pairs run as one B.
SCHEDULE_NAMES = (*(name for name in SCHEDULES if name not in MEMORY_V), "mixed")
#: The share of models given one of HAZARDS (not compiled ones), drawn apart.
HAZARDOUS = 0.25


@dataclass(frozen=True)
class Case:
    """Everything a run needs; ``seed`` alone rebuilds it through :func:`draw_case`."""

    seed: int
    variant: int
    spec: Spec
    cut: str                    # "split_at", "auto" (stages=K) or "sequential" (balance)
    boundaries: tuple[int, ...]  # blocks that begin a stage (split_at, sequential)
    ranks: int
    virtual: int
    schedule: str
    chunks: int
    batch: int
    recompute: str
    train: bool
    mixed_seed: int = 0
    compiled: bool = False      # compile=True (python -m tests.generated --compile)
    offload: bool = False       # offload="activations"
    given: bool = False         # step(microbatches=...): the batch split by the caller

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def __str__(self) -> str:
        cut = self.cut if self.cut == "auto" else f"{self.cut} at {list(self.boundaries)}"
        return (f"seed {self.seed}.{self.variant}: {self.schedule} K={self.ranks}x{self.virtual} "
                f"M={self.chunks} N={self.batch} recompute={self.recompute} "
                f"{'train' if self.train else 'eval'} {cut}{' compiled' if self.compiled else ''}"
                f"{' offload' if self.offload else ''}"
                f"{' given micro-batches' if self.given else ''}; "
                f"{self.spec}")


@dataclass(frozen=True)
class Result:
    """The worst relative error and where, or the pipeline's exception."""

    error: float
    where: str
    exception: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.exception is None and self.error <= TOLERANCE

    def __str__(self) -> str:
        if self.exception is not None:
            return f"raised {type(self.exception).__name__}: {self.exception}"
        return f"error {self.error:.3g} at {self.where}"


def draw_cases(seed: int, *, variants: int = VARIANTS, ranks: int | None = None,
               compiled: bool = False) -> list[Case]:
    """The cases of ``seed``: one random model, and ``variants`` ways to run it, each its
    own cut, K (1–4, or ``ranks``), M (1–8), batch, schedule and options (``compiled``:
    each with ``compile=True``). The variants of a seed share the model's trace (its
    sample has the same shapes), as a user who rebuilds a pipeline of one model does."""
    rng = random.Random(seed)
    spec = draw_spec(rng)
    sequential = rng.random() < 1 / 3
    if sequential:
        spec = replace(spec, blocks=tuple(k if k in CONTEXT_FREE else "linear"
                                          for k in spec.blocks),
                       memory_from=None, skip=None, shared=None, tie_head=False,
                       positions=False, output="tensor", extra=None, scale=False)
    if ranks is not None:  # enough blocks for two stages per rank, each with parameters
        spec = replace(spec, blocks=spec.blocks + ("linear",) * (2 * ranks))
    hazards = random.Random(f"{seed}.hazard")  # apart: earlier seeds draw as they did
    if not compiled and hazards.random() < HAZARDOUS:
        spec = with_hazard(spec, hazards.choice(sorted(HAZARDS)), hazards)
    return [replace(_draw_variant(rng, seed, v, spec, sequential, ranks), compiled=compiled)
            for v in range(variants)]


#: Found by the generator on two processes (seed 1002.1 as drawn while V-Half and V-Min
#: were among the names, shrunk by hand): a traced model in training mode whose frozen
#: batch norm hands on a transposed output to the next stage's dropout, cut into 2
#: stages under 1F1B, was exact on threads and wrong across processes (error 0.52): a
#: message arrived contiguous, and the dropout, filling its mask in memory order,
#: dropped other elements. Messages now keep a transposed tensor's layout.
FOUND_ON_PROCESSES = [
    Case(seed=1002, variant=1, spec=Spec(
        blocks=("batchnorm", "dropout", "linear", "linear"), width=4, length=3, vocab=11,
        dropout=0.3, weights_seed=278331870), cut="auto", boundaries=(), ranks=2,
        virtual=1, schedule="1f1b", chunks=2, batch=6, recompute="except_last",
        train=True, mixed_seed=332527823),
]


def draw_case(seed: int, variant: int = 0) -> Case:
    """Variant ``variant`` of :func:`draw_cases` (``seed``)."""
    return draw_cases(seed, variants=variant + 1)[variant]


def _draw_variant(rng: random.Random, seed: int, variant: int, spec: Spec, sequential: bool,
                  ranks: int | None) -> Case:
    schedule = rng.choice(SCHEDULE_NAMES)
    if schedule == "zb-v":
        schedule = random.Random(f"{seed}.{variant}").choice(("zb-v", *MEMORY_V))
    virtual = 2 if schedule in V_SHAPES or (schedule == "interleaved-1f1b"
                                             and rng.random() < 0.7) else 1
    layers = len(spec.blocks) + (3 if sequential else 0)
    drawn = ranks is None
    if ranks is None:
        ranks = rng.randint(1, max(1, min(4, layers // virtual)))
    least = {"v-half": 2, "v-min": 3}.get(schedule, 1)  # ranks to hold their share
    if ranks < least:
        if drawn and least * virtual <= layers:
            ranks = least
        else:  # a launch's ranks, or too few layers
            schedule = "zb-v"
    stages = ranks * virtual
    holding = sum(kind not in PARAMETERLESS for kind in spec.blocks)
    cut = "sequential" if sequential else rng.choice(("split_at", "auto"))
    if cut == "auto" and holding < max(stages, 2):  # auto split would refuse, and says so
        cut = "split_at"
    boundaries: tuple[int, ...] = ()
    if cut == "split_at":
        boundaries = tuple(sorted(rng.sample(range(1, len(spec.blocks)), stages - 1)))
    if cut == "sequential":
        boundaries = tuple(sorted(rng.sample(range(1, layers), stages - 1)))
    chunks = rng.randint(1, 8)
    if schedule == "interleaved-1f1b":  # micro-batches in rounds of K
        chunks = max(chunks - chunks % ranks, ranks)
    if schedule == "dualpipe-v":  # its warm-up fills both arms of the V
        chunks = max(chunks, 2 * ranks)
    batch = chunks * rng.randint(1, 3) + rng.randrange(chunks)  # uneven micro-batches
    return Case(seed=seed, variant=variant, spec=spec, cut=cut, boundaries=boundaries,
                ranks=ranks, virtual=virtual, schedule=schedule, chunks=chunks,
                batch=max(batch, 2), recompute=rng.choice(RECOMPUTE),
                train=rng.random() < 0.7, mixed_seed=rng.randrange(1 << 30),
                # drawn apart, as V-Half and V-Min are: every earlier seed draws as before
                offload=random.Random(f"{seed}.{variant}.offload").random() < OFFLOADED,
                given=random.Random(f"{seed}.{variant}.given").random() < GIVEN)


def mixed_table(ranks: int, chunks: int, seed: int) -> Schedule:
    """Zero-bubble's table with a random half of its backward pairs as one ``B``.

    The ``B`` takes the place of the ``I`` and its ``W`` is dropped, which keeps every
    dependency: a mixed table of ``B``, ``I`` and ``W``.
    """
    table = build("zero-bubble", ranks, chunks)
    rng = random.Random(seed)
    whole = {(a.stage, a.microbatch) for column in table.columns for a in column
             if a.kind is Kind.INPUT and rng.random() < 0.5}
    columns = tuple(
        tuple(Action(a.stage, Kind.BACKWARD, a.microbatch) if a.kind is Kind.INPUT
              and (a.stage, a.microbatch) in whole else a
              for a in column if not (a.kind is Kind.WEIGHT and (a.stage, a.microbatch) in whole))
        for column in table.columns)
    return Schedule(columns, table.num_stages, table.num_microbatches, name="mixed")


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
