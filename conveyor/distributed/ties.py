"""Tied weights between processes: the ranks holding copies of one weight form a
process group, start from the lowest stage's value, and sum their gradients over it.
The copies themselves are made as in one process (:mod:`conveyor.engine.ties`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.distributed.faults import collective
from conveyor.distributed.topology import Topology
from conveyor.engine.ties import TiedParameter, equalize

__all__: list[str] = []


def connect_ties(ties: Sequence[TiedParameter], topology: Topology,
                 stage_ranks: Sequence[int], seconds: float) -> None:
    """Gives each tie its process group and the lowest stage's value on every rank.

    A collective: every process calls it with the same ties, in the same order, and
    waits at most ``seconds`` for the others.

    Raises:
        PeerFailure: a rank holding a copy did not join in time.
    """
    for tie in ties:
        tie.group = _tie_group(tie.stages, stage_ranks, topology)
        if tie.group is not None and tie.copies:
            first = tie.stages[0]
            source = topology.global_rank(stage_ranks[first] if topology.replicas is None
                                          else topology.replicas.first(first))
            collective.broadcast(tie.copies[0].data, src=source, group=tie.group,
                                 what="the broadcast of a tied weight's first value",
                                 seconds=seconds)
            equalize(tie)


def _tie_group(stages: Sequence[int], stage_ranks: Sequence[int], topology: Topology) -> Any:
    """The process group of the ranks holding copies, for this data replica and tensor
    rank (with replicated stages: of every process holding one).

    Every process must create every group, in the same order (a torch.distributed rule),
    so this loops over all replicas and returns the one this process belongs to.
    """
    pipeline_ranks = sorted({stage_ranks[s] for s in stages})
    if len(pipeline_ranks) < 2:
        return None
    if topology.replicas is not None:  # every replica of every stage holding a copy
        holders = [topology.replicas.first(s) + j for s in stages
                   for j in range(topology.replicas.counts[s])]
        group = topology.new_group(holders)
        return group if topology.pipeline_rank in holders else None
    mine = None
    size, tensors = topology.data_size, topology.tensor_size
    for replica in range(size):
        for part in range(tensors):  # global rank (k·D + d)·T + t
            members = [(k * size + replica) * tensors + part for k in pipeline_ranks]
            group = topology.new_group(members)
            if (replica, part) == (topology.data_rank, topology.tensor_rank) \
                    and topology.pipeline_rank in pipeline_ranks:
                mine = group
    return mine
