"""``conveyor plan --model package.module:function``: the plan of the user's own model.

The function takes no arguments and returns the model (built on the meta device where
it can: nothing is allocated), or ``(model, sample)`` with ``sample`` one batch as the
model takes it (a tensor, a tuple of positional arguments, a dict of keyword arguments;
any batch size, figures are per sample). Without a sample the model gets token ids of
``--length`` (``input_ids``, and ``use_cache=False`` where its forward takes it), as a
Hugging Face language model does. The model is cut at ``--split-at``, or into
``--stages`` stages where ``conveyor.Pipeline`` would cut it, and each stage's figures
come from tracing it (:func:`conveyor.observe.plan.measure_split`). With ``--stages K``
the V shapes (two stages per rank) are weighed too, on the model cut into 2K stages.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import sys
from typing import Any

import torch
from torch import nn

from conveyor.cli import tables
from conveyor.train.user.code import load_model
from conveyor.errors import ConfigError, ConveyorError
from conveyor.checking.plans import verify_plans
from conveyor.observe import plan as planning

__all__: list[str] = []

_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1))
#: Two stages per rank, in a V: weighed on the model cut into 2K stages (V-Half needs
#: K >= 2 ranks, V-Min K >= 3; rank_plans leaves out the sizes a schedule refuses).
_V_SCHEDULES = (("zb-v", 2), ("v-half", 2), ("v-min", 2))


def token_sample(model: nn.Module, length: int) -> Any:
    """Token ids of ``length`` for a model that takes them, on the model's device."""
    device = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device
    ids = torch.zeros(2, length, dtype=torch.long, device=device)  # 2: 1 would specialise
    arguments = inspect.signature(model.forward).parameters
    if "input_ids" not in arguments:
        return ids
    return {"input_ids": ids, **({"use_cache": False} if "use_cache" in arguments else {})}


def plan_model_command(args: argparse.Namespace) -> int:
    """The body of ``conveyor plan --model package.module:function``; bad options end it
    with one line on stderr and code 2."""
    try:
        return _plan_model(args)
    except ConveyorError as exc:
        print(f"conveyor plan: error: {exc}", file=sys.stderr)
        return 2


def _split_at(args: argparse.Namespace) -> tuple[list[str] | None, int]:
    """``--split-at`` as names, and the number of stages K.

    Raises:
        ConfigError: neither ``--split-at`` nor ``--stages``, or they disagree.
    """
    names = [n.strip() for n in args.split_at.split(",") if n.strip()] if args.split_at \
        else None
    if names is None:
        if args.devices is None:
            raise ConfigError("give --stages K (cut where Pipeline would) or --split-at "
                              "NAME,... (the submodules where stages 1.. begin)")
        return None, args.devices
    if args.devices is not None and args.devices != len(names) + 1:
        raise ConfigError(f"--split-at gives {len(names) + 1} stages but --stages is "
                          f"{args.devices}")
    return names, len(names) + 1


def _plan_model(args: argparse.Namespace) -> int:
    model, sample = load_model(args.model, choices="transformer, convnet, or ")
    split_at, ranks = _split_at(args)
    if sample is None:
        sample = token_sample(model, args.length)
    cuts = {ranks: _cut(args, model, sample, split_at, ranks)}  # figures by stage count
    memory = planning.parse_bytes(args.memory) if args.memory else math.inf
    weigh = functools.partial(planning.rank_plans, devices=ranks, memory=memory,
                              batch=args.batch, optimizer=args.optimizer,
                              rematerialize=not args.no_rematerialize,
                              flops_per_second=args.flops or 1e14, offload=args.offload)
    plans = weigh(cuts[ranks], schedules=_SCHEDULES)
    unweighed = ("they cut the model in 2K stages: give --stages K, not --split-at"
                 if split_at is not None else "")
    if split_at is None:
        try:
            cuts[2 * ranks] = _cut(args, model, sample, None, 2 * ranks)
        except ConveyorError as exc:  # too few blocks to cut it in 2K
            unweighed = f"cutting the model in {2 * ranks} stages: {exc}"
        else:
            plans += weigh(cuts[2 * ranks], schedules=_V_SCHEDULES)
    plans.sort(key=lambda p: (not p.fits, -p.throughput))  # as rank_plans ranks them
    if not plans:
        raise ConfigError(f"--batch {args.batch} allows no number of micro-batches")
    names = {stages: [f.name for f in figures] for stages, figures in cuts.items()}
    verdicts, unverified = _verify(args, model, sample, names, plans)
    kept = [p for p in plans if p.schedule not in verdicts or verdicts[p.schedule].exact]
    if not kept:
        print(f"conveyor plan: no schedule is computed exactly on {args.model}:",
              file=sys.stderr)
        for verdict in verdicts.values():
            print(f"  {verdict.schedule}: {verdict.reason}", file=sys.stderr)
        return 1
    _print_plan(args, model, names[len(kept[0].balance)], kept, memory, split_at is None,
                verdicts=verdicts, unverified=unverified, unweighed=unweighed)
    return 0


def _cut(args: argparse.Namespace, model: nn.Module, sample: Any,
         split_at: list[str] | None, stages: int) -> list[planning.LayerFigures]:
    """The figures of each of ``stages`` stages, cut at ``split_at`` or chosen (by
    parameters, or by time with ``--balance time``)."""
    if split_at is None and args.balance == "time":
        from conveyor.graph.autosplit import choose_split_at

        split_at = choose_split_at(model, stages, sample, by="time")
        args.chosen_by = "time"
    return planning.measure_split(model, sample, split_at=split_at, stages=stages)


def _verify(args: argparse.Namespace, model: nn.Module, sample: Any,
            names: dict[int, list[str]], plans: list[planning.Plan]
            ) -> tuple[dict[str, planning.Exactness], str]:
    """The verdicts of the top schedules (checked in order until one is exact, each on
    its own cut: ``names`` by stage count), or why none was checked."""
    command = f"conveyor check --model ... {_cut_flags(plans[0], names)} --schedule " \
              f"{plans[0].schedule}"
    if args.no_verify:
        return {}, f"not verified (--no-verify); run {command}"
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return {}, ("not verified: the model is on the meta device, with nothing to run; "
                    f"check a small build of it: {command}")
    mode = "never" if args.no_rematerialize else "except_last"
    found: dict[str, planning.Exactness] = {}
    for candidate in plans:
        if candidate.schedule in found:
            continue
        found.update(verify_plans(
            [candidate], model, sample, split_at=names[len(candidate.balance)][1:],
            recompute=mode,
            ranks=len(candidate.rank_bytes) if candidate.virtual_stages > 1 else None))
        if found[candidate.schedule].exact:
            break
    return found, ""


def _cut_flags(plan: planning.Plan, names: dict[int, list[str]]) -> str:
    """``--split-at`` of the plan's cut, and ``--stages K`` where a rank holds two."""
    split_at = ",".join(names[len(plan.balance)][1:])
    ranks = len(plan.rank_bytes)
    return (f"--stages {ranks} " if plan.virtual_stages > 1 else "") + f"--split-at {split_at}"


def _pipeline(args: argparse.Namespace, plan: planning.Plan,
              names: list[str]) -> dict[str, Any]:
    """The options of ``conveyor.Pipeline`` that run ``plan`` on the model."""
    options = {"stages": len(plan.rank_bytes), "split_at": names[1:],
               "schedule": plan.schedule, "chunks": plan.chunks,
               "recompute": "never" if not plan.rematerialize else "except_last"}
    return {**options, "offload": "activations"} if plan.offload else options


def _print_plan(args: argparse.Namespace, model: nn.Module, names: list[str],
                plans: list[planning.Plan], memory: float, chosen: bool, *,
                verdicts: dict[str, planning.Exactness], unverified: str,
                unweighed: str) -> None:
    """The plan: ``names`` are where the stages of the best plan's cut begin."""
    best = plans[0]
    parameters = sum(p.numel() for p in model.parameters())
    pairs = list(zip(names, best.stages, strict=True))
    excluded = [v for v in verdicts.values() if not v.exact]
    if args.json:
        rows = [{"begins_at": name, "parameters": s.parameters,
                 "parameter_bytes": s.parameter_bytes, "activation_bytes": s.activation_bytes,
                 "total_bytes": s.total_bytes} for name, s in pairs]
        print(json.dumps({"model": args.model, "class": type(model).__name__,
                          "parameters": parameters, "split_at": names[1:], "chosen": chosen,
                          "stages": rows, "best": best.summary(),
                          "options": [p.summary() for p in plans],
                          "verified": {v.schedule: {"exact": v.exact, "reason": v.reason}
                                       for v in verdicts.values()},
                          "unverified": unverified or None,
                          "pipeline": _pipeline(args, best, names),
                          "v_shapes_unweighed": unweighed or None}, indent=2))
        return
    per = planning.OPTIMIZER_BYTES[args.optimizer]
    how = (f"chosen by {getattr(args, 'chosen_by', 'parameters')}" if chosen else "as given")
    v_shape = (f" (two per rank on {len(best.rank_bytes)} ranks, in a V)"
               if best.virtual_stages > 1 else "")
    print(f"{args.model} ({type(model).__name__}): {parameters:,} parameters, {per} bytes "
          f"each with {args.optimizer}; {len(names)} stages{v_shape}, split at "
          f"{', '.join(names[1:])} "
          f"({how}); batch {args.batch}, re-materialization "
          f"{'off' if args.no_rematerialize else 'on'}")
    fit = ("memory per device not given (--memory): every plan counts as fitting"
           if math.isinf(memory) else
           f"{tables.size(memory)} per device: {'fits' if best.fits else 'does NOT fit'}")
    print(f"\nbest: {best.name}, {best.chunks} micro-batches; {fit}")
    if best.virtual_stages > 1 or best.offload:  # not the cut of --stages K, or offload
        options = ", ".join(f"{k}={v!r}" for k, v in _pipeline(args, best, names).items())
        print(f"run: conveyor.Pipeline(model, {options}, ...)")
    exact = verdicts.get(best.schedule)
    checked = f"yes, checked (conveyor check, float64): {exact.reason}" if exact else ""
    print(f"exact: {checked or unverified}")
    for verdict in excluded:
        print(f"excluded: {verdict.schedule}, not exact on this model: {verdict.reason}")
    print(tables.table(["", "begins at", "params", "param+opt", "activations", "total"],
                 [[f"stage {k}", name, f"{s.parameters:,}", tables.size(s.parameter_bytes),
                   tables.size(s.activation_bytes), tables.size(s.total_bytes)]
                  for k, (name, s) in enumerate(pairs)]))
    print("\nactivations: at the schedule's peak of micro-batches held per stage, from "
          "the traced stages' saved tensors; a weight tied across stages counts on each")
    print("\nschedules and micro-batches (simulated, fitting first; exact: checked on "
          "this model, ? not checked):")
    print(tables.table(["schedule", "M", "fits", "exact", "largest rank", "samples/s"],
                 [[p.name, str(p.chunks), "yes" if p.fits else "no",
                   "yes" if p.schedule in verdicts else "?",
                   tables.size(max(p.rank_bytes)), f"{p.throughput:.1f}"]
                  for p in plans[:args.top]]))
    if unweighed:
        print(f"not weighed: {', '.join(n for n, _ in _V_SCHEDULES)} (two stages per rank): "
              f"{unweighed}")
