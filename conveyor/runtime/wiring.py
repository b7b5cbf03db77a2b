"""How a runtime reaches the other stages: threads of this process, or ranks.

The runtime is one for both; what differs is its wiring, chosen once from the topology:

=====================  ============================  ==================================
                       threads (one process)         ranks (torchrun, env://)
=====================  ============================  ==================================
transport              ``LocalTransport``            ``P2PTransport`` (ranks' step
                                                     count carried over a rebuild;
                                                     under TP, 1/T of a value per
                                                     rank: ``tensor.boundary``)
columns run here       every rank's                  this rank's, after the transport
                                                     learned every column
a failure's report     the executor's, of its        gathered from every rank through
                       threads                       the store (``faults.explain``)
a collective's notice  none                          the failure a rank announced
=====================  ============================  ==================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from conveyor.distributed.faults import collective
from conveyor.distributed.faults.explain import explain
from conveyor.distributed.faults.whereabouts import Whereabouts
from conveyor.distributed.p2p import P2PTransport
from conveyor.distributed.topology import Topology
from conveyor.engine.executor import Executor
from conveyor.engine.transport import LocalTransport, Transport
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.schedules import Action, Kind, Schedule
from conveyor.tensor.boundary import Boundary

__all__: list[str] = []

Columns = Mapping[int, Sequence[Action]]


class Wiring(Protocol):
    """What a runtime asks of the way its stages are connected."""

    #: whether the executor's own report covers every rank (threads), or a report is
    #: gathered across ranks
    reports: bool

    def transport(self, schedule: Schedule, devices: Sequence[torch.device],
                  deadlines: Deadlines, previous: Transport | None) -> Transport:
        """A transport between the stages of ``schedule``, each on its device (carrying
        over ``previous``'s step count)."""

    def columns(self, transport: Transport, columns: Columns) -> Columns:
        """The columns this process runs, once ``transport`` is ready for them."""

    def explain(self, error: BaseException, executor: Executor, transport: Transport) -> None:
        """Gives a failed step's ``error`` the report of where every rank stood."""

    def notice(self, transport: Transport) -> collective.Notice | None:
        """How a collective of the step looks for a rank's announced failure."""

    def route(self, transport: Transport) -> Callable[[int, int], int] | None:
        """The rank that runs a stage on a micro-batch, where the table does not say
        (replicated stages); None where it does."""


class Threads:
    """Every stage in this process, each rank a thread."""

    reports = True  # the executor's report covers every rank

    def transport(self, schedule: Schedule, devices: Sequence[torch.device],
                  deadlines: Deadlines, previous: Transport | None) -> Transport:
        return LocalTransport(devices, deadlines=deadlines)

    def columns(self, transport: Transport, columns: Columns) -> Columns:
        return columns

    def explain(self, error: BaseException, executor: Executor, transport: Transport) -> None:
        pass

    def notice(self, transport: Transport) -> collective.Notice | None:
        return None

    def route(self, transport: Transport) -> Callable[[int, int], int] | None:
        return None


class Ranks:
    """One rank of a pipeline of processes: messages over torch.distributed, and
    the ranks' whereabouts through the job's store.

    Args:
        topology: where this process sits.
        snapshot: this rank's place in the current step (what it answers when asked).
    """

    reports = False  # a report gathers every rank's place, not the executor's alone

    def __init__(self, topology: Topology,
                 snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self.topology = topology
        self.whereabouts = Whereabouts(topology.pipeline_rank, topology.pipeline_size,
                                       topology.data_rank, snapshot)

    def transport(self, schedule: Schedule, devices: Sequence[torch.device],
                  deadlines: Deadlines, previous: Transport | None) -> Transport:
        transport = P2PTransport(self.topology, schedule, dict(enumerate(devices)), deadlines)
        if isinstance(previous, P2PTransport):
            transport.step = previous.step  # messages carry it; reports ask by it
        transport.locate_ranks = self.whereabouts.locate
        transport.announce = self.whereabouts.announce
        transport.notice = self.whereabouts.notice
        topology, whereabouts = self.topology, self.whereabouts
        if topology.tensor_size > 1:  # 1/T of each value held alike crosses per rank
            transport.boundary = Boundary(topology.tensor_group, topology.tensor_size,
                                          topology.tensor_rank, deadlines.within,
                                          lambda: whereabouts.notice(transport.step))
        return transport

    def columns(self, transport: Transport, columns: Columns) -> Columns:
        assert isinstance(transport, P2PTransport)
        self.whereabouts.start()
        topology, replicas = self.topology, self.topology.replicas
        if replicas is not None:  # each replica its share; without backward, the first all
            backward = any(a.kind is not Kind.FORWARD for c in columns.values() for a in c)
            replicas = dataclasses.replace(replicas, dealt=backward)
            transport.replicas = replicas
        ranks = columns if replicas is None else replicas.columns(columns)
        transport.prepare(ranks)
        return {topology.table_rank: ranks[topology.pipeline_rank]}

    def explain(self, error: BaseException, executor: Executor, transport: Transport) -> None:
        assert isinstance(transport, P2PTransport)
        explain(error, executor, self.whereabouts, transport, self.topology.pipeline_rank)

    def notice(self, transport: Transport) -> collective.Notice | None:
        assert isinstance(transport, P2PTransport)
        step, whereabouts = transport.step, self.whereabouts
        return lambda: whereabouts.notice(step)

    def route(self, transport: Transport) -> Callable[[int, int], int] | None:
        assert isinstance(transport, P2PTransport)
        return transport.rank_of if self.topology.replicas is not None else None
