"""V-Half and V-Min: V-shape schedules whose activation memory is a set share of 1F1B's.

Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024): with two
stages per rank in a V (:mod:`.vshape`), how much a rank holds is decided by how soon
micro-batches enter, not by the V alone. 1F1B's first rank holds K micro-batches of its
layers at its peak; the paper's V-Half holds half of that near ZB-H1's bubble, and its
V-Min a third at about 1F1B's. Here V-Half holds at most 1/2 and V-Min at most 2/5:
below a third this builder stalls, where the paper's hand-made building blocks do not.

This module builds both the same way, on a clock where F, I and W of a stage each take
one tick (a stage is half a rank's layers, as in every V):

- a micro-batch *enters* with the forward of stage 0 (on rank 0), at most one every
  ``spacing`` ticks, and is *in flight* until the input gradient of stage 0; at most
  ``limit`` are in flight;
- each tick, every rank runs the first ready action of: the oldest ``I``, the oldest
  ``F`` of its stage on the way back, of its stage on the way down (on rank 0 a new
  micro-batch, if it may enter), then the oldest ``W`` (or the ``W`` before any ``F``);
- of these orders, the shortest step is kept whose ranks never hold more than the
  share of 1F1B's peak (a stage's activations counted from its ``F`` until its ``W``,
  in halves of a rank's layers: 1F1B's first rank holds 2K of them).

The result is a table like any other, read by every runtime, the validator and the
simulator; its memory is measured in ``benchmarks/memory.py --schedules``.
"""

from __future__ import annotations

import functools
import itertools
import math

from conveyor.errors import ScheduleError
from conveyor.schedules.table import Action, Kind, Schedule, check_size
from conveyor.schedules.vshape import v_stages

__all__ = ["v_half", "v_min", "v_memory"]

#: each schedule's share of 1F1B's peak activation memory
SHARES = {"v-half": 1 / 2, "v-min": 2 / 5}


def v_half(ranks: int, microbatches: int) -> Schedule:
    """V-Half: a V that holds at most half of 1F1B's peak activations (see the module)."""
    return v_memory(ranks, microbatches, SHARES["v-half"], name="v-half")


def v_min(ranks: int, microbatches: int) -> Schedule:
    """V-Min: a V that holds at most 2/5 of 1F1B's peak activations (see the module)."""
    return v_memory(ranks, microbatches, SHARES["v-min"], name="v-min")


@functools.lru_cache(maxsize=64)  # a search of a few hundred greedy orders: once
def v_memory(ranks: int, microbatches: int, share: float, *, name: str = "v-memory"
             ) -> Schedule:
    """The V whose ranks hold at most ``share`` of 1F1B's peak activations, the
    shortest such step among the greedy orders tried (see the module).

    Raises:
        ScheduleError: a size below 1, or a share below what one micro-batch in flight
            needs (two stages' activations on rank 0, a share of 1 / K).
    """
    check_size(ranks=ranks, microbatches=microbatches)
    cap = share * 2 * ranks  # in stages' activations of one micro-batch
    best: tuple[int, list[list[Action]]] | None = None
    for weight_first, spacing in itertools.product((False, True), range(1, 9)):
        for limit in range(1, microbatches + 1):
            ticks, columns, peak = _greedy(ranks, microbatches, limit, weight_first, spacing)
            if peak > cap + 1e-9:
                break
            if best is None or ticks < best[0]:
                best = ticks, columns
    if best is None:
        raise ScheduleError(
            f"{name} holds at most {share:.2g} of 1F1B's activations, {cap:g} stages' "
            f"worth on a rank; one micro-batch in flight holds 2 on rank 0, so it needs "
            f"{math.ceil(1 / share)} ranks or more; got {ranks}")
    return Schedule(tuple(tuple(column) for column in best[1]), 2 * ranks, microbatches,
                    name=name)


def _greedy(ranks: int, microbatches: int, limit: int, weight_first: bool, spacing: int
            ) -> tuple[int, list[list[Action]], int]:
    """The columns with at most ``limit`` micro-batches in flight, one entering at most
    every ``spacing`` ticks (``weight_first``: a ``W`` before any ``F``), their ticks, and
    the most stages' activations a rank holds at once.

    Each stage takes each kind's micro-batches in order, so a rank's candidates are the
    next F, I and W of each of its two stages."""
    last = 2 * ranks - 1
    finished_at: dict[tuple[int, Kind], int] = {}  # (stage, kind): micro-batches done
    columns: list[list[Action]] = [[] for _ in range(ranks)]
    entered = finished = ticks = 0
    admitted = -spacing
    held, peak = [0] * ranks, 0
    order = {Kind.INPUT: 0, Kind.FORWARD: 2, Kind.WEIGHT: 1 if weight_first else 4}

    def count(stage: int, kind: Kind) -> int:
        return finished_at.get((stage, kind), 0)

    def ready(stage: int, kind: Kind) -> Action | None:
        m = count(stage, kind)
        if m >= microbatches:
            return None
        if kind is Kind.FORWARD:
            met = count(stage - 1, kind) > m if stage else (
                entered - finished < limit and ticks - admitted >= spacing)
        elif kind is Kind.INPUT:
            met = count(stage, Kind.FORWARD) > m and (stage == last
                                                      or count(stage + 1, kind) > m)
        else:
            met = count(stage, Kind.INPUT) > m
        return Action(stage, kind, m) if met else None

    def priority(action: Action) -> tuple[int, int]:
        down = action.kind is Kind.FORWARD and action.stage < ranks  # after the way back
        return order[action.kind] + down, action.microbatch

    total = 6 * ranks * microbatches
    while sum(map(len, columns)) < total:
        ticks += 1
        chosen = []
        for r in range(ranks):
            candidates = [a for s in v_stages(ranks, r) for kind in order
                          if (a := ready(s, kind)) is not None]
            chosen.append(min(candidates, key=priority, default=None))
        if not any(chosen):
            raise ScheduleError(f"the V-memory schedule stalled with {limit} in flight")
        for r, action in enumerate(chosen):  # all at once: this tick's actions
            if action is None:
                continue
            columns[r].append(action)
            key = (action.stage, action.kind)
            finished_at[key] = count(*key) + 1
            if action.kind is Kind.FORWARD:
                held[r] += 1
                if action.stage == 0:
                    entered, admitted = entered + 1, ticks
            elif action.kind is Kind.WEIGHT:
                held[r] -= 1
            elif action.stage == 0:  # the input gradient of stage 0: a micro-batch done
                finished += 1
            peak = max(peak, held[r])
    return ticks, columns, peak
