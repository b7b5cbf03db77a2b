"""The one validator every schedule table passes before anything runs it.

A problem is reported with the table drawn and the failing step bracketed; a table
that deadlocks, with the clock up to the stall and what every stuck rank waits for.
"""

from __future__ import annotations

from conveyor.errors import ScheduleError
from conveyor.schedules.clock import layout_clock
from conveyor.schedules.table import Action, Kind, Schedule, check_size, dependencies

__all__ = ["validate"]


def validate(schedule: Schedule) -> None:
    """Checks that ``schedule`` is complete, consistent and free of deadlock.

    Every stage must live on one rank; every (stage, micro-batch) needs exactly one
    ``F`` and one backward: either ``B``, or ``I`` and ``W``; each edge must join a
    stage to a later one past the next, once; and the table must run to the end when
    each rank follows its column and waits for the results it needs (over its edges
    too: ``F`` of an edge's destination after ``F`` of its source, the source's
    backward after the destination's).

    Raises:
        ScheduleError: the first problem found, with the table and the failing step.
    """
    check_size(num_stages=schedule.num_stages, num_microbatches=schedule.num_microbatches)
    _check_edges(schedule)
    seen: dict[Action, tuple[int, int]] = {}
    owner: dict[int, int] = {}
    for rank, column in enumerate(schedule.columns):
        for step, action in enumerate(column):
            where = (rank, step)
            if not (0 <= action.stage < schedule.num_stages) or not (
                0 <= action.microbatch < schedule.num_microbatches
            ):
                _fail(
                    schedule,
                    f"{action} is outside the table's {schedule.num_stages} stages "
                    f"and {schedule.num_microbatches} micro-batches",
                    where,
                )
            if action in seen:
                first = seen[action]
                _fail(schedule, f"{action} appears twice (first at rank {first[0]}, "
                      f"step {first[1]})", where)
            if owner.setdefault(action.stage, rank) != rank:
                _fail(
                    schedule,
                    f"stage {action.stage} runs on rank {owner[action.stage]} and "
                    f"rank {rank}; each stage belongs to one rank",
                    where,
                )
            seen[action] = where
    _check_backward_kinds(schedule, seen)
    for action, where in seen.items():
        for needed in dependencies(action, schedule):
            # One in no column is reported missing below; one on another rank, if late,
            # makes the table deadlock (reported by the clock with who waits for whom).
            at = seen.get(needed)
            if at is not None and at[0] == where[0] and at > where:
                _fail(schedule, f"{action} comes before {needed} on its own rank"
                      f"{_over_edge(needed, action)}", where)
    missing = [
        needed
        for s in range(schedule.num_stages)
        for m in range(schedule.num_microbatches)
        for needed in (Action(s, Kind.FORWARD, m), schedule.backward_of(s, m))
        if needed not in seen
    ]
    if missing:
        listed = " ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(
            f"schedule {schedule.name!r} is incomplete: {len(missing)} actions missing "
            f"({listed})\n{_render_text(schedule, None)}"
        )
    layout_clock(schedule)


def _check_edges(schedule: Schedule) -> None:
    """Each edge joins a stage to a later one past the next (neighbours always talk),
    and no two edges join the same stages."""
    joined: set[tuple[int, int]] = set()
    for edge in schedule.edges:
        stages = schedule.num_stages
        problem = None
        if not (0 <= edge.source < stages and 0 <= edge.destination < stages):
            problem = f"names a stage outside the table's {stages} stages"
        elif edge.destination <= edge.source + 1:
            problem = ("must go from a stage to a later one past the next (stage s always "
                       "sends to stage s + 1, without an edge)")
        elif (edge.source, edge.destination) in joined:
            problem = "is listed twice"
        if problem is not None:
            raise ScheduleError(f"schedule {schedule.name!r}: edge {edge} {problem}\n"
                                f"{_render_text(schedule, None)}")
        joined.add((edge.source, edge.destination))


def _over_edge(needed: Action, action: Action) -> str:
    """`` (edge 0->2)`` when ``action`` needs ``needed`` because of an edge."""
    low, high = sorted((needed.stage, action.stage))
    return f" (edge {low}->{high})" if high > low + 1 else ""


def _check_backward_kinds(schedule: Schedule, seen: dict[Action, tuple[int, int]]) -> None:
    """Each (stage, micro-batch) runs one backward: ``B``, or ``I`` and then ``W``.

    ``seen`` maps each action to its (rank, step), in table order."""
    for action, where in seen.items():
        s, m = action.stage, action.microbatch
        full = Action(s, Kind.BACKWARD, m)
        split = Action(s, Kind.INPUT, m)
        weight = Action(s, Kind.WEIGHT, m)
        if action in (full, split) and (full in seen and split in seen):
            later = max(full, split, key=seen.__getitem__)
            earlier = split if later == full else full
            _fail(schedule, f"{later} and {earlier} both run the backward of stage {s}, "
                  f"micro-batch {m}: keep {full} (full backward) or {split} followed by "
                  f"{weight} (split backward), not both", seen[later])
        if action == weight and split not in seen:
            fix = (f"{full} already computes the weight gradient: drop {weight}, or split "
                   f"{full} into {split} and {weight}" if full in seen else
                   f"add {split} before it, or write {full} (full backward) instead")
            _fail(schedule, f"{weight} has no {split} to take the weight gradient from; "
                  f"{fix}", where)
        if action == split and weight not in seen:
            _fail(schedule, f"{split} computes only the input gradient and no {weight} "
                  f"follows with the weight gradient: add {weight} after it, or write "
                  f"{full} (full backward) instead", where)


def _fail(schedule: Schedule, problem: str, where: tuple[int, int]) -> None:
    rank, step = where
    raise ScheduleError(
        f"schedule {schedule.name!r}, rank {rank}, step {step}: {problem}\n"
        f"{_render_text(schedule, where)}"
    )


def _render_text(schedule: Schedule, mark: tuple[int, int] | None) -> str:
    """The text form with ``rank r:`` labels; the action at ``mark`` is bracketed."""
    lines = []
    for rank, column in enumerate(schedule.columns):
        cells = [
            f"[{a}]" if (rank, step) == mark else str(a) for step, a in enumerate(column)
        ]
        lines.append(f"  rank {rank}: " + (" ".join(cells) or "-"))
    if schedule.edges:
        lines.append("  edges: " + " ".join(map(str, schedule.edges)))
    return "\n".join(lines)
