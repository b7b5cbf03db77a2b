""":func:`conveyor.check` across a torchrun job's processes: a pipeline whose stages are
split over tensor ranks (``tensor_parallel=T``), run as the job runs it and compared
with the plain model on rank 0.

Every rank calls ``check`` alike. Each builds its stages and its shards of them and is
watched as the threads of one process are (:class:`conveyor.checking.runs.PipelineRun`).
What each saw travels to rank 0 in one gather of plain data. There the parts of each
tensor group are put back whole: a split parameter's gradient from its shards, a value
the group holds apart (a column-parallel output) joined along the dimension that gives
the plain model's shape. Rank 0 compares, and hands the report, or the error, to every
rank.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from conveyor import errors
from conveyor.checking.causes import Program
from conveyor.checking.compare import Finding
from conveyor.checking.floor import Floor
from conveyor.checking.plain import Leaves, PlainRun
from conveyor.checking.report import CheckReport
from conveyor.checking.runs import Layer, PipelineRun
from conveyor.distributed.faults import collective
from conveyor.errors import ConfigError, ConveyorError
from conveyor.graph.weights import SHARD

__all__: list[str] = []

#: Rank 0 compares while the others wait: this many times the pipeline's opening wait.
_REPORT_WAIT = 10

#: Two tensor ranks' gradients of a weight the plan leaves whole differ when they are
#: further apart than this, relative to the larger (a sum over the group is alike on
#: every rank; a rank's own share is not).
_APART = 1e-9


def refuse_one_process(tensor_parallel: int, stages: int) -> None:
    """Raises unless this process is one rank of a torchrun job.

    Raises:
        ConfigError: the tensor-parallel check is called in one plain process.
    """
    if (dist.is_available() and dist.is_initialized()) or \
            int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    ranks = stages * tensor_parallel
    raise ConfigError(
        f"conveyor check with tensor_parallel={tensor_parallel} runs one process per rank, "
        f"as the job does: launch {ranks} of them ({stages} pipeline ranks x "
        f"{tensor_parallel} tensor ranks) under torchrun, each calling check alike "
        f"(torchrun --nproc-per-node {ranks} your_script.py, or torchrun --nproc-per-node "
        f"{ranks} -m conveyor check --tensor-parallel {tensor_parallel} ...)")


@dataclass
class Record:
    """What one rank saw of the step."""

    pipeline_rank: int
    tensor_rank: int
    layers: list[Layer]
    forward: dict[tuple[int, int], Leaves]
    recomputed: dict[tuple[int, int], Leaves]
    mutated: set[int]
    loss: torch.Tensor | None
    error: dict[str, Any] | None
    gradients: dict[str, tuple[torch.Tensor, tuple[int, int, int] | None]]
    buffers: dict[str, torch.Tensor]
    owners: dict[str, int]
    programs: dict[int, Program]


@dataclass
class Spread:
    """The whole job's run, put together on rank 0, and what its tensor groups hold apart.

    Attributes:
        run: the run as the comparison reads it (this rank's pipeline, every rank's
            layers, values and gradients).
        apart: outputs the ranks of a tensor group hold differently, by
            ("forward" | "recomputed", layer index, micro-batch): each rank's part, in
            tensor-rank order; :meth:`join` puts them together.
    """

    run: PipelineRun
    apart: dict[tuple[str, int, int], list[Leaves]] = field(default_factory=dict)

    def join(self, reference: PlainRun) -> None:
        """Puts each output held apart together along the dimension on which the parts
        make the plain model's shape (a column-parallel output: its last); where none
        does, the first rank's part stays, and the comparison names the shape."""
        for (kind, index, m), parts in self.apart.items():
            whole = dict(reference.outputs.get(index, []))
            joined: Leaves = []
            for n, (path, first) in enumerate(parts[0]):
                pieces = [part[n][1] for part in parts]
                want = whole.get(path)
                joined.append((path, _joined(pieces, want) if isinstance(want, torch.Tensor)
                               else first))
            taken = self.run.forward if kind == "forward" else self.run.recomputed
            taken[(index, m)] = joined


def on_rank_0(run: PipelineRun, compare: Callable[[Spread], CheckReport]) -> CheckReport:
    """Gathers every rank's :class:`Record` of ``run`` on rank 0, which puts them
    together and calls ``compare``; every rank returns the report it returned (or
    raises the error it raised).

    What crosses is plain data and tensors (read back with ``torch.load``'s
    ``weights_only``, the report as JSON): nothing a peer sends is run.
    """
    seconds = run.pipe.timeouts.opening
    blob = io.BytesIO()
    torch.save(_record(run), blob)
    blobs = collective.exchange_bytes(blob.getvalue(), group=None, seconds=seconds,
                                      what="the check's gathering of what each rank saw")

    def told(outcome: list[Any]) -> list[Any]:
        # Rank 0 runs the plain model twice meanwhile: the others wait for it that long.
        said: list[Any] = collective.exchange(outcome, group=None,
                                              seconds=_REPORT_WAIT * seconds,
                                              what="rank 0's report of the check")[0]
        return said

    if dist.get_rank() != 0:
        kind, value = told([])
    else:
        try:
            report = compare(_put_together(run.pipe, [_unpacked(b) for b in blobs]))
        except Exception as exc:
            told(["error", _error_data(exc)])
            raise
        kind, value = told(["report", _report_data(report)])
    if kind == "error":
        raise _error_from(value)
    return CheckReport(value["setup"], value["compared"],
                       [Finding(**finding) for finding in value["findings"]],
                       value["rtol"], Floor(**value["floor"]))


def _record(run: PipelineRun) -> dict[str, Any]:
    """What this rank saw, as plain data and tensors."""
    topology = run.pipe.topology
    return {
        "pipeline_rank": topology.pipeline_rank, "tensor_rank": topology.tensor_rank,
        "layers": [[x.index, x.name, x.stage, x.first, x.kind] for x in run.layers],
        "forward": list(run.forward.items()), "recomputed": list(run.recomputed.items()),
        "mutated": sorted(run.mutated),
        "loss": None if run.loss is None else run.loss.detach(),
        "error": None if run.error is None else _error_data(run.error),
        "gradients": {name: [run.gradients[name], list(getattr(param, SHARD, None) or [])]
                      for name, param in run.pipe.named_parameters()},
        "buffers": {name: b.detach() for name, b in run.buffers.items()},
        "owners": run.owners,
        "programs": {k: [sorted(p.made), [list(r) for r in p.returned]]
                     for k, p in run.programs.items()},
    }


def _unpacked(blob: bytes) -> Record:
    data = torch.load(io.BytesIO(blob), weights_only=True)
    shard = {name: (grad, tuple(where) if where else None)
             for name, (grad, where) in data["gradients"].items()}
    return Record(
        data["pipeline_rank"], data["tensor_rank"],
        [Layer(index, name, None, stage, first, kind)
         for index, name, stage, first, kind in data["layers"]],
        {tuple(key): value for key, value in data["forward"]},
        {tuple(key): value for key, value in data["recomputed"]},
        set(data["mutated"]), data["loss"], data["error"], shard, data["buffers"],
        data["owners"], {k: Program(frozenset(made), tuple(tuple(r) for r in returned))
                         for k, (made, returned) in data["programs"].items()})


def _report_data(report: CheckReport) -> dict[str, Any]:
    return {"setup": report.setup, "compared": report.compared, "rtol": report.rtol,
            "findings": [dataclasses.asdict(f) for f in report.findings],
            "floor": dataclasses.asdict(report.floor)}


#: A stage's failure, as plain data: its class's name, message and place.
_PLACE = ("stage", "microbatch", "action", "layer")


def _error_data(error: BaseException) -> dict[str, Any]:
    return {"type": type(error).__name__, "message": str(error),
            **{key: getattr(error, key) for key in _PLACE if hasattr(error, key)}}


def _error_from(data: dict[str, Any]) -> ConveyorError:
    """The error ``data`` describes: conveyor's own class of that name, else a
    ConveyorError that names the class."""
    kind = getattr(errors, data["type"], None)
    message = data["message"]
    if isinstance(kind, type) and issubclass(kind, errors.StageError):
        return kind(message, stage=data.get("stage", -1), microbatch=data.get("microbatch", -1),
                    action=data.get("action", ""), layer=data.get("layer"))
    if isinstance(kind, type) and issubclass(kind, ConveyorError) and \
            kind is not errors.VerificationError:
        return kind(message)
    return ConveyorError(f"{data['type']}: {message}")


def _put_together(pipe: Any, records: list[Record]) -> Spread:
    """One run of the whole job from every rank's record."""
    groups: dict[int, list[Record]] = {}
    for record in sorted(records, key=lambda r: (r.pipeline_rank, r.tensor_rank)):
        groups.setdefault(record.pipeline_rank, []).append(record)
    layers = {layer.index: layer for group in groups.values() for layer in group[0].layers}
    spread = Spread(PipelineRun(pipe, [layers[i] for i in sorted(layers)]))
    run = spread.run
    for group in groups.values():
        first = group[0]
        for kind, taken in (("forward", run.forward), ("recomputed", run.recomputed)):
            for key, value in getattr(first, kind).items():
                parts = [getattr(r, kind).get(key, value) for r in group]
                if all(_same(part, value) for part in parts):
                    taken[key] = value
                else:
                    spread.apart[(kind, key[0], key[1])] = parts
        for name, (grad, shard) in first.gradients.items():
            held = [r.gradients[name] for r in group]
            if shard is not None:  # (dim, index, parts): laid side by side by index
                held.sort(key=lambda part: part[1][1] if part[1] else 0)
                run.gradients[name] = torch.cat([g for g, _ in held], dim=shard[0])
                continue
            run.gradients[name] = grad
            if any(_far(grad, other) for other, _ in held[1:]):
                run.disagree[name] = first.owners.get(name, first.pipeline_rank)
        for record in group:
            run.mutated |= record.mutated
        run.buffers.update(first.buffers)
        run.owners.update(first.owners)
        run.programs.update(first.programs)
    held_apart = {index for _, index, _ in spread.apart}
    for before, layer in zip(run.layers, run.layers[1:]):
        if before.index in held_apart:
            run.split_inputs[layer.index] = f"the output of {before.describe()}"
    run.loss = next((r.loss for r in records if r.loss is not None), None)
    failed = [r.error for r in records if r.error is not None]
    # The rank where it began, rather than one that heard of it from a peer.
    began = next((e for e in failed if e["type"] != "PeerFailure"), failed[0] if failed else None)
    run.error = None if began is None else _error_from(began)
    return spread


def _same(a: Leaves, b: Leaves) -> bool:
    if [p for p, _ in a] != [p for p, _ in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _far(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return True
    if not a.numel():
        return False
    scale = max(float(a.abs().max()), float(b.abs().max()))
    return float((a - b).abs().max()) > _APART * scale


def _joined(pieces: list[Any], whole: torch.Tensor) -> Any:
    """The pieces joined along the last dimension but the batch's on which their sizes
    add up to ``whole``'s, every other dimension matching; the first piece where none
    does."""
    if not all(isinstance(p, torch.Tensor) and p.dim() == whole.dim() for p in pieces):
        return pieces[0]
    for dim in reversed(range(1, whole.dim())):
        others = [d for d in range(1, whole.dim()) if d != dim]
        if sum(p.shape[dim] for p in pieces) == whole.shape[dim] and all(
                p.shape[d] == whole.shape[d] for p in pieces for d in others):
            return torch.cat(pieces, dim=dim)
    return pieces[0]
