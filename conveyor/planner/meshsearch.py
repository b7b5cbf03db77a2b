"""The search over meshes: every PP x TP x DP shape of a cluster's devices (TP inside a
node), sharding, schedule and micro-batch count, each costed by
:func:`conveyor.planner.mesh.evaluate_shape`; pipelines simulated only while their
bound could still beat what was found."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.errors import ConveyorError
from conveyor.observe.plan import OPTIMIZER_BYTES
from conveyor.planner.machines import Cluster
from conveyor.planner.mesh import (
    FLAT,
    MESH_SCHEDULES,
    SHARDINGS,
    MeshCandidate,
    Prefix,
    Shape,
    balanced,
    choose_recompute,
    costed,
    lower_bound,
    stage_costs,
)
from conveyor.planner.profiles import ModelProfile

__all__ = ["search_mesh", "shapes"]

_CHUNKS = (1, 2, 4, 8, 16, 32, 64, 128)


def shapes(cluster: Cluster, layers: int, *,
           shardings: Sequence[str] = SHARDINGS) -> list[Shape]:
    """Every mesh of all the cluster's devices: TP a divisor of the devices per node,
    at most as many stages as layers, both layouts of a pipeline with replicas."""
    per_node, devices = cluster.levels[0].size, cluster.devices
    found = []
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        for pp in (p for p in range(1, min(layers, devices // tp) + 1)
                   if devices // tp % p == 0):
            dp = devices // tp // pp
            for sharding in (shardings if dp > 1 else ("replicate",)):
                orders = ("pp-dp-tp", "dp-pp-tp") if pp > 1 and dp > 1 else ("pp-dp-tp",)
                found += [Shape(pp, tp, dp, sharding, order) for order in orders]
    return found


def search_mesh(profile: ModelProfile, cluster: Cluster, *, batch: int,
                optimizer: str = "adam", schedules: Sequence[str] = MESH_SCHEDULES,
                chunk_options: Sequence[int] | None = None,
                shardings: Sequence[str] = SHARDINGS, keep: int = 8) -> list[MeshCandidate]:
    """The candidates that fit, fastest first: for each shape and schedule the best
    micro-batch count. Every shape without a pipeline is counted; pipelines are
    simulated in the order of their lower bound until that bound is slower than the
    ``keep``-th best step found and than the best pipeline found.

    Raises:
        ConveyorError: an unknown optimizer or sharding, or an empty profile.
    """
    if optimizer not in OPTIMIZER_BYTES:
        raise ConveyorError(f"unknown optimizer {optimizer!r}; choose one of "
                            + ", ".join(OPTIMIZER_BYTES))
    if not profile.layers or set(shardings) - set(SHARDINGS):
        raise ConveyorError(f"a mesh needs a profile with layers and shardings among "
                            f"{SHARDINGS}; got {len(profile.layers)} layers, {list(shardings)}")
    prefix, cuts = Prefix.of(profile), {}
    found: dict[tuple[Shape, str], MeshCandidate] = {}
    waiting = []
    for shape in shapes(cluster, len(profile.layers), shardings=shardings):
        if shape.pp not in cuts:
            cuts[shape.pp] = balanced(profile, shape.pp)
        for schedule in (schedules if shape.pp > 1 else (FLAT,)):
            for chunks in chunk_options or _CHUNKS:
                if batch % (shape.dp * chunks):
                    continue
                micro = batch / shape.dp / chunks
                stages = stage_costs(prefix, cluster, shape, cuts[shape.pp], micro, schedule,
                                 chunks, optimizer)
                recompute = choose_recompute(stages, shape, schedule, chunks, micro,
                                       cluster.memory)
                if recompute is None:
                    continue
                job = (shape, schedule, chunks, stages, micro, recompute)
                if shape.pp == 1:
                    _keep(found, _run(job, cluster, cuts[shape.pp]))
                else:
                    waiting.append((lower_bound(stages, chunks, recompute), job))
    waiting.sort(key=lambda w: w[0])
    for bound, job in waiting:
        steps = sorted(c.predicted_step_s for c in found.values())
        best_pipeline = min((c.predicted_step_s for c in found.values() if c.pipelined),
                            default=float("inf"))
        if len(steps) >= keep and bound > steps[keep - 1] and bound > best_pipeline:
            break
        _keep(found, _run(job, cluster, cuts[job[0].pp]))
    return sorted(found.values(), key=lambda c: c.predicted_step_s)


def _run(job: tuple[Shape, str, int, list, float, bool], cluster: Cluster,
         balance: Sequence[int]) -> MeshCandidate | None:
    shape, schedule, chunks, stages, micro, recompute = job
    return costed(shape, schedule, chunks, stages, micro, recompute, cluster.memory,
                   tuple(balance))


def _keep(found: dict[tuple[Shape, str], MeshCandidate], candidate: MeshCandidate | None
          ) -> None:
    """Keeps the faster micro-batch count of each shape and schedule."""
    if candidate is None:
        return
    key = (candidate.shape, candidate.schedule)
    if key not in found or candidate.predicted_step_s < found[key].predicted_step_s:
        found[key] = candidate
