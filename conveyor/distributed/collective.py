"""Collectives whose wait is bounded, and reported like a receive when it runs out.

torch's collectives wait as long as the process group's timeout (set once, at start-up)
and then fail with the backend's words ("Timed out waiting 20000ms for send",
"Connection closed by peer"). A pipeline's collectives (the step's loss, the tied
weights' gradients, the replicas' averaging, the clipping norm, the agreement to stop)
go through :func:`all_reduce` and :func:`broadcast` here instead: they run
asynchronously, and this rank waits at most ``seconds``, then raises
:class:`~conveyor.PeerFailure` naming the collective. On gloo the wait itself is done
by a watcher thread (see :mod:`conveyor.distributed.watch`), so giving up does not
close the group's connections.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from conveyor.distributed.peerfailure import collective_failed
from conveyor.distributed.watch import Watcher

__all__: list[str] = []

_watcher: Watcher | None = None
_COLLECTIVES = -1  # the watcher's queue for collectives (its others are peers' ranks)


def all_reduce(tensor: torch.Tensor, *, group: Any, what: str, seconds: float,
               op: Any = None) -> None:
    """``dist.all_reduce`` of ``tensor`` over ``group``, waiting at most ``seconds``.

    Raises:
        PeerFailure: a rank of ``group`` did not join in time, or its connection closed.
    """
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group,
                           async_op=True)
    _wait(work, group, what, seconds)


def broadcast(tensor: torch.Tensor, *, src: int, group: Any, what: str,
              seconds: float) -> None:
    """``dist.broadcast`` of ``tensor`` from global rank ``src``, waiting at most
    ``seconds``.

    Raises:
        PeerFailure: a rank of ``group`` did not join in time, or its connection closed.
    """
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    _wait(work, group, what, seconds)


def _wait(work: Any, group: Any, what: str, seconds: float) -> None:
    global _watcher
    waited: Any = work
    if dist.get_backend(group) == "gloo":  # its wait(timeout) would close the group
        if _watcher is None:
            _watcher = Watcher()
        waited = _watcher.watch(_COLLECTIVES, work)
    try:
        waited.wait(datetime.timedelta(seconds=seconds))
    except Exception as exc:  # a TimeoutError, or the backend's RuntimeError
        raise collective_failed(exc, dist.get_rank(), what, seconds) from exc
