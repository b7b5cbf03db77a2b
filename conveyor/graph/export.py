"""Any ``nn.Module`` as stages: traced with torch.export, cut at named submodules.

``split_model(model, sample, split_at=["model.layers.2"])`` traces the model's forward
on a sample micro-batch (``torch.export``, non-strict: the model's own Python runs, on
fake tensors, so shape logic such as a rotary embedding's is evaluated rather than
traced symbolically), in training and in eval mode. Every operation of the graph knows
the module it ran in; stage k begins at the first operation inside ``split_at[k-1]``
(torch's ``SplitPoint.BEGINNING``). Each stage becomes a :class:`~conveyor.graph.tracedstage.GraphStage`,
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

Under torchrun each rank builds only its own stages: it traces the whole model (built on
the meta device, that costs no memory), gives storage and values only to the tensors its
stages read (:mod:`conveyor.graph.weights`) and drops the others from the model.

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

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from conveyor.engine.ties import TiedParameter, equalize
from conveyor.errors import BalanceError, ModelError
from conveyor.graph.binding import Binder
from conveyor.graph.calls import CallForm
from conveyor.graph.tracedstage import (CutPlan, GraphStage, StageProgram,
                                        refuse_state_across_stages)
from conveyor.graph.tracing import on_traced_device, traced_call, traced_device
from conveyor.graph.weights import (
    InitFn,
    Placement,
    Weights,
    draw_init_seed,
    fill,
    tensor_slots,
)
from conveyor.schedules import Edge
from conveyor.torchprivate import pytree

__all__: list[str] = []


@dataclass
class SplitModel:
    """A model cut into stages: the stages this process builds, and what the pipeline
    must know of them.

    Attributes:
        count: the number of stages.
        stages: this process's stages, a :class:`GraphStage` by stage index.
        ties: parameters used by several stages (every one, with this process's copies).
        edges: values sent from a stage straight to a later one past the next (in
            training or in eval mode); the schedule table must carry them.
    """

    count: int
    stages: dict[int, GraphStage] = field(default_factory=dict)
    ties: list[TiedParameter] = field(default_factory=list)
    edges: tuple[Edge, ...] = ()

    @property
    def names(self) -> list[str]:
        """The names of all stages (layer names for the engine)."""
        return [f"stage{k}" for k in range(self.count)]


def split_model(model: nn.Module, sample: Any, split_at: Sequence[str],
                devices: Mapping[int, torch.device], *, init_fn: InitFn | None = None,
                weights: Weights | None = None) -> SplitModel:
    """Traces ``model`` on ``sample`` (one micro-batch) in training and eval mode, cuts it
    at ``split_at`` and builds the stages listed in ``devices``, stage k on
    ``devices[k]``.

    The tensors those stages read move to their devices (a model built on the meta device
    gets storage for them alone, and values from ``weights``, ``init_fn`` or its own
    initialiser: :mod:`conveyor.graph.weights`); tensors of stages built elsewhere are
    removed from the model, which keeps the model's names for what it holds.

    Raises:
        ModelError: a name in ``split_at`` is not a submodule, is never called, or comes
            out of order; tracing failed; a meta tensor has no way to get a value.
        BalanceError: ``devices`` names a stage the split does not have.
    """
    split_at = list(split_at)
    count = len(split_at) + 1
    if not set(devices) <= set(range(count)):
        raise BalanceError(f"split_at gives {count} stages, so stages 0..{count - 1}; "
                           f"devices were given for {sorted(devices)}")
    for name in split_at:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ModelError(f"split_at names {name!r}, which is not a submodule of "
                             f"{type(model).__name__}; use names from "
                             "model.named_modules()") from None
    traced_on = traced_device(model)
    sample = on_traced_device(model, sample)
    # The program of the model's own mode is traced with each module as the user holds
    # it (a batch norm frozen in a model that trains stays frozen); the other mode's,
    # after model.train(). Every module's mode is restored after.
    modes = {module: module.training for module in model.modules()}
    plans: dict[bool, CutPlan] = {}
    try:
        for training in (model.training, not model.training):
            if plans:
                model.train(training)
            plans[training] = _cut(*traced_call(model, sample), split_at, count)
            refuse_state_across_stages(model, plans[training])
    finally:
        for module, training in modes.items():
            module.training = training
    binder = Binder(model, plans, devices)
    split = SplitModel(count, ties=binder.ties)
    for k in sorted(devices):
        stage = split.stages[k] = GraphStage(k, count)
        for training, plan in plans.items():
            stage.programs[training] = program = StageProgram(model, plan, k, count,
                                                              binder.bind(plan, k))
            _move_device_arguments(program.module, traced_on, devices[k])
    binder.place_unused(devices)
    replaced = fill(model, binder.placement, init_fn=init_fn, weights=weights,
                    init_seed=draw_init_seed())
    for tie in split.ties:
        tie.copies = [replaced.get(id(c), c) for c in tie.copies]  # type: ignore[misc]
        equalize(tie)
    _drop_others(model, binder.placement)
    split.edges = _edges(plans.values())
    return split


def _move_device_arguments(module: fx.GraphModule, traced_on: torch.device,
                           device: torch.device) -> None:
    """Makes the tensors a stage creates (``arange``, ``to``, ...) on the device it
    runs on rather than the device the model was traced on, in its graph and in the
    graphs it calls (a region under ``torch.autocast``), which become its own."""
    if device == traced_on:
        return

    def moved(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value == traced_on else value

    for node in module.graph.nodes:
        node.args = pytree.tree_map(moved, node.args)
        node.kwargs = pytree.tree_map(moved, node.kwargs)
    module.recompile()
    for name, child in list(module.named_children()):
        if isinstance(child, fx.GraphModule):
            own = copy.deepcopy(child)
            setattr(module, name, own)
            _move_device_arguments(own, traced_on, device)


def _drop_others(model: nn.Module, placement: Placement) -> None:
    """Removes from ``model`` the tensors this process does not hold (stages on other
    ranks), so that its parameters and ``state_dict`` are this process's own."""
    for table, name, tensor in tensor_slots(model):
        if not placement.holds(tensor):
            table[name] = None


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


def _cut(program: ExportedProgram, form: CallForm, split_at: list[str],
         stages: int) -> CutPlan:
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
    return CutPlan(program, stage_of, live_in, uses, fixed_sizes, sends,
                   _differentiable(program), form)


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
