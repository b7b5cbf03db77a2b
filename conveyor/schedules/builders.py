"""Schedules as data: the functions that build the action tables of each schedule.

Each is a pure function of integers returning a :class:`~.table.Schedule`; the
validator, the simulator, the renderers and every runtime read the same table. With
one tick per action (the clock :func:`~.clock.render_clock` draws), 4 stages
and 4 micro-batches::

    gpipe                                   1f1b (PipeDream-flush)
    rank 0  0F0 0F1 0F2 0F3 . . . ...       rank 0  0F0 0F1 0F2 0F3 .   .   0B0 ...
    rank 3  .   .   .   3F0 3F1 3F2 ...     rank 3  .   .   .   3F0 3B0 3F1 3B1 ...

GPipe runs all forwards, then all backwards: M micro-batches of activations in flight.
1F1B alternates once the pipeline is full: at most K - k in flight on stage k, the same
bubble. Interleaved 1F1B gives each rank V stages (stage s on rank s mod K), dividing
the bubble by about V. Zero-bubble (ZB-H1) splits each full backward ``B`` into the
input gradient ``I`` and the weight gradient ``W``, and runs the ``W`` actions in what
would be bubbles, holding no more micro-batches than 1F1B.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from conveyor.errors import ScheduleError
from conveyor.schedules.table import Action, Kind, Schedule, check_size
from conveyor.schedules.vmemory import v_half, v_min
from conveyor.schedules.vshape import dualpipe_v, zero_bubble_v

__all__ = [
    "SCHEDULES",
    "V_SHAPES",
    "build",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zero_bubble_h1",
]


def _f(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.FORWARD, microbatch)


def _b(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.BACKWARD, microbatch)


def _i(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.INPUT, microbatch)


def _w(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.WEIGHT, microbatch)


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe fill-drain: each stage runs every forward, then every backward in reverse.

    Stage ``s`` runs on rank ``s``. Backward starts from the last micro-batch, whose
    activations are the freshest (and, with ``checkpoint="except_last"``, the only ones
    not recomputed).

    Raises:
        ScheduleError: ``stages`` or ``microbatches`` is below 1.
    """
    check_size(stages=stages, microbatches=microbatches)
    columns = tuple(
        tuple(_f(s, m) for m in range(microbatches))
        + tuple(_b(s, m) for m in reversed(range(microbatches)))
        for s in range(stages)
    )
    return Schedule(columns, stages, microbatches, name="gpipe")


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): after K - 1 - k warm-up forwards, stage k alternates.

    At most K - k micro-batches are in flight on stage k (K on stage 0) instead of M.

    Raises:
        ScheduleError: ``stages`` or ``microbatches`` is below 1.
    """
    check_size(stages=stages, microbatches=microbatches)
    columns = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        column = [_f(s, m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            column += [_f(s, warmup + m), _b(s, m)]
        column += [_b(s, m) for m in range(microbatches - warmup, microbatches)]
        columns.append(tuple(column))
    return Schedule(tuple(columns), stages, microbatches, name="1f1b")


def interleaved_1f1b(ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: V stages per rank, stage s on rank s mod K.

    Micro-batches go through a rank's stages in groups of K: forwards of the group on
    its first stage, then on its second, and so on; backwards visit the stages in
    reverse. Rank r warms up with 2(K - 1 - r) + (V - 1)K forwards, then alternates.

    Raises:
        ScheduleError: a size below 1, or a number of micro-batches that is not a
            multiple of the number of ranks (a last, smaller group leaves the warm-up
            no slack and the table deadlocks; Megatron has the same rule).
    """
    check_size(ranks=ranks, microbatches=microbatches, virtual_stages=virtual_stages)
    if virtual_stages > 1 and microbatches % ranks:
        lower = microbatches // ranks * ranks
        raise ScheduleError(
            f"interleaved 1F1B needs a multiple of {ranks} micro-batches (one group per "
            f"rank); got {microbatches}: use chunks={lower or ranks} or "
            f"{lower + ranks}"
        )
    if virtual_stages == 1:  # one stage per rank: plain 1F1B, as in Megatron
        return replace(one_f_one_b(ranks, microbatches), name="interleaved-1f1b")
    groups = [range(start, start + ranks) for start in range(0, microbatches, ranks)]
    total = microbatches * virtual_stages
    columns = []
    for r in range(ranks):
        forwards = [_f(c * ranks + r, m) for group in groups
                    for c in range(virtual_stages) for m in group]
        backwards = [_b(c * ranks + r, m) for group in groups
                     for c in reversed(range(virtual_stages)) for m in group]
        warmup = min(2 * (ranks - 1 - r) + (virtual_stages - 1) * ranks, total)
        column = forwards[:warmup]
        for i in range(total - warmup):
            column += [forwards[warmup + i], backwards[i]]
        column += backwards[total - warmup:]
        columns.append(tuple(column))
    return Schedule(tuple(columns), ranks * virtual_stages, microbatches,
                    name="interleaved-1f1b")


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into I (input gradient) and W (weight gradient).

    Stage s keeps 1F1B's order, with ``I`` where 1F1B has ``B``, and lets s weight
    gradients wait: W of micro-batch i runs after I of micro-batch i + s. So every stage
    holds at most K micro-batches (1F1B's peak, on stage 0) and the waiting W's fill the
    cool-down, where 1F1B's stages idle. With F, I and W of equal cost the bubble is a
    third of 1F1B's (Qi et al., 2023)::

        rank 0  0F0 0F1 0F2 0F3 .   .   .   0I0 0W0 0F4 0I1 0W1 ...
        rank 3  .   .   .   3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 ...

    Raises:
        ScheduleError: ``stages`` or ``microbatches`` is below 1.
    """
    columns = []
    for s, order in enumerate(one_f_one_b(stages, microbatches).columns):
        column: list[Action] = []
        waiting: list[int] = []  # micro-batches whose weight gradient waits
        for action in order:
            if action.kind is Kind.FORWARD:
                column.append(action)
                continue
            column.append(_i(s, action.microbatch))  # 1F1B's B, split
            waiting.append(action.microbatch)
            if len(waiting) > s:
                column.append(_w(s, waiting.pop(0)))
        column += [_w(s, m) for m in waiting]
        columns.append(tuple(column))
    return Schedule(tuple(columns), stages, microbatches, name="zero-bubble")


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zero-bubble": zero_bubble_h1,
    "zb-v": zero_bubble_v,
    "dualpipe-v": dualpipe_v,
    "v-half": v_half,
    "v-min": v_min,
}

#: Schedules with two stages per rank in a V (:mod:`.vshape`): 2K stages on K ranks.
V_SHAPES = ("zb-v", "dualpipe-v", "v-half", "v-min")


def build(name: str, ranks: int, microbatches: int, *, virtual_stages: int = 1) -> Schedule:
    """The table of schedule ``name`` for ``ranks`` ranks and ``microbatches``.

    ``virtual_stages`` (V) is the number of stages per rank; only interleaved-1f1b
    takes more than one. The V shapes (zb-v, dualpipe-v, v-half, v-min) always run two,
    so they take the default 1 or 2, with the same table.

    Raises:
        ScheduleError: an unknown name (the message lists the known ones),
            ``virtual_stages`` > 1 for a schedule with one stage per rank, or other
            than 2 for a V shape.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of "
                            + ", ".join(repr(n) for n in SCHEDULES))
    if name == "interleaved-1f1b":
        return interleaved_1f1b(ranks, microbatches, virtual_stages)
    if name in V_SHAPES and virtual_stages not in (1, 2):
        raise ScheduleError(f"schedule {name!r} runs two stages per rank, in a V; "
                            f"virtual_stages={virtual_stages} cannot change that: leave it "
                            "out (or give 2), or use 'interleaved-1f1b' for other counts")
    if virtual_stages != 1 and name not in V_SHAPES:
        raise ScheduleError(f"schedule {name!r} has one stage per rank; "
                            f"virtual_stages={virtual_stages} needs 'interleaved-1f1b'")
    return SCHEDULES[name](ranks, microbatches)
