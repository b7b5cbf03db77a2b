"""gloo's collectives among the processes of a launch, timed for the planner's cluster,
each as a step issues it.

* TP's all-reduce (small): as the caller's step issues it, measured there (see
  benchmarks/mesh.py: a block split by its plan, against its shard alone). Between two
  collectives gloo's threads go idle and the ranks drift apart, the more the longer
  they compute: a step's all-reduce costs about twice what one back to back with the
  last takes, and more after more compute (16 KiB, 2 processes on 2 cores: 300-400 us
  back to back, 600-700 us after 60-170 us of products, 1.2 ms after 500 us).
* The replicas' gradient sum (large): ``conveyor.distributed.gradients``' own, on
  gradients of the model's shapes: flattened into a bucket, summed by the runtime's
  all-reduce (its watcher thread waiting), and divided back into ``.grad``. The copies
  count: on a CPU they pass over memory as large as the model, twice.
* Both over each level's groups, every group of a level at once (a cluster of levels:
  ``mesh.py`` runs 4 processes as two "nodes" of two), fitted level by level
  (:func:`fit_levels`): a pair's all-reduce among 4 busy processes on 2 cores costs
  more than the third of the 4-ring's it would be on one level (2.0 ms against 1.7).
* FSDP's all-gather and reduce-scatter of one unit: FSDP2's own, on a unit of the
  model (its copies in and out, its bookkeeping), each over the gradient sum of the
  same parameters timed as above (the cluster's shares: half each on a ring, with no
  copies).

A time is the median of seven runs between barriers after a warm-up, each run a burst
of calls back to back, as a step's collectives come (the ranks in step: one alone after
a barrier also times how unevenly the ranks leave it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["burst", "collective_shares", "fit_levels", "gradient_sum", "gradient_sum_seconds",
           "message_seconds",
           "split_all_reduce_seconds"]

BURST = 8  # all-reduces timed back to back in the link's calibration
SMALL_BURST = 64  # small collectives and messages timed back to back: each a ms or less


def burst(call: Callable[[], object], count: int) -> float:
    """Seconds of ``count`` calls back to back, the median of 7 runs between barriers."""
    times = []
    for _ in range(8):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def gradient_sum(shapes: Sequence[torch.Size], group: Any = None) -> Callable[[], None]:
    """The replicas' sum over ``group`` (None: every rank) of gradients of ``shapes``, as
    the runtime runs it: ``conveyor.distributed.gradients.reduce_across_replicas``, its
    buckets flattened, each summed by the runtime's bounded all-reduce (waited for by
    its watcher thread) and divided back into ``.grad``."""
    from conveyor.distributed.faults import collective
    from conveyor.distributed.gradients import reduce_across_replicas

    size = dist.get_world_size(group)
    params = [nn.Parameter(torch.empty(shape)) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)

    def reduce(flat: torch.Tensor, op: Any) -> None:
        collective.all_reduce(flat, group=group, what="the calibration's gradient sum",
                              seconds=300.0, op=op)

    def call() -> None:
        reduce_across_replicas(params, group, size, size, reduce)
    return call


def gradient_sum_seconds(shapes: Sequence[torch.Size], group: Any = None) -> float:
    """One replicas' sum of gradients of ``shapes`` over ``group``, as the runtime runs
    it (every group of the launch timed at once)."""
    return burst(gradient_sum(shapes, group), BURST) / BURST


def fit_levels(sizes: Sequence[int], small: int, t_small: Sequence[float], large: int,
               t_large: Sequence[float]) -> list[tuple[float, float]]:
    """Each level's (latency, bandwidth), innermost first, from all-reduces over the
    devices each level holds: ``t_small[i]`` and ``t_large[i]`` seconds at ``small`` and
    ``large`` float32 elements among ``sizes[0] * ... * sizes[i]`` devices. As the
    planner counts it (``conveyor.planner.mesh.group_ring``), level i adds a ring of
    ``sizes[i]``: 2(n-1)(latency + bytes / n / bandwidth), so each level takes what its
    group's all-reduce costs beyond the one inside it."""
    levels, below_small, below_large = [], 0.0, 0.0
    for size, at_small, at_large in zip(sizes, t_small, t_large):
        hops = 2 * (size - 1)
        own_small, own_large = at_small - below_small, at_large - below_large
        per_byte = max(1e-15, (own_large - own_small) / (4 * (large - small)) / hops)
        levels.append((max(0.0, own_small / hops - 4 * small * per_byte),
                       1 / (per_byte * size)))
        below_small, below_large = at_small, at_large
    return levels


def collective_shares(unit: Callable[[], nn.Module], sample: torch.Tensor, count: int
                      ) -> tuple[float, float, float]:
    """FSDP2's all-gather and reduce-scatter of one ``unit()`` (a module made the same on
    every rank, one FSDP unit) as FSDP2 runs them over the launch's ranks, ``count``
    back to back as FSDP issues them a unit at a time, each over the replicas' sum of
    the same parameters as the runtime runs it: the cluster's ``all_gather_share`` and
    ``reduce_scatter_share``. The gather is ``unshard()`` and ``reshard()``; the
    reduce-scatter, what a forward and backward of ``sample`` through the unit takes
    with FSDP's gradient sync over what it takes without. Third, the cluster's
    ``fsdp_unit_s``: the seconds FSDP's hooks add to that forward and backward without
    sync, its parameters gathered, over the plain unit's."""
    from torch.distributed.fsdp import fully_shard

    module = unit()
    plain = unit()
    reduce = burst(gradient_sum([p.shape for p in module.parameters()]), count)
    sharded: Any = fully_shard(module, reshard_after_forward=False)
    gather = burst(lambda: (sharded.unshard(), sharded.reshard()), count)
    sharded.set_reshard_after_backward(False)
    sharded.unshard()

    def backward(sync: bool) -> Callable[[], None]:
        def call() -> None:
            sharded.set_requires_gradient_sync(sync)
            sharded(sample).sum().backward()
        return call

    unsynced = burst(backward(False), count)
    scatter = max(0.0, burst(backward(True), count) - unsynced)
    hooks = max(0.0, unsynced - burst(lambda: plain(sample).sum().backward(), count)) / count
    sharded.reshard()
    return gather / reduce, scatter / reduce, hooks


def message_seconds(elements: int) -> float:
    """One way, the seconds of a message of ``elements`` float32 between two ranks
    (each rank and its neighbour ``rank ^ 1``; an odd last rank sits out): half a round
    trip of a send and a receive each way, 64 to a burst."""
    rank, size = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    message = torch.zeros(elements)

    def round_trip() -> None:
        if peer >= size:
            return
        if rank % 2 == 0:
            dist.send(message, peer)
            dist.recv(message, peer)
        else:
            dist.recv(message, peer)
            dist.send(message, peer)

    return burst(round_trip, SMALL_BURST) / SMALL_BURST / 2


def split_all_reduce_seconds(split: Callable[[], torch.Tensor],
                             shard: Callable[[], torch.Tensor], all_reduces: int) -> float:
    """One of the all-reduces a module split by a TP plan runs, as a step issues it: the
    forward and backward of ``split()`` (its output, through the split module) less
    those of ``shard()`` (through a module of one shard's shape, unsplit), over the
    ``all_reduces`` they run, 64 of each back to back as a stage's layers follow one
    another."""
    through_split = burst(lambda: split().sum().backward(), SMALL_BURST)
    through_shard = burst(lambda: shard().sum().backward(), SMALL_BURST)
    return max(0.0, through_split - through_shard) / SMALL_BURST / all_reduces
