"""V-shape schedules: two stages per rank, the first and the last on rank 0.

With K ranks the model is cut into 2K stages placed in a V: stage s runs on rank s
for s < K and on rank 2K-1-s for the others, so each rank holds one stage of the way
down and one of the way back, and rank 0 holds both the first stage and the last::

    rank 0   stage 0 ----------------------------------> stage 7 (the loss)
    rank 1      stage 1                           stage 6
    rank 2         stage 2                     stage 5
    rank 3            stage 3 ------------> stage 4          (K = 4, 2K = 8 stages)

A micro-batch goes down the ranks and comes back up, so its backward starts on rank 0
as soon as its forward ends there, and each rank's two stages cost half of a rank's
layers each. Two schedules use the placement:

- ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward split
  into ``I`` and ``W``, the ``W`` moved into what would be bubbles, and no more
  activations held than 1F1B's K micro-batches on rank 0.
- DualPipeV (DeepSeek's DualPipe cut in half, github.com/deepseek-ai/DualPipe): in its
  middle phase each rank pairs a forward of one stage with a backward of its other
  stage, which DualPipe overlaps (computation with the other's communication).

Both are tables like any other: every runtime, the validator and the simulator read
them, and nothing here imports torch.
"""

from __future__ import annotations

from conveyor.errors import ScheduleError
from conveyor.schedules.table import Action, Kind, Schedule, check_size

__all__ = ["dualpipe_v", "v_stages", "zero_bubble_v"]


def v_stages(ranks: int, rank: int) -> tuple[int, int]:
    """The two stages of ``rank`` in a V over ``ranks`` ranks: the one on the way down
    (``rank``) and the one on the way back (``2 * ranks - 1 - rank``)."""
    return rank, 2 * ranks - 1 - rank


class _Column:
    """One rank's column, built by naming a stage and a kind: each (stage, kind) takes
    its micro-batches in order, 0, 1, 2, ..."""

    def __init__(self, microbatches: int) -> None:
        self.microbatches = microbatches
        self.actions: list[Action] = []
        self.count: dict[tuple[int, Kind], int] = {}
        self.waiting: list[Action] = []  # weight gradients left by I, oldest first

    def done(self, stage: int, kind: Kind) -> int:
        return self.count.get((stage, kind), 0)

    def add(self, stage: int, kind: Kind) -> None:
        """Appends ``kind`` of the stage's next micro-batch (nothing once all are in)."""
        m = self.done(stage, kind)
        if m < self.microbatches:
            self.actions.append(Action(stage, kind, m))
            self.count[(stage, kind)] = m + 1

    def backward(self, stage: int, *, split: bool) -> None:
        """The stage's next backward: ``B``, or (``split``) ``I`` with its ``W`` queued.

        ``B`` and ``I`` share one count: they are the same backward, whole or split."""
        m = self.done(stage, Kind.BACKWARD)
        if m >= self.microbatches:
            return
        self.count[(stage, Kind.BACKWARD)] = m + 1
        if not split:
            self.actions.append(Action(stage, Kind.BACKWARD, m))
            return
        self.actions.append(Action(stage, Kind.INPUT, m))
        self.waiting.append(Action(stage, Kind.WEIGHT, m))

    def weight(self) -> None:
        """The oldest queued weight gradient."""
        self.actions.append(self.waiting.pop(0))


def zero_bubble_v(ranks: int, microbatches: int) -> Schedule:
    """ZB-V: zero-bubble with two stages per rank in a V (Qi et al., 2024, section 6).

    Rank r runs stage a = r and stage b = 2K-1-r. It warms up with 2(K-r)-1 forwards
    of a, then r pairs (F of b, F of a), then K-r triples (F, I, W of b). In the
    steady state it repeats F, I, W of a, then F, I, W of b; it cools down with r
    pairs (I of a, I of b) and K-r pairs (I, W of a), then the weight gradients left.
    On a clock where F, I and W of a stage take one tick each (K = 2, M = 4)::

                0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  ...
        rank 0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 ...
        rank 1  .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 ...

    With F = I = W and M >= 2K, every rank idles only while the first micro-batch
    reaches it: (K-1) forwards of a stage, half a rank's forward each. That is half
    of ZB-H1's idle time and a sixth of 1F1B's, and a rank holds at most 2K stages'
    activations of one micro-batch (K micro-batches of a rank's layers, as 1F1B's
    first stage).

    Raises:
        ScheduleError: ``ranks`` or ``microbatches`` is below 1.
    """
    check_size(ranks=ranks, microbatches=microbatches)
    f, i, w = Kind.FORWARD, Kind.INPUT, Kind.WEIGHT
    columns = []
    for r in range(ranks):
        a, b = v_stages(ranks, r)
        column = _Column(microbatches)
        for _ in range(2 * (ranks - r) - 1):
            column.add(a, f)
        for _ in range(r):
            column.add(b, f)
            column.add(a, f)
        for _ in range(ranks - r):
            for kind in (f, i, w):
                column.add(b, kind)
        while column.done(b, f) < microbatches:
            for stage in (a, b):
                for kind in (f, i, w):
                    column.add(stage, kind)
        for _ in range(r):
            column.add(a, i)
            column.add(b, i)
        for _ in range(ranks - r):
            column.add(a, i)
            column.add(a, w)
        for stage in (b, a):
            while column.done(stage, w) < microbatches:
                column.add(stage, w)
        columns.append(tuple(column.actions))
    return Schedule(tuple(columns), 2 * ranks, microbatches, name="zb-v")


def dualpipe_v(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV: DeepSeek's DualPipe cut in half, on K ranks with stages in a V.

    Rank r runs stage a = r (DualPipe's chunk 0) and b = 2K-1-r (chunk 1), in
    DualPipeV's eight phases: 2(K-r-1) forwards of a; r+1 pairs (F of a, F of b);
    K-r-1 triples (I of b, the oldest W, F of b); M-2K+r+1 rounds of (F of a, B of b,
    F of b, B of a), the forward-and-backward pairs; K-r-1 rounds (B of b, F of b,
    B of a); r+1 pairs of backwards (B of b, B of a), split into I and a deferred W
    from the middle on; K-r-1 pairs (the oldest W, I of a); the W's left. On a clock
    of one tick per action (K = 2, M = 4; a ``B`` here is I and W in one tick)::

                0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  ...
        rank 0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 ...
        rank 1  .   1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 ...

    DualPipe runs each (F, B) pair of the middle phase at once, hiding one's
    communication behind the other's computation. Here a rank runs one action at a
    time, so a pair runs as its F then its B, and the simulator charges them one
    after the other: what this table keeps of DualPipeV is its order and its memory,
    2K + 1 stages' activations of a micro-batch per rank (DualPipe's PP + 1, with
    PP = 2K stages), not the overlap.

    Raises:
        ScheduleError: a size below 1, or fewer than 2K micro-batches (DualPipeV's
            warm-up fills the V with 2K of them, as DualPipe requires).
    """
    check_size(ranks=ranks, microbatches=microbatches)
    if microbatches < 2 * ranks:
        raise ScheduleError(
            f"dualpipe-v needs at least 2 x {ranks} = {2 * ranks} micro-batches for "
            f"{ranks} ranks (its warm-up fills both arms of the V); got {microbatches}: "
            f"use chunks={2 * ranks} or more, or fewer ranks")
    columns = []
    for r in range(ranks):
        columns.append(tuple(_dualpipe_v_column(ranks, microbatches, r).actions))
    return Schedule(tuple(columns), 2 * ranks, microbatches, name="dualpipe-v")


def _dualpipe_v_column(ranks: int, microbatches: int, r: int) -> _Column:
    """Rank r's column of DualPipeV, phase by phase (see :func:`dualpipe_v`)."""
    f = Kind.FORWARD
    a, b = v_stages(ranks, r)
    column = _Column(microbatches)
    later = ranks - r - 1  # ranks after r
    for _ in range(2 * later):
        column.add(a, f)
    for _ in range(r + 1):
        column.add(a, f)
        column.add(b, f)
    for _ in range(later):
        column.backward(b, split=True)
        column.weight()
        column.add(b, f)
    for _ in range(microbatches - 2 * ranks + r + 1):  # forward-and-backward pairs
        column.add(a, f)
        column.backward(b, split=False)
        column.add(b, f)
        column.backward(a, split=False)
    for _ in range(later):
        column.backward(b, split=False)
        column.add(b, f)
        column.backward(a, split=False)
    half = (r + 1) // 2  # from here on the backwards leave their W for later
    for step in range(r + 1):
        column.backward(b, split=step > half or (step == half and r % 2 == 1))
        column.backward(a, split=step >= half)
    for _ in range(later):
        column.weight()
        column.backward(a, split=True)
    while column.waiting:
        column.weight()
    return column
