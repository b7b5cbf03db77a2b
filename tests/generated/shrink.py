"""Shrinking: from a failing case, the smallest case that still fails the same way.

Greedy, as property-based testing tools do: try each simplification (fewer blocks,
each cross-stage value removed, a plain tensor output, fewer stages and micro-batches,
simpler schedules and options); keep the first that still fails, and start again until
none does. "The same way" is the same kind of failure: an exception of the same type,
or a gradient error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

from tests.generated.cases import Case, Result
from tests.generated.running import run_case
from tests.generated.models import Spec

__all__ = ["shrink"]


def _without_block(spec: Spec, index: int) -> Spec | None:
    """``spec`` with block ``index`` removed, its references renumbered (None: cannot)."""
    if len(spec.blocks) <= 1:
        return None

    def moved(i: int | None) -> int | None:
        return None if i is None or i == index else (i - 1 if i > index else i)

    memory_from = moved(spec.memory_from)
    blocks = spec.blocks[:index] + spec.blocks[index + 1:]
    if memory_from is None and "cross" in blocks:
        return None
    pairs = {}
    for name in ("skip", "shared"):
        pair = getattr(spec, name)
        if pair is not None:
            first, second = moved(pair[0]), moved(pair[1])
            if first is None or second is None:
                return None
            pairs[name] = (first, second)
    return replace(spec, blocks=blocks, memory_from=memory_from,
                   extra=spec.extra if memory_from is not None or spec.extra != "memory"
                   else None, **pairs)


def _as_linear(blocks: tuple[str, ...], kind: str) -> tuple[str, ...]:
    return tuple("linear" if b == kind else b for b in blocks)


def _simpler_specs(spec: Spec) -> Iterator[Spec]:
    if spec.skip is not None:
        yield replace(spec, skip=None, blocks=_as_linear(spec.blocks, "gate"))
    if spec.memory_from is not None:
        yield replace(spec, memory_from=None, blocks=_as_linear(spec.blocks, "cross"),
                      extra=None if spec.extra == "memory" else spec.extra)
    for index in reversed(range(len(spec.blocks))):
        smaller = _without_block(spec, index)
        if smaller is not None:
            yield smaller
    for kind_index, kind in enumerate(spec.blocks):
        if kind not in ("linear", "cross", "gate"):
            yield replace(spec, blocks=spec.blocks[:kind_index] + ("linear",)
                          + spec.blocks[kind_index + 1:])
    simpler = {"extra": None, "output": "tensor", "positions": False, "scale": False,
               "tie_head": False, "shared": None, "dropout": 0.0, "width": 4, "length": 3,
               "seq_first": False}
    for name, value in simpler.items():
        if getattr(spec, name) != value:
            yield replace(spec, **{name: value})


def _simpler_cases(case: Case) -> Iterator[Case]:
    for spec in _simpler_specs(case.spec):
        if case.cut == "split_at" and case.boundaries and max(case.boundaries) >= len(spec.blocks):
            continue
        if case.cut == "sequential" and case.boundaries and (
                max(case.boundaries) >= len(spec.blocks) + 3):
            continue
        yield replace(case, spec=spec)
    if case.cut == "split_at" and len(case.boundaries) > 1 and case.virtual == 1:
        for i in range(len(case.boundaries)):
            yield replace(case, boundaries=case.boundaries[:i] + case.boundaries[i + 1:],
                          ranks=case.ranks - 1)
    if case.chunks > 1:
        step = case.ranks if case.schedule == "interleaved-1f1b" else 1
        least = 2 * case.ranks if case.schedule == "dualpipe-v" else step
        fewer = max(case.chunks - step, least)
        if fewer != case.chunks:
            yield replace(case, chunks=fewer, batch=max(fewer, min(case.batch, 2 * fewer)))
    if case.batch > case.chunks + 1:
        yield replace(case, batch=case.chunks + 1 if case.chunks > 1 else 2)
    if case.cut == "auto" and case.ranks > 1:
        yield replace(case, ranks=case.ranks - 1)
    if case.schedule != "gpipe":
        # Two stages per rank become one: the cut is left to the pipeline then.
        yield replace(case, schedule="gpipe", virtual=1,
                      cut=case.cut if case.virtual == 1 else "auto",
                      boundaries=case.boundaries if case.virtual == 1 else ())
    if case.recompute != "never":
        yield replace(case, recompute="never")
    if case.train:
        yield replace(case, train=False)
    for option in ("offload", "given"):  # a plain step
        if getattr(case, option):
            yield replace(case, **{option: False})


def _same_failure(first: Result, second: Result) -> bool:
    if second.ok:
        return False
    if first.exception is None:
        return second.exception is None
    return type(second.exception) is type(first.exception)


def shrink(case: Case, failure: Result, *, run: Callable[[Case], Result] = run_case,
           budget: int = 200, progress: Callable[[Case], None] | None = None
           ) -> tuple[Case, Result]:
    """The smallest simplification of ``case`` that fails as ``failure`` did.

    Args:
        budget: the most cases to run while shrinking.
        progress: called with each smaller failing case found.
    """
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for smaller in _simpler_cases(case):
            runs += 1
            result = run(smaller)
            if _same_failure(failure, result):
                case, failure, improved = smaller, result, True
                if progress is not None:
                    progress(case)
                break
            if runs >= budget:
                break
    return case, failure
