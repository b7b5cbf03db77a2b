"""gloo's collectives among the processes of a launch, timed for the planner's cluster.

Each is timed in runs back to back, as a step's collectives come (the ranks in step:
one alone after a barrier also times how unevenly the ranks leave it), the median of
seven runs after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["calibrate", "collective_shares"]

BURST = 8  # all-reduces timed back to back in the link's calibration


def _burst(call: Callable[[], object], count: int) -> float:
    """Seconds of ``count`` calls back to back, the median of 7 runs between barriers."""
    times = []
    for _ in range(8):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def calibrate(group_size: int, small: int, large: int) -> tuple[float, float]:
    """gloo's all-reduce: (latency, bandwidth) fitted to the ring's 2(n-1)(latency +
    bytes / n / bandwidth) at ``small`` float32 elements (what each of TP's all-reduces
    carries) and ``large`` (the model's gradients, data parallelism's)."""
    def timed(elements: int) -> float:
        tensor = torch.ones(elements)
        return _burst(lambda: dist.all_reduce(tensor), BURST) / BURST

    t_small, t_large = timed(small), timed(large)
    hops = 2 * (group_size - 1)
    per_byte = (t_large - t_small) / (4 * (large - small)) / hops  # 1 / (n * bandwidth)
    bandwidth = 1 / (per_byte * group_size)
    latency = max(0.0, t_small / hops - 4 * small * per_byte)
    return latency, bandwidth


def collective_shares(group_size: int, unit: int, count: int) -> tuple[float, float]:
    """gloo's all-gather and reduce-scatter of ``unit`` float32 elements (one FSDP
    unit's parameters), ``count`` back to back as FSDP issues them a unit at a time,
    each over the all-reduce of the same unit timed the same way: the cluster's
    ``all_gather_share`` and ``reduce_scatter_share`` (0.5 each on a ring)."""
    unit = unit // group_size * group_size
    whole, shard, gathered = torch.ones(unit), torch.ones(unit // group_size), torch.empty(unit)
    reduce = _burst(lambda: dist.all_reduce(whole), count)
    gather = _burst(lambda: dist.all_gather_into_tensor(gathered, shard), count)
    scatter = _burst(lambda: dist.reduce_scatter_tensor(shard, whole), count)
    return gather / reduce, scatter / reduce
