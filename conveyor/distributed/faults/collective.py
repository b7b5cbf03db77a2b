"""Collectives whose wait is bounded, and reported like a receive when it runs out.

torch's collectives wait as long as the process group's timeout (set once, at start-up)
and then fail with the backend's words ("Timed out waiting 20000ms for send",
"Connection closed by peer"). A pipeline's collectives (the step's loss, the tied
weights' gradients, the replicas' averaging, the clipping norm, the agreement to stop)
go through :func:`all_reduce`, :func:`broadcast` and :func:`all_gather` here instead
(and plain data, such as one rank's balance or every rank's timeline, through
:func:`exchange`): they run asynchronously, and this rank waits at most ``seconds``,
then raises :class:`~conveyor.PeerFailure` naming the collective. On gloo the wait itself is done
by a watcher thread (see :mod:`conveyor.distributed.watch`), so giving up does not
close the group's connections.

A rank that fails posts a notice of its failure in the job's store first thing (see
:mod:`conveyor.distributed.faults.whereabouts`); a rank waiting in a collective looks for it
twice a second (``notice``), and when the collective's connections close (the failed
rank has gone), so that its error names the failed rank, its action and its exception
rather than gloo's "Connection closed by peer".
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from conveyor.distributed.faults.peerfailure import collective_failed, reported
from conveyor.distributed.watch import Watcher

__all__: list[str] = []

_watcher: Watcher | None = None
_COLLECTIVES = -1  # the watcher's queue for collectives (its others are peers' ranks)
_LOOK = 0.5  # seconds between two looks for a failure's notice

#: ``notice()``: the failure a rank of the step announced, or None.
Notice = Callable[[], "dict[str, Any] | None"]


def all_reduce(tensor: torch.Tensor, *, group: Any, what: str, seconds: float,
               op: Any = None, notice: Notice | None = None,
               joined: Callable[[], None] | None = None, inline: bool = False) -> None:
    """``dist.all_reduce`` of ``tensor`` over ``group``, waiting at most ``seconds``
    (and no longer once ``notice()`` tells of a rank's failure). ``joined()`` is called
    once this rank's part is issued (the rank is then in the collective, waiting).
    ``inline``: on gloo too, the calling thread waits, without the watcher's hop to it
    (for the many small all-reduces of tensor parallelism, a few hundred us each on a
    CPU); a wait that runs out then closes the group's connections (the rank stops
    with the same error, its peers in the group see them close).

    Raises:
        PeerFailure: a rank of ``group`` did not join in time, or its connection closed.
    """
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group,
                           async_op=True)
    if joined is not None:
        joined()
    _wait(work, group, what, seconds, notice, inline)


def broadcast(tensor: torch.Tensor, *, src: int, group: Any, what: str,
              seconds: float, notice: Notice | None = None,
              joined: Callable[[], None] | None = None) -> None:
    """``dist.broadcast`` of ``tensor`` from global rank ``src``, waiting at most
    ``seconds``; ``joined`` as for :func:`all_reduce`.

    Raises:
        PeerFailure: a rank of ``group`` did not join in time, or its connection closed.
    """
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    if joined is not None:
        joined()
    _wait(work, group, what, seconds, notice)


def all_gather(pieces: list[torch.Tensor], piece: torch.Tensor, *, group: Any, what: str,
               seconds: float, notice: Notice | None = None, inline: bool = False) -> None:
    """``dist.all_gather`` of every rank's ``piece`` into ``pieces`` (one per rank of
    ``group``, each shaped as ``piece``), waiting at most ``seconds``; ``inline`` as for
    :func:`all_reduce` (``notice`` then only names the failure once the wait fails).

    Raises:
        PeerFailure: a rank of ``group`` did not join in time, or its connection closed.
    """
    work = dist.all_gather(pieces, piece, group=group, async_op=True)
    _wait(work, group, what, seconds, notice, inline)


def exchange(value: Any, *, group: Any, what: str, seconds: float,
             device: torch.device | None = None) -> list[Any]:
    """Every rank's ``value``, in the order of the ranks of ``group``: plain data, which
    crosses as JSON (never pickled: nothing a peer sends is run), through
    :func:`exchange_bytes`.

    Raises:
        PeerFailure: a rank of ``group`` did not join in time, or its connection closed.
        TypeError: ``value`` is not plain data (JSON).
    """
    mine = json.dumps(value).encode()
    return [json.loads(blob.decode()) for blob in
            exchange_bytes(mine, group=group, what=what, seconds=seconds, device=device)]


def exchange_bytes(blob: bytes, *, group: Any, what: str, seconds: float,
                   device: torch.device | None = None) -> list[bytes]:
    """Every rank's ``blob``, in the order of the ranks of ``group``, through two
    bounded all-reduces of tensors on ``device`` (the group's backend's: the CPU for
    gloo). What the bytes mean is the caller's to read safely.

    Raises:
        PeerFailure: a rank of ``group`` did not join in time, or its connection closed.
    """
    device = device or torch.device("cpu")
    world, me = dist.get_world_size(group), dist.get_rank(group)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    sizes[me] = len(blob)
    all_reduce(sizes, group=group, what=what, seconds=seconds)
    rows = torch.zeros(world, int(sizes.max()), dtype=torch.int32, device=device)
    if blob:
        rows[me, :len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
    all_reduce(rows, group=group, what=what, seconds=seconds)
    rows = rows.to(device="cpu", dtype=torch.uint8)
    return [bytes(rows[r, :int(sizes[r])].tolist()) for r in range(world)]


def _wait(work: Any, group: Any, what: str, seconds: float, notice: Notice | None,
          inline: bool = False) -> None:
    global _watcher
    rank = dist.get_rank()
    if dist.get_backend(group) != "gloo" or notice is None or inline:
        waited: Any = work
        # (on gloo a wait(timeout) that runs out closes the group: watched, unless inline)
        if dist.get_backend(group) == "gloo" and not inline:
            if _watcher is None:
                _watcher = Watcher()
            waited = _watcher.watch(_COLLECTIVES, work)
        try:
            waited.wait(datetime.timedelta(seconds=seconds))
        except Exception as exc:  # a TimeoutError, or the backend's RuntimeError
            raise _named(exc, notice, rank, what, seconds, group) from exc
        return
    if _watcher is None:
        _watcher = Watcher()
    watched = _watcher.watch(_COLLECTIVES, work)
    end = time.monotonic() + seconds
    while not watched.done(min(_LOOK, end - time.monotonic())):
        report = notice()
        if report is not None:
            raise reported(report, rank, f"stopped waiting in {what}")
        if time.monotonic() >= end:
            raise _named(TimeoutError(f"timed out after {seconds:g} s"), notice, rank, what,
                         seconds, group)
    try:
        watched.wait(datetime.timedelta(seconds=0))
    except Exception as exc:  # the backend's error: a connection closed
        raise _named(exc, notice, rank, what, seconds, group) from exc


def _named(exc: BaseException, notice: Notice | None, rank: int, what: str,
           seconds: float, group: Any) -> BaseException:
    """The failure of a collective that ended in ``exc``: the announced failure of the
    rank that caused it, if one was posted, else what this rank saw."""
    report = notice() if notice is not None else None
    if report is not None:
        return reported(report, rank, f"stopped waiting in {what}")
    return collective_failed(exc, rank, what, seconds,
                             dist.get_process_group_ranks(group or dist.group.WORLD))
