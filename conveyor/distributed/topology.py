"""Pipelines over processes: where each process sits among the pipeline's ranks.

Under torchrun (or once torch.distributed is initialised), each process runs the
column of one pipeline rank. With ``data_parallel=D`` the world of K·D processes is a
DeviceMesh of shape (pipeline K, data D); global rank g is pipeline rank g // D and
data replica g % D, so the replicas of a stage are neighbours (on one node when D
divides the GPUs per node) and pipeline hops cross nodes. Messages between the ranks
travel by :mod:`conveyor.distributed.p2p`.

With ``data_parallel=[r0, r1, ...]`` (PipeDream's replicated stages) the world of
r0 + r1 + ... processes is one pipeline in which stage s is held by r_s processes, the
global ranks numbered stage by stage; replica j of stage s runs the micro-batches m with
m % r_s == j (:class:`~conveyor.schedules.replicas.StageReplicas`), and the replicas of a
stage sum their gradients.

With ``tensor_parallel=T`` each stage's modules are split over T processes too
(:mod:`conveyor.tensor`): the world of K·D·T processes is a DeviceMesh of shape
(pipeline K, data D, tensor T), tensor innermost so a stage's tensor group stays on one
node's fast links: global rank g = (k·D + d)·T + t. Tensor rank t of stage k talks to
tensor rank t of stage k+1, and FSDP shards over the "data" dimension of each tensor
rank's own shards.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.errors import ConveyorError
from conveyor.schedules.replicas import StageReplicas

__all__: list[str] = []


@dataclass(frozen=True)
class Topology:
    """Where this process sits among the pipeline's processes.

    Attributes:
        pipeline_size: K, the number of pipeline ranks.
        data_size: D, the number of data-parallel replicas.
        pipeline_rank: k, this process's rank in its pipeline.
        data_rank: d, its replica.
        pipeline_ranks: the global ranks of this pipeline, by pipeline rank.
        pipeline_group: the process group of this pipeline (None in one process).
        data_group: the process group of this stage's replicas (None in one process).
        device: the device this process computes on (None in one process).
        mesh: the (pipeline, data) DeviceMesh (None in one process); FSDP shards
            over its "data" dimension.
        timeout: the seconds a collective of the groups made for the pipeline's
            replicas and ties may wait inside the backend (the pipeline's opening
            timeout), rather than torch's default of 30 minutes.
        replicas: replicated stages (None: none): the processes of the pipeline
            (``pipeline_size`` of them) hold its stages so, and stage s's
            ``replica_group`` sums their gradients.
        replica_group: the process group of this stage's replicas (None: not
            replicated, or only one).
        tensor_size: T, the processes each stage's modules are split over.
        tensor_rank: t, this process's part of its stage.
        tensor_group: the process group of this stage's T parts (None: T = 1).
    """

    pipeline_size: int
    data_size: int = 1
    pipeline_rank: int = 0
    data_rank: int = 0
    pipeline_ranks: tuple[int, ...] = ()
    pipeline_group: Any = None
    data_group: Any = None
    device: torch.device | None = None
    mesh: Any = None
    timeout: float | None = None
    replicas: StageReplicas | None = None
    replica_group: Any = None
    tensor_size: int = 1
    tensor_rank: int = 0
    tensor_group: Any = None

    @property
    def table_rank(self) -> int:
        """The rank of the schedule's table whose column (some of it, if the stages
        are replicated) this process runs."""
        if self.replicas is None:
            return self.pipeline_rank
        return self.replicas.place(self.pipeline_rank)[0]

    @property
    def stage_replicas(self) -> int:
        """How many processes of this pipeline hold this process's stage: its replicas
        under ``replicas``, else 1."""
        return 1 if self.replicas is None else self.replicas.counts[self.table_rank]

    def new_group(self, ranks: Sequence[int]) -> Any:
        """``dist.new_group(ranks)`` bounded by the pipeline's timeout."""
        timeout = None if self.timeout is None else datetime.timedelta(seconds=self.timeout)
        return dist.new_group(list(ranks), timeout=timeout)

    @property
    def distributed(self) -> bool:
        return self.pipeline_group is not None

    def global_rank(self, pipeline_rank: int) -> int:
        return self.pipeline_ranks[pipeline_rank]

    @classmethod
    def from_environment(cls, *, data_parallel: int | Sequence[int], stages: int | None,
                         timeout: float, tensor_parallel: int = 1) -> Topology | None:
        """The layout of an initialised (or torchrun-launched) world; None in one process.

        Raises:
            ConveyorError: the world size is not a multiple of ``data_parallel`` times
                ``tensor_parallel`` (or not the sum of its replicas per stage), or
                disagrees with ``stages``.
        """
        if tensor_parallel != 1:
            return cls._meshed(data_parallel, stages, timeout, tensor_parallel)
        if not dist.is_available():
            return None
        if not isinstance(data_parallel, int) and set(data_parallel) == {1}:
            data_parallel = 1  # one replica per stage: no replicas
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
                if data_parallel == 1:
                    return None
                if not isinstance(data_parallel, int):
                    raise ConveyorError(
                        f"data_parallel={list(data_parallel)} replicates stages over "
                        f"processes: launch {sum(data_parallel)} of them under torchrun "
                        "(in one process, give one replica per stage)")
            _join("nccl" if torch.cuda.is_available() else "gloo", timeout)
        if not isinstance(data_parallel, int):
            return cls._replicated(StageReplicas(tuple(data_parallel)), stages, timeout)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % data_parallel:
            raise ConveyorError(f"{world} processes cannot hold data_parallel={data_parallel} "
                                f"replicas of a pipeline; use a divisor of {world}")
        size = world // data_parallel
        if stages is not None and stages != size:
            raise ConveyorError(
                f"stages={stages} but the world of {world} processes with data_parallel="
                f"{data_parallel} makes pipelines of {size} ranks; launch "
                f"{stages * data_parallel} processes or pass stages={size}"
            )
        device = _process_device()
        mesh = _mesh(size, data_parallel, device, timeout)
        return cls(
            pipeline_size=size,
            data_size=data_parallel,
            pipeline_rank=rank // data_parallel,
            data_rank=rank % data_parallel,
            pipeline_ranks=tuple(k * data_parallel + rank % data_parallel for k in range(size)),
            pipeline_group=mesh.get_group("pipeline"),
            data_group=mesh.get_group("data"),
            device=device,
            mesh=mesh,
            timeout=timeout,
        )

    @classmethod
    def _meshed(cls, data_parallel: int | Sequence[int], stages: int | None, timeout: float,
                tensor_parallel: int) -> Topology:
        """The (pipeline, data, tensor) mesh of a world with ``tensor_parallel`` > 1."""
        if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ConveyorError(f"tensor_parallel={tensor_parallel!r}: give a positive integer")
        if not isinstance(data_parallel, int):
            raise ConveyorError(f"data_parallel={list(data_parallel)} (replicated stages) "
                                "with tensor_parallel is not supported; give an integer")
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
                raise ConveyorError(
                    f"tensor_parallel={tensor_parallel} splits each stage over processes: "
                    f"launch (stages x data_parallel x {tensor_parallel}) of them under "
                    "torchrun --nproc-per-node N")
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        world, rank = dist.get_world_size(), dist.get_rank()
        inner = data_parallel * tensor_parallel
        if world % inner or (stages is not None and stages * inner != world):
            raise ConveyorError(
                f"{world} processes cannot hold stages={stages} x data_parallel="
                f"{data_parallel} x tensor_parallel={tensor_parallel}; launch "
                f"{(stages or 1) * inner} processes, or sizes whose product is {world}")
        size = world // inner
        device = _process_device()
        mesh = _mesh(size, data_parallel, device, timeout, tensor_parallel)
        k, d, t = rank // inner, (rank // tensor_parallel) % data_parallel, rank % tensor_parallel
        return cls(
            pipeline_size=size, data_size=data_parallel, pipeline_rank=k, data_rank=d,
            pipeline_ranks=tuple((j * data_parallel + d) * tensor_parallel + t
                                 for j in range(size)),
            pipeline_group=mesh.get_group("pipeline"), data_group=mesh.get_group("data"),
            device=device, mesh=mesh, timeout=timeout, tensor_size=tensor_parallel,
            tensor_rank=t, tensor_group=mesh.get_group("tensor"))

    @classmethod
    def _replicated(cls, replicas: StageReplicas, stages: int | None,
                    timeout: float) -> Topology:
        """One pipeline of the whole world, its stages replicated as ``replicas`` says."""
        world, rank = dist.get_world_size(), dist.get_rank()
        counts = list(replicas.counts)
        if world != replicas.workers or stages not in (None, len(counts)):
            raise ConveyorError(
                f"data_parallel={counts} places {replicas.workers} processes on "
                f"{len(counts)} stages, but the world has {world} processes"
                f"{'' if stages in (None, len(counts)) else f' and stages={stages}'}; "
                f"launch {replicas.workers} processes (torchrun --nproc-per-node "
                f"{replicas.workers})")
        device = _process_device()
        topology = cls(pipeline_size=world, pipeline_ranks=tuple(range(world)),
                       pipeline_rank=rank, device=device, timeout=timeout, replicas=replicas)
        pipeline_group = topology.new_group(range(world))
        mine = None
        for stage, count in enumerate(counts):  # every process makes every group
            first = replicas.first(stage)
            group = topology.new_group(range(first, first + count)) if count > 1 else None
            if first <= rank < first + count:
                mine = group
        return dataclasses.replace(topology, pipeline_group=pipeline_group,
                                   replica_group=mine)


def _join(backend: str, timeout: float) -> None:
    """Opens the default process group, over within ``timeout`` (a silent store, a rank
    that never arrives: one line naming the address, never a hang).

    Raises:
        RendezvousError: it could not be joined in time.
    """
    from conveyor.distributed.faults.rendezvous import join

    join(backend, seconds=timeout, timeout=timeout)


def _process_device() -> torch.device:
    if dist.get_backend() == "nccl":
        index = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _mesh(pipeline: int, data: int, device: torch.device, timeout: float,
          tensor: int = 1) -> Any:
    """The (pipeline, data) DeviceMesh, or (pipeline, data, tensor) with ``tensor`` > 1
    (the tensor group's collectives bounded as the data group's). The data group's collectives (FSDP's among
    them, which conveyor does not wait on itself) are bounded by ``timeout`` inside the
    backend; the pipeline group's receives are waited on as long as the pipeline makes
    progress (:mod:`conveyor.engine.watchdog.liveness`), under torch's own bound."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = dist.get_backend()
    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
               else dist.ProcessGroupGloo._Options())  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=timeout)
    if tensor == 1:
        return init_device_mesh(device.type, (pipeline, data),
                                mesh_dim_names=("pipeline", "data"),
                                backend_override={"data": (backend, options)})
    return init_device_mesh(device.type, (pipeline, data, tensor),
                            mesh_dim_names=("pipeline", "data", "tensor"),
                            backend_override={"data": (backend, options),
                                              "tensor": (backend, options)})
