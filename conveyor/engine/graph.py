"""Any ``nn.Module`` as stages: traced with torch.export, cut at named submodules.

``split_model(model, sample, split_at=["model.layers.2"])`` traces the model's forward
on a sample micro-batch (``torch.export``, non-strict: the model's own Python runs, on
fake tensors, so shape logic such as a rotary embedding's is evaluated rather than
traced symbolically), in training and in eval mode. Every operation of the graph knows
the module it ran in; stage k begins at the first operation inside ``split_at[k-1]``
(torch's ``SplitPoint.BEGINNING``). Each stage becomes a :class:`~conveyor.engine.graphstage.GraphStage`,
a layer that conveyor's engine runs like any other:

* stage 0 takes the micro-batch as the model takes it (a tensor, a tuple of positional
  arguments or a dict of keyword arguments); a later stage takes a dict of the values
  made before it that it uses, and returns the dict of the values it makes that later
  stages use;
* the last stage returns what the model returns (a tensor, tuple, dict, ``ModelOutput``);
* parameters and buffers stay the model's own objects, under the model's own names; a
  parameter used by several stages (tied embeddings) becomes a copy per stage, under
  the other names it has in the model, and :mod:`conveyor.engine.ties` keeps the copies
  equal;
* batch norm's running statistics update as in the plain model, once per micro-batch
  (a recomputation works on copies); where torch.export turns an update into a new
  value, that value replaces the buffer after the forward.

A value made on stage i and used on stage j > i + 1 (a long skip connection, an
attention mask, rotary ``cos``/``sin``, position ids) goes from i to j directly, once per
micro-batch: the cut gives the pipeline these *edges* (``SplitModel.edges``), which the
schedule table carries, so that runtimes, validator and simulator know the messages. A
value used by several later stages is sent to each. The model's inputs are stage 0's:
it sends those a later stage uses, like the values it makes. An edge whose values cannot
carry a gradient (integer masks and ids, or values that depend on no parameter and no
floating input, as a causal mask or rotary tables) has ``gradient=False``, and no
gradient comes back over it::

    U-Net cut at ["up2", "up1"]    stage 0: down1, down2, middle ---+
                                      |                             |  first
                                   stage 1: up2                     |  (edge 0->2: not
                                      |                             |  through stage 1)
                                   stage 2: up1(x, first) <---------+
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from conveyor.engine.graphstage import Binding, GraphStage, Plan, StageProgram, as_call
from conveyor.engine.ties import TiedParameter
from conveyor.errors import BalanceError, ModelError
from conveyor.schedules import Edge

__all__: list[str] = []


def trace(model: nn.Module, sample: Any) -> ExportedProgram:
    """``model``'s forward on ``sample`` as an exported graph, every tensor dimension of
    the inputs left free (export fixes those the model's code depends on).

    Raises:
        ModelError: torch.export cannot trace the model; the message says why and what
            helps.
    """
    args, kwargs = as_call(sample)

    def free(leaf: Any) -> Any:
        return ({d: Dim.AUTO for d in range(leaf.dim())} if isinstance(leaf, torch.Tensor)
                else None)

    try:
        arguments = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise ModelError(f"the sample does not fit {type(model).__name__}.forward: {exc}; "
                         "pass a tensor, a tuple of positional arguments or a dict of "
                         "keyword arguments") from None
    dynamic = {name: pytree.tree_map(free, value) for name, value in arguments.items()}
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # noqa: BLE001 - explained and re-raised
        raise ModelError(
            f"conveyor traces the model with torch.export to split it, and tracing "
            f"{type(model).__name__} on the sample failed: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
            "hint: run torch.export.export(model, args, kwargs, strict=False) on the sample "
            "to see where; data-dependent Python control flow (an `if` on a tensor's "
            "values) cannot be traced: move it out of forward, or give the model as an "
            "nn.Sequential with balance="
        ) from exc


@dataclass
class SplitModel:
    """A model cut into stages: the stages, and what the pipeline must know of them.

    Attributes:
        stages: one :class:`GraphStage` per stage, in order.
        ties: parameters used by several stages, with their copies.
        edges: values sent from a stage straight to a later one past the next (in
            training or in eval mode); the schedule table must carry them.
        names: the names of the stages (layer names for the engine).
    """

    stages: list[GraphStage]
    ties: list[TiedParameter] = field(default_factory=list)
    edges: tuple[Edge, ...] = ()

    @property
    def names(self) -> list[str]:
        return [f"stage{k}" for k in range(len(self.stages))]


def split_model(model: nn.Module, sample: Any, split_at: Sequence[str],
                devices: Sequence[torch.device]) -> SplitModel:
    """Traces ``model`` on ``sample`` (one micro-batch) in training and eval mode and
    cuts it at ``split_at``, placing stage k on ``devices[k]``.

    Raises:
        ModelError: a name in ``split_at`` is not a submodule, is never called, or comes
            out of order; tracing failed.
        BalanceError: ``devices`` does not give one device per stage.
    """
    split_at = list(split_at)
    stages = len(split_at) + 1
    if len(devices) != stages:
        raise BalanceError(f"split_at gives {stages} stages but devices lists "
                           f"{len(devices)}; give one device per stage")
    for name in split_at:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ModelError(f"split_at names {name!r}, which is not a submodule of "
                             f"{type(model).__name__}; use names from "
                             "model.named_modules()") from None
    was_training = model.training
    plans = {}
    try:
        for training in (True, False):
            model.train(training)
            plans[training] = _cut(trace(model, sample), split_at, stages)
    finally:
        model.train(was_training)
    aliases = _aliases(model)
    originals = dict(model.named_parameters(remove_duplicate=False))
    split = SplitModel([GraphStage(k, stages) for k in range(stages)])
    tied_copies: dict[tuple[int, int], tuple[nn.Module, str]] = {}
    for training, plan in plans.items():
        for k, stage in enumerate(split.stages):
            bindings = _bind(model, plan, k, devices[k], originals, aliases, tied_copies,
                             split.ties)
            stage.programs[training] = StageProgram(model, plan, k, stages, bindings)
    split.edges = _edges(plans.values())
    return split


def _edges(plans: Any) -> tuple[Edge, ...]:
    """The edges of every plan (both modes), each carrying gradients if it does in one."""
    gradient: dict[tuple[int, int], bool] = {}
    for plan in plans:
        for source, destinations in enumerate(plan.sends):
            for destination, nodes in destinations.items():
                if destination > source + 1:
                    carries = any(node in plan.differentiable for node in nodes)
                    gradient[(source, destination)] = (
                        gradient.get((source, destination), False) or carries)
    return tuple(Edge(i, j, g) for (i, j), g in sorted(gradient.items()))


def _cut(program: ExportedProgram, split_at: list[str], stages: int) -> Plan:
    """Assigns every operation of ``program`` to a stage, and finds what crosses."""
    graph = program.graph
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            stage_of[node] = stages - 1
            continue
        paths = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        while current < len(split_at) and any(
                p == split_at[current] or p.startswith(split_at[current] + ".") for p in paths):
            current += 1
        stage_of[node] = current
    if current < len(split_at):
        reached = f"after {split_at[current - 1]!r}" if current else "at all"
        raise ModelError(
            f"split_at names {split_at[current]!r}, but the traced forward never runs it "
            f"{reached}; list split_at in the order the model runs the submodules, and "
            "only submodules that forward calls")
    inputs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    produced: dict[fx.Node, int] = {}  # user inputs: stage 0; parameters etc.: -1
    uses: dict[str, set[int]] = {}
    used_on: dict[fx.Node, set[int]] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            produced[node] = 0 if inputs[node.name].kind == InputKind.USER_INPUT else -1
            continue
        produced[node] = stage_of[node]
        for used in _inputs(node, program):
            if produced[used] == -1:
                uses.setdefault(used.name, set()).add(stage_of[node])
            else:
                used_on.setdefault(used, set()).add(stage_of[node])
    live_in: list[list[fx.Node]] = [[] for _ in range(stages)]
    sends: list[dict[int, list[fx.Node]]] = [{} for _ in range(stages)]
    for node in graph.nodes:  # in graph order
        for k in sorted(used_on.get(node, ())):
            if k > produced[node]:  # straight from the stage that makes it
                live_in[k].append(node)
                sends[produced[node]].setdefault(k, []).append(node)
    fixed_sizes = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(n for n in graph.nodes if n.name == spec.arg.name).meta.get("val")
            fixed_sizes.append({d: size for d, size in enumerate(getattr(value, "shape", ()))
                                if isinstance(size, int)})
    return Plan(program, stage_of, live_in, uses, fixed_sizes, sends,
                _differentiable(program))


def _inputs(node: fx.Node, program: ExportedProgram) -> list[fx.Node]:
    """The values ``node`` reads; of the graph's output, the model's outputs alone (a
    buffer's new value is the business of the stage that computes it)."""
    if node.op != "output":
        return node.all_input_nodes
    returned = node.args[0]
    assert isinstance(returned, (tuple, list))
    return [value for spec, value in zip(program.graph_signature.output_specs, returned)
            if spec.kind == OutputKind.USER_OUTPUT and isinstance(value, fx.Node)]


def _floating(value: Any) -> bool:
    """Whether a traced value is (or holds) a floating tensor; unknown values count."""
    if value is None:
        return True
    if isinstance(value, (tuple, list)):
        return any(_floating(v) for v in value)
    return isinstance(value, torch.Tensor) and (value.dtype.is_floating_point
                                                or value.dtype.is_complex)


def _differentiable(program: ExportedProgram) -> set[fx.Node]:
    """The values that may carry a gradient: floating tensors that depend on a parameter
    or a floating input of the user (whether it requires grad or not: a frozen
    parameter's values are counted, which costs an empty gradient message at most)."""
    kinds = {spec.arg.name: spec.kind for spec in program.graph_signature.input_specs}
    found: set[fx.Node] = set()
    for node in program.graph.nodes:
        if not _floating(node.meta.get("val")):
            continue
        if node.op == "placeholder":
            if kinds[node.name] in (InputKind.PARAMETER, InputKind.USER_INPUT):
                found.add(node)
        elif any(used in found for used in node.all_input_nodes):
            found.add(node)
    return found


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter and buffer object of ``model``."""
    found: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        found.setdefault(id(tensor), []).append(name)
    return found


def _bind(model: nn.Module, plan: Plan, k: int, device: torch.device,
          originals: Mapping[str, torch.Tensor], aliases: dict[int, list[str]], tied_copies: dict[tuple[int, int], tuple[nn.Module, str]],
          ties: list[TiedParameter]) -> list[Binding]:
    """Stage k's parameters, buffers and constants, placed on ``device``; a parameter a
    lower stage uses too gets a copy here, under another of its names."""
    bindings = []
    for spec in plan.program.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT or k not in plan.uses.get(name, ()):
            continue
        if spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            value = plan.program.constants[spec.target]
            if isinstance(value, torch.Tensor):
                value = value.to(device)
            bindings.append(Binding(name, "constant", None, "", value))
            continue
        owner_name, _, attribute = spec.target.rpartition(".")
        owner = model.get_submodule(owner_name)
        if spec.kind == InputKind.BUFFER:
            buffer = getattr(owner, attribute)
            if buffer.device != device:
                owner._buffers[attribute] = buffer.to(device)
            bindings.append(Binding(name, "buffer", owner, attribute))
            continue
        tensor = originals[spec.target]
        if min(plan.uses[name]) == k:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)
            # Under a name that still holds it (a tie's other names may hold copies).
            held_as = next(n for n in aliases[id(tensor)] if model.get_parameter(n) is tensor)
            owner_name, _, attribute = held_as.rpartition(".")
            bindings.append(Binding(name, "parameter", model.get_submodule(owner_name),
                                     attribute))
            continue
        key = (id(tensor), k)
        if key not in tied_copies:
            tied_copies[key] = _tied_copy(model, tensor, spec.target, sorted(plan.uses[name]),
                                          k, device, aliases, ties)
        holder, held = tied_copies[key]
        bindings.append(Binding(name, "parameter", holder, held))
    return bindings


def _tied_copy(model: nn.Module, tensor: torch.Tensor, target: str, stages: list[int], k: int,
               device: torch.device, aliases: dict[int, list[str]],
               ties: list[TiedParameter]) -> tuple[nn.Module, str]:
    """A copy of ``tensor`` for stage k, installed under one of its other names."""
    names = aliases.get(id(tensor), [target])
    used = {n for tie in ties for n in tie.names[1:]}
    spare = [n for n in names if n != names[0] and n not in used]
    if not spare:
        raise ModelError(
            f"parameter {names[0]!r} is used by stages {stages} under one name, so a copy "
            f"for stage {k} would have no name of its own; move the split so that one "
            "stage uses it, or tie it through two modules (as an embedding and a head)")
    owner_name, _, attribute = spare[0].rpartition(".")
    owner = model.get_submodule(owner_name)
    copy = nn.Parameter(tensor.detach().to(device, copy=True), requires_grad=tensor.requires_grad)
    setattr(owner, attribute, copy)
    tie = next((t for t in ties if t.copies and t.copies[0] is tensor), None)
    if tie is None:
        assert isinstance(tensor, nn.Parameter)
        tie = TiedParameter(names=(names[0],), stages=(stages[0],), copies=[tensor],
                            counted=True)
        ties.append(tie)
    tie.names = (*tie.names, spare[0])
    tie.stages = (*tie.stages, k)
    tie.copies.append(copy)
    return owner, attribute


