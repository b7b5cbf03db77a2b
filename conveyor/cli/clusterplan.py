"""``conveyor plan`` with a cluster (``--topology FILE``, ``--nodes``/``--per-node`` and
bandwidths, or ``--topology detect``): PipeDream's planner on a family or the user's model.

The model's profile comes from its FLOP counts on the meta device (a family, or a model
built there) or from a short timed run (the user's model on a device, cached with
``--profile-cache``); :func:`conveyor.planner.solve` cuts, replicates and schedules it on
the cluster under its memory; the user's runnable model has the best plans' schedules
checked with ``conveyor check`` before one is recommended, as without a cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from conveyor.cli import tables
from conveyor.errors import ConfigError, ConveyorError, TensorParallelError
from conveyor.observe.plan import parse_bytes
from conveyor.planner import Cluster, ModelProfile, PipelinePlan, profile_model, solve
from conveyor.planner.mesh import MeshCandidate
from conveyor.planner.meshsearch import search_mesh
from conveyor.planner.verdict import Verdict, decide
from conveyor.tensor.plan import resolve_plan

__all__: list[str] = []

#: The FLOP/s of one device when neither --flops nor the cluster's file says.
DEFAULT_FLOPS = 1e14


def wants_cluster(args: argparse.Namespace) -> bool:
    return bool(args.topology or args.nodes or args.per_node)


def cluster_of(args: argparse.Namespace) -> Cluster:
    """The cluster the flags describe: a file (or ``detect``) with ``--memory`` and
    ``--flops`` given beside it overriding its figures (:func:`overrides` says which).

    Raises:
        ConfigError: neither a file nor the sizes, a figure missing or unreadable, or
            a flag of the cluster's shape (``--nodes``, ``--per-node``, bandwidths,
            latencies) given beside a file, which would be ignored.
    """
    if args.topology:
        given = [flag for flag, value in _shape_flags(args) if value is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} given beside --topology {args.topology}: the file "
                "says the nodes, devices and links; edit the file, or drop --topology "
                "and describe the cluster by flags (--memory and --flops may stand "
                "beside a file: they override its figures)")
        cluster = Cluster.detect() if args.topology == "detect" else Cluster.load(args.topology)
        try:
            memory = parse_bytes(args.memory) if args.memory else cluster.memory
        except ValueError as exc:
            raise ConfigError(f"--memory {args.memory}: {exc}") from None
        return replace(cluster, memory=memory, flops=args.flops or cluster.flops)
    missing = [flag for flag, value in (("--per-node", args.per_node), ("--memory", args.memory),
                                        ("--intra-bandwidth", args.intra_bandwidth))
               if value is None]
    if missing:
        raise ConfigError(f"a cluster by flags needs {', '.join(missing)} (or give "
                          "--topology FILE, or --topology detect)")
    try:
        return Cluster.of(nodes=args.nodes or 1, per_node=args.per_node, memory=args.memory,
                          intra=args.intra_bandwidth, inter=args.inter_bandwidth,
                          intra_latency=args.intra_latency or 0.0,
                          inter_latency=args.inter_latency or 0.0,
                          flops=args.flops or DEFAULT_FLOPS)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _shape_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    return [("--nodes", args.nodes), ("--per-node", args.per_node),
            ("--intra-bandwidth", args.intra_bandwidth),
            ("--inter-bandwidth", args.inter_bandwidth),
            ("--intra-latency", args.intra_latency), ("--inter-latency", args.inter_latency)]


def overrides(args: argparse.Namespace, cluster: Cluster) -> list[str]:
    """What flags given beside ``--topology FILE`` changed in the file's cluster, as
    the output says it (empty without a file or without such flags)."""
    if not args.topology:
        return []
    found = [] if args.memory is None else [
        f"--memory {args.memory} ({cluster.memory / 1e9:.3g} GB per device) overrides "
        f"the memory of --topology {args.topology}"]
    if args.flops is not None:
        found.append(f"--flops {args.flops:g} overrides the flops of --topology "
                     f"{args.topology}")
    return found


def plan_cluster_command(args: argparse.Namespace) -> int:
    """The body of ``conveyor plan`` with a cluster; bad options end it with one line on
    stderr and code 2."""
    try:
        return _plan(args)
    except ConveyorError as exc:
        print(f"conveyor plan: error: {exc}", file=sys.stderr)
        return 2


def _profile(args: argparse.Namespace, cluster: Cluster) -> tuple[ModelProfile, Any, Any]:
    """The model's profile, and the model and sample to check plans on (None: a family,
    or a model on the meta device)."""
    if args.model in ("transformer", "convnet"):
        from conveyor.train import models

        if args.model == "transformer":
            figures = models.transformer_figures(args.layers, args.d_model, args.d_ff,
                                                 args.heads, vocab=args.vocab,
                                                 length=args.length)
        else:
            figures = models.convnet_figures(args.layers, args.channels, image=args.image,
                                             classes=args.classes)
        return ModelProfile.from_figures(figures, flops=cluster.flops, name=args.model), \
            None, None
    from conveyor.cli.modelplan import load_model, token_sample

    model, sample = load_model(args.model)
    if sample is None:
        sample = token_sample(model, args.length)
    split_at = [n.strip() for n in args.split_at.split(",")] if args.split_at else None
    profile = profile_model(model, sample, name=args.model, split_at=split_at,
                            cache=args.profile_cache, flops=cluster.flops,
                            tp_plan=_own_tp_plan(model))
    runnable = not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return profile, (model if runnable else None), sample


def _own_tp_plan(model: Any) -> str | None:
    """"auto" for a model that carries a tensor-parallel plan conveyor takes (Hugging
    Face's): the profile then counts the all-reduces it runs; None otherwise (the mesh
    planner assumes Megatron's)."""
    try:
        resolve_plan(model, "auto")
    except TensorParallelError:
        return None
    return "auto"


def _plan(args: argparse.Namespace) -> int:
    cluster = cluster_of(args)
    profile, model, sample = _profile(args, cluster)
    plans = solve(profile, cluster, batch=args.batch, optimizer=args.optimizer,
                  replicate=not args.no_replicas, uniform_replicas=args.uniform_replicas,
                  max_stages=args.devices, keep=args.top)
    mesh = search_mesh(profile, cluster, batch=args.batch, optimizer=args.optimizer,
                       keep=args.top)
    verdict = decide(profile, cluster, mesh, batch=args.batch, optimizer=args.optimizer)
    if not plans:
        print(f"conveyor plan: nothing fits: {profile.name} on {cluster.describe()} with "
              f"batch {args.batch} (memory per device is the limit; more devices, a smaller "
              "batch or a lighter optimizer may fit)", file=sys.stderr)
        return 1
    verdicts: dict[str, Any] = {}
    if model is not None and not args.no_verify:
        from conveyor.checking.plans import verify_plans

        by_cut = plans[0].cut()
        if "split_at" in by_cut:
            verdicts = verify_plans(plans, model, sample, split_at=by_cut["split_at"],
                                    recompute=plans[0].recompute)
            plans = [p for p in plans
                     if p.schedule not in verdicts or verdicts[p.schedule].exact] or plans
    if args.save:
        plans[0].save(args.save)
    if args.json:
        print(json.dumps({"cluster": cluster.to_dict(), "overrides": overrides(args, cluster),
                          "profile": profile.source,
                          "verdict": verdict.to_dict() if verdict else None,
                          "candidates": [c.to_dict() for c in mesh],
                          "best": plans[0].to_dict(),
                          "options": [p.to_dict() for p in plans],
                          "verified": {s: {"exact": v.exact, "reason": v.reason}
                                       for s, v in verdicts.items()}}, indent=1))
        return 0
    _print(args, cluster, profile, plans, verdicts)
    _print_mesh(args, verdict, mesh)
    return 0


def _print(args: argparse.Namespace, cluster: Cluster, profile: ModelProfile,
           plans: list[PipelinePlan], verdicts: dict[str, Any]) -> None:
    parameters = sum(layer.parameters for layer in profile.layers)
    count = f"{parameters / 1e9:.3g}B" if parameters >= 1e9 else f"{parameters / 1e6:.3g}M"
    print(f"{profile.name}: {len(profile.layers)} layers, {count} parameters "
          f"({profile.source}); batch {args.batch}, {args.optimizer}")
    print(f"cluster: {cluster.describe()}")
    for note in overrides(args, cluster):
        print(f"  {note}")
    print()
    print(plans[0].describe())
    verdict = verdicts.get(plans[0].schedule)
    if verdict is not None:
        print(f"exact: yes, checked (conveyor check, float64): {verdict.reason}")
    for schedule, excluded in verdicts.items():
        if not excluded.exact:
            print(f"excluded: {schedule}, not exact on this model: {excluded.reason}")
    if args.save:
        print(f"\nsaved to {args.save}: conveyor.Pipeline(model, plan=conveyor.planner."
              f"PipelinePlan.load({args.save!r}), loss_fn=...)")
    if len(set(plans[0].replicas)) > 1:
        print(f"run it under torchrun with {plans[0].devices} processes: stage s on "
              "replicas[s] of them, numbered stage by stage")
    print("\nthe fastest plans (simulated; replicas per stage, peak memory per device):")
    print(tables.table(["schedule", "M", "stages", "replicas", "step", "samples/s", "peak"],
                       [[p.schedule, str(p.chunks), str(len(p.stages)),
                         "-".join(map(str, p.replicas)), f"{p.step_time * 1e3:.4g} ms",
                         f"{p.throughput:.4g}", tables.size(p.peak_memory)]
                        for p in plans[:args.top]]))


def _print_mesh(args: argparse.Namespace, verdict: Verdict | None,
                mesh: list[MeshCandidate]) -> None:
    """The verdict on pipelining at all, with its reasons, and the fastest meshes."""
    if verdict is None:
        print("\nno mesh (PP x TP x DP) fits the memory")
        return
    print(f"\nverdict: {verdict.headline()}")
    for reason in verdict.reasons:
        print(f"  {reason}")
    print("\nthe fastest meshes (PP x TP x DP, TP inside a node; layout: outermost "
          "dimension first; predicted step and peak memory per rank):")
    print(tables.table(
        ["kind", "PP", "TP", "DP", "sharding", "layout", "schedule", "M", "step", "peak"],
        [[c.shape.kind, str(c.shape.pp), str(c.shape.tp), str(c.shape.dp), c.shape.sharding,
          c.shape.order,
          c.schedule if c.pipelined else "-", str(c.chunks),
          f"{c.predicted_step_s * 1e3:.4g} ms", tables.size(c.peak_memory_bytes)]
         for c in mesh[:args.top]]))
