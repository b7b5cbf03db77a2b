"""Pipelines over processes: the layout of ranks, and a transport over torch.distributed.

Under torchrun (or once torch.distributed is initialised), each process runs the
column of one pipeline rank. With ``data_parallel=D`` the world of K·D processes is a
DeviceMesh of shape (pipeline K, data D); global rank g is pipeline rank g // D and
data replica g % D, so the replicas of a stage are neighbours (on one node when D
divides the GPUs per node) and pipeline hops cross nodes.

:class:`DistributedTransport` moves pytrees of tensors between ranks with point-to-point
ops. Receives are posted in the order the sender sends, which the receiver knows from
the table, so no message tags are needed (NCCL has none) and a message that arrives
before it is wanted waits in a stash. Each message starts with a header giving its
structure, shapes and dtypes, so a later batch with other shapes just works. A rank
that fails sends an abort record in place of its next message; a wait that exceeds
the timeout, or a peer that disappears, ends the step with an error that names the
rank, stage and micro-batch waited for.
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from conveyor.errors import ConveyorError, StageError
from conveyor.schedules import Action, Kind
from conveyor.transport import Aborted, LocalTransport, MessageKind

__all__ = ["DistributedTransport", "PeerFailure", "Topology"]


class PeerFailure(StageError):
    """Another rank failed, died or stopped answering; this rank stops too.

    Attributes:
        report: where the failure started (rank, stage, action, micro-batch, error),
            passed on unchanged when this rank tells its own peers.
    """

    report: dict[str, Any] | None = None


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
    """

    pipeline_size: int
    data_size: int = 1
    pipeline_rank: int = 0
    data_rank: int = 0
    pipeline_ranks: tuple[int, ...] = ()
    pipeline_group: Any = None
    data_group: Any = None
    device: torch.device | None = None

    @property
    def distributed(self) -> bool:
        return self.pipeline_group is not None

    def global_rank(self, pipeline_rank: int) -> int:
        return self.pipeline_ranks[pipeline_rank]

    @classmethod
    def from_environment(cls, *, data_parallel: int, stages: int | None,
                         timeout: float) -> Topology | None:
        """The layout of an initialised (or torchrun-launched) world; None in one process.

        Raises:
            ConveyorError: the world size is not a multiple of ``data_parallel``, or
                disagrees with ``stages``.
        """
        if not dist.is_available():
            return None
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and data_parallel == 1:
                return None
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
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
        groups = _mesh_groups(size, data_parallel, device)
        return cls(
            pipeline_size=size,
            data_size=data_parallel,
            pipeline_rank=rank // data_parallel,
            data_rank=rank % data_parallel,
            pipeline_ranks=tuple(k * data_parallel + rank % data_parallel for k in range(size)),
            pipeline_group=groups[0],
            data_group=groups[1],
            device=device,
        )


def _process_device() -> torch.device:
    if dist.get_backend() == "nccl":
        index = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _mesh_groups(pipeline: int, data: int, device: torch.device) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (pipeline, data), mesh_dim_names=("pipeline", "data"))
    return mesh.get_group("pipeline"), mesh.get_group("data")


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sits in a message's structure, and what to receive for it."""

    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool


class DistributedTransport:
    """Point-to-point delivery between the ranks of one pipeline.

    Args:
        topology: this process's place; its pipeline group carries the messages.
        stage_ranks: the pipeline rank of each stage.
        devices: the device of each stage held here.
        timeout: seconds any single wait may take.
    """

    def __init__(self, topology: Topology, stage_ranks: Sequence[int],
                 devices: Mapping[int, torch.device], timeout: float) -> None:
        self.topology = topology
        self.stage_ranks = list(stage_ranks)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = topology.device or torch.device("cpu")
        self.local = LocalTransport([devices.get(s, self.device)
                                     for s in range(len(self.stage_ranks))])
        self._expected: dict[int, list[tuple[str, int, int]]] = {}
        self._position: dict[int, int] = {}
        self._peers: set[int] = set()
        self._stash: dict[tuple[str, int, int], Any] = {}
        self._sends: list[tuple[Any, list[torch.Tensor]]] = []
        self._aborted = False

    def prepare(self, columns: Mapping[int, Sequence[Action]]) -> None:
        """Learns, from every rank's column, the order in which each peer sends to us."""
        me = self.topology.pipeline_rank
        self._expected = {}
        for rank, column in columns.items():
            if rank == me:
                continue
            incoming = [key for action in column
                        for key, destination in [self._message_of(action)]
                        if destination == me]
            if incoming:
                self._expected[rank] = incoming
        self._position = dict.fromkeys(self._expected, 0)
        outgoing = {destination for action in columns.get(me, ())
                    for _, destination in [self._message_of(action)]
                    if destination is not None and destination != me}
        self._peers = set(self._expected) | outgoing

    def _message_of(self, action: Action) -> tuple[tuple[str, int, int], int | None]:
        """What ``action`` sends, and to which pipeline rank (None: nothing)."""
        s, m = action.stage, action.microbatch
        if action.kind is Kind.FORWARD and s + 1 < len(self.stage_ranks):
            return ("activation", s + 1, m), self.stage_ranks[s + 1]
        if action.kind is Kind.BACKWARD and s > 0:
            return ("gradient", s - 1, m), self.stage_ranks[s - 1]
        return ("", -1, -1), None

    def reset(self) -> None:
        self.local.reset()
        self._stash.clear()
        self._aborted = False

    def send(self, kind: MessageKind, stage: int, microbatch: int, value: Any) -> None:
        destination = self.stage_ranks[stage]
        if destination == self.topology.pipeline_rank:
            self.local.send(kind, stage, microbatch, value)
            return
        tensors: list[torch.Tensor] = []

        def slot(t: torch.Tensor) -> _Slot:
            tensors.append(t.detach().contiguous())
            return _Slot(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.requires_grad)

        skeleton = pytree.tree_map_only(torch.Tensor, slot, value)
        header = pickle.dumps(((kind, stage, microbatch), skeleton))
        self._isend(self.topology.global_rank(destination), header, tensors)

    def _isend(self, peer: int, header: bytes, tensors: list[torch.Tensor],
               length: int | None = None) -> None:
        size = torch.tensor([len(header) if length is None else length], dtype=torch.int64,
                            device=self.device)
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
        parts = [size, body, *tensors]
        for part in parts:
            work = dist.isend(part, peer, group=self.topology.pipeline_group)
            self._sends.append((work, parts))
        self._reap()

    def _reap(self) -> None:
        self._sends = [(w, p) for w, p in self._sends if not w.is_completed()]

    def recv(self, kind: MessageKind, stage: int, microbatch: int) -> Any:
        source_stage = stage - 1 if kind == "activation" else stage + 1
        source = self.stage_ranks[source_stage]
        if source == self.topology.pipeline_rank:
            return self.local.recv(kind, stage, microbatch)
        key = (kind, stage, microbatch)
        what = f"the {kind} of micro-batch {microbatch} from stage {source_stage} (rank {source})"
        while key not in self._stash:
            expected = self._expected.get(source, [])
            position = self._position.get(source, 0)
            if position >= len(expected):
                raise ConveyorError(f"rank {source} never sends {what} in this table")
            arrived, value = self._receive(source, what)
            if arrived != expected[position]:
                raise ConveyorError(f"expected {expected[position]} from rank {source}, "
                                    f"got {arrived}: the ranks run different tables")
            self._position[source] = position + 1
            self._stash[arrived] = value
        return self._stash.pop(key)

    def _receive(self, source: int, what: str) -> tuple[tuple[str, int, int], Any]:
        peer = self.topology.global_rank(source)
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(size, peer, group=self.topology.pipeline_group), what)
        length = int(size.item())
        body = torch.empty(abs(length), dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(body, peer, group=self.topology.pipeline_group), what)
        if length < 0:
            report = pickle.loads(body.cpu().numpy().tobytes())
            failure = PeerFailure(
                f"rank {report['rank']} failed ({report['error']}); rank "
                f"{self.topology.pipeline_rank} stopped waiting for {what}",
                stage=report["stage"], microbatch=report["microbatch"], action=report["action"],
            )
            failure.report = report
            raise failure
        key, skeleton = pickle.loads(body.cpu().numpy().tobytes())

        def fill(slot: _Slot) -> torch.Tensor:
            tensor = torch.empty(slot.shape, dtype=getattr(torch, slot.dtype),
                                 device=self.device)
            self._wait(dist.irecv(tensor, peer, group=self.topology.pipeline_group), what)
            return tensor.requires_grad_() if slot.requires_grad else tensor

        return key, pytree.tree_map_only(_Slot, fill, skeleton)

    def _wait(self, work: Any, what: str) -> None:
        if self._aborted:
            raise Aborted(what)
        try:
            work.wait(self.timeout)
        except Exception as exc:  # gloo/nccl report timeouts and lost peers as RuntimeError
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            reason = (f"timed out after {self.timeout.total_seconds():g} s" if timed_out
                      else f"lost its peer ({text})")
            raise PeerFailure(
                f"rank {self.topology.pipeline_rank} {reason} waiting for {what}; that rank "
                "may have failed or be stuck",
                stage=-1, microbatch=-1, action="recv",
            ) from exc

    def abort(self, error: BaseException | None) -> None:
        """Tells every peer that sends to or receives from us that this rank stopped."""
        self.local.abort(error)
        if self._aborted:
            return
        self._aborted = True
        report = getattr(error, "report", None)  # a failure elsewhere: pass it on as is
        if report is None:
            text = (f"{type(error).__name__}: {error}".splitlines()[0] if error is not None
                    else "interrupted")
            report = {"rank": self.topology.pipeline_rank, "error": text,
                      "stage": getattr(error, "stage", -1),
                      "microbatch": getattr(error, "microbatch", -1),
                      "action": getattr(error, "action", "?")}
        header = pickle.dumps(report)
        for rank in sorted(self._peers):
            try:
                self._isend(self.topology.global_rank(rank), header, [], length=-len(header))
            except Exception:  # noqa: BLE001 - the peer may be gone; keep telling the rest
                pass

    def finish(self) -> None:
        """Waits until every message this rank sent has been taken by its receiver."""
        for work, _ in self._sends:
            self._wait(work, "a peer to receive what this rank sent")
        self._sends = []
