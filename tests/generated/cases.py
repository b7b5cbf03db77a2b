"""A case: a generated model, a way to cut it, a schedule and its options, drawn from a
seed alone, so ``python -m tests.generated --seed N`` rebuilds it anywhere (its run
against the plain model: :mod:`tests.generated.running`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace


from conveyor.schedules.builders import SCHEDULES, V_SHAPES, build
from conveyor.schedules.table import Action, Kind, Schedule
from tests.generated.models import (
    CONTEXT_FREE,
    HAZARDS,
    PARAMETERLESS,
    Spec,
    draw_spec,
    with_hazard,
)

__all__ = ["TOLERANCE", "VARIANTS", "Case", "Result", "draw_case", "draw_cases"]

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
#: The share of cases whose small linear layers fuse their weight gradients, as layers
#: of 2^16 elements or more do (accumulation.FUSED_MIN_ELEMENTS), drawn apart.
FUSED = 0.5
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
    fused: bool = False         # small weights' gradients fused too (as large ones are)

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def __str__(self) -> str:
        cut = self.cut if self.cut == "auto" else f"{self.cut} at {list(self.boundaries)}"
        return (f"seed {self.seed}.{self.variant}: {self.schedule} K={self.ranks}x{self.virtual} "
                f"M={self.chunks} N={self.batch} recompute={self.recompute} "
                f"{'train' if self.train else 'eval'} {cut}{' compiled' if self.compiled else ''}"
                f"{' offload' if self.offload else ''}"
                f"{' given micro-batches' if self.given else ''}"
                f"{' fused' if self.fused else ''}; "
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
                given=random.Random(f"{seed}.{variant}.given").random() < GIVEN,
                fused=random.Random(f"{seed}.{variant}.fused").random() < FUSED)


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
