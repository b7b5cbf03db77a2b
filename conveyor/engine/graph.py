"""Any ``nn.Module`` as stages: traced with torch.export, cut at named submodules.

``split_model(model, sample, split_at=["model.layers.2"])`` traces the model's forward
on a sample micro-batch (``torch.export``, non-strict: the model's own Python runs, on
fake tensors, so shape logic such as a rotary embedding's is evaluated rather than
traced symbolically), in training and in eval mode. Every operation of the graph knows
the module it ran in; stage k begins at the first operation inside ``split_at[k-1]``
(torch's ``SplitPoint.BEGINNING``). Each stage becomes a :class:`GraphStage`, a layer
that conveyor's engine runs like any other:

* stage 0 takes the micro-batch as the model takes it (a tensor, a tuple of positional
  arguments or a dict of keyword arguments); a later stage takes a dict of the values
  made before it that it or a later stage uses (a long skip connection, a mask, rotary
  ``cos``/``sin``), and hands on those that later stages still need;
* the last stage returns what the model returns (a tensor, tuple, dict, ``ModelOutput``);
* parameters and buffers stay the model's own objects, under the model's own names; a
  parameter used by several stages (tied embeddings) becomes a copy per stage, under
  the other names it has in the model, and :mod:`conveyor.engine.ties` keeps the copies
  equal;
* batch norm's running statistics, which the graph computes as new values, replace the
  buffers after each forward (not after a recomputation).

Values that skip stages are relayed through the stages between (sent on by each).
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

from conveyor.engine.recompute import is_recomputing
from conveyor.engine.ties import TiedParameter
from conveyor.errors import BalanceError, ModelError

__all__: list[str] = []


def as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A micro-batch as the model's arguments: a tuple is positional, a dict keywords,
    anything else the one positional argument."""
    if isinstance(batch, tuple):
        return batch, {}
    if isinstance(batch, dict):
        return (), dict(batch)
    return (batch,), {}


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
class _Binding:
    """A parameter, buffer or constant a stage's graph reads, and where it lives."""

    placeholder: str
    kind: str  # "parameter", "buffer" or "constant"
    owner: nn.Module | None  # the module holding it (None: a constant)
    attribute: str
    constant: torch.Tensor | None = None


@dataclass
class _Plan:
    """One traced program (one mode) cut into stages."""

    program: ExportedProgram
    stage_of: dict[fx.Node, int]
    live_in: list[list[fx.Node]]  # per stage, the values it receives (stage 0: none)
    uses: dict[str, set[int]]  # placeholder of a parameter/buffer -> the stages using it
    fixed_sizes: list[dict[int, int]]  # per user input, the dims the trace fixed: size


@dataclass
class SplitModel:
    """A model cut into stages: the stages, and what the pipeline must know of them.

    Attributes:
        stages: one :class:`GraphStage` per stage, in order.
        ties: parameters used by several stages, with their copies.
        names: the names of the stages (layer names for the engine).
    """

    stages: list[GraphStage]
    ties: list[TiedParameter] = field(default_factory=list)

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
            stage.programs[training] = _StageProgram(model, plan, k, stages, bindings)
    return split


def _cut(program: ExportedProgram, split_at: list[str], stages: int) -> _Plan:
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
    produced: dict[fx.Node, int] = {}
    uses: dict[str, set[int]] = {}
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            kind = inputs[node.name].kind
            produced[node] = -1 if kind == InputKind.USER_INPUT else -2
            continue
        produced[node] = stage_of[node]
        for used in node.all_input_nodes:
            if produced.get(used) == -2:
                uses.setdefault(used.name, set()).add(stage_of[node])
            else:
                last_use[used] = max(last_use.get(used, -1), stage_of[node])
    live_in: list[list[fx.Node]] = [[] for _ in range(stages)]
    for node, last in last_use.items():
        for k in range(max(produced[node], 0) + 1, last + 1):
            live_in[k].append(node)
    fixed_sizes = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(n for n in graph.nodes if n.name == spec.arg.name).meta.get("val")
            fixed_sizes.append({d: size for d, size in enumerate(getattr(value, "shape", ()))
                                if isinstance(size, int)})
    return _Plan(program, stage_of, live_in, uses, fixed_sizes)


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter and buffer object of ``model``."""
    found: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        found.setdefault(id(tensor), []).append(name)
    return found


def _bind(model: nn.Module, plan: _Plan, k: int, device: torch.device,
          originals: Mapping[str, torch.Tensor], aliases: dict[int, list[str]], tied_copies: dict[tuple[int, int], tuple[nn.Module, str]],
          ties: list[TiedParameter]) -> list[_Binding]:
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
            bindings.append(_Binding(name, "constant", None, "", value))
            continue
        owner_name, _, attribute = spec.target.rpartition(".")
        owner = model.get_submodule(owner_name)
        if spec.kind == InputKind.BUFFER:
            buffer = getattr(owner, attribute)
            if buffer.device != device:
                owner._buffers[attribute] = buffer.to(device)
            bindings.append(_Binding(name, "buffer", owner, attribute))
            continue
        tensor = originals[spec.target]
        if min(plan.uses[name]) == k:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)
            # Under a name that still holds it (a tie's other names may hold copies).
            held_as = next(n for n in aliases[id(tensor)] if model.get_parameter(n) is tensor)
            owner_name, _, attribute = held_as.rpartition(".")
            bindings.append(_Binding(name, "parameter", model.get_submodule(owner_name),
                                     attribute))
            continue
        key = (id(tensor), k)
        if key not in tied_copies:
            tied_copies[key] = _tied_copy(model, tensor, spec.target, sorted(plan.uses[name]),
                                          k, device, aliases, ties)
        holder, held = tied_copies[key]
        bindings.append(_Binding(name, "parameter", holder, held))
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


class _StageProgram:
    """Stage k of one traced program: its graph and what it reads and returns."""

    def __init__(self, model: nn.Module, plan: _Plan, k: int, stages: int,
                 bindings: list[_Binding]) -> None:
        program = plan.program
        signature = program.graph_signature
        self.first, self.last = k == 0, k == stages - 1
        self.bindings = bindings
        self.in_spec = program.call_spec.in_spec
        self.out_spec = program.call_spec.out_spec
        self.fixed_sizes = plan.fixed_sizes
        self.receives = [node.name for node in plan.live_in[k]]
        self.sends = [] if self.last else [node.name for node in plan.live_in[k + 1]]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        placeholders = {node.name: node for node in program.graph.nodes
                        if node.op == "placeholder"}
        for binding in bindings:
            env[placeholders[binding.placeholder]] = graph.placeholder(binding.placeholder)
        if self.first:
            for spec in signature.input_specs:
                if spec.kind == InputKind.USER_INPUT:
                    env[placeholders[spec.arg.name]] = graph.placeholder(spec.arg.name)
        for node in plan.live_in[k]:
            env[node] = graph.placeholder(node.name)
        output = None
        for node in program.graph.nodes:
            if node.op == "output":
                output = node
            elif node.op != "placeholder" and plan.stage_of[node] == k:
                env[node] = graph.node_copy(node, lambda n: env[n])
        assert output is not None
        returned = list(output.args[0])
        # Buffers the stage updates (batch norm's running statistics): owner, name.
        self.mutations: list[tuple[nn.Module, str]] = []
        results: list[Any] = []
        for spec, value in zip(signature.output_specs, returned):
            if spec.kind == OutputKind.BUFFER_MUTATION and isinstance(value, fx.Node) and \
                    plan.stage_of.get(value) == k:
                owner_name, _, attribute = spec.target.rpartition(".")
                self.mutations.append((model.get_submodule(owner_name), attribute))
                results.append(env[value])
        self.user_outputs = [value for spec, value in zip(signature.output_specs, returned)
                             if spec.kind == OutputKind.USER_OUTPUT]
        if self.last:
            results += [env[v] if isinstance(v, fx.Node) else v for v in self.user_outputs]
        else:
            results += [env[v] for v in plan.live_in[k + 1]]
        graph.output(tuple(results))
        self.module = fx.GraphModule(program.graph_module, graph)

    def __call__(self, live: Any) -> Any:
        values = [_read(b) for b in self.bindings]
        if self.first:
            args, kwargs = as_call(live)
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != self.in_spec:
                raise ModelError(
                    f"the pipeline was traced on inputs structured as {self.in_spec}, but "
                    f"this micro-batch is {spec}; call it with the sample's structure")
            self._check_shapes(leaves)
            inputs = leaves
        else:
            inputs = [live[name] for name in self.receives]
        results = list(self.module(*values, *inputs))
        if self.mutations and not is_recomputing():
            for (owner, attribute), value in zip(self.mutations, results):
                # Replaced, not copied into: a micro-batch's backward may still need the
                # tensor its forward read.
                owner._buffers[attribute] = value.detach()
        results = results[len(self.mutations):]
        if self.last:
            return pytree.tree_unflatten(results, self.out_spec)
        return dict(zip(self.sends, results))

    def _check_shapes(self, leaves: list[Any]) -> None:
        """Refuses an input whose size differs in a dimension the trace fixed: the graph
        would compute with the traced size."""
        for index, (leaf, fixed) in enumerate(zip(leaves, self.fixed_sizes)):
            if not isinstance(leaf, torch.Tensor):
                continue
            for d, size in fixed.items():
                if leaf.shape[d] != size:
                    raise ModelError(
                        f"input {index} has size {leaf.shape[d]} in dim {d}, but the model's "
                        f"trace fixed it to {size} (the model's code depends on it); give "
                        "inputs of that size, or trace on a sample of the size you will use")


def _read(binding: _Binding) -> Any:
    if binding.owner is None:
        return binding.constant
    return getattr(binding.owner, binding.attribute)


class GraphStage(nn.Module):
    """Stage k of a traced model, as one layer: a micro-batch (stage 0) or a dict of the
    values crossing into it, to the dict it hands on (or the model's output, last).

    It holds no parameters of its own (they stay in the model, under the model's names):
    :meth:`bound_parameters` lists those it reads.
    """

    def __init__(self, index: int, stages: int) -> None:
        super().__init__()
        self.index = index
        self.stages = stages
        self.programs: dict[bool, _StageProgram] = {}  # by training mode

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.stages}"

    def bound_parameters(self) -> list[nn.Parameter]:
        """The parameters this stage reads, in training mode (the same in eval)."""
        found: dict[int, nn.Parameter] = {}
        for program in self.programs.values():
            for binding in program.bindings:
                if binding.kind == "parameter":
                    param = _read(binding)
                    found.setdefault(id(param), param)
        return list(found.values())

    def bound_modules(self) -> list[nn.Module]:
        """The modules whose parameters or buffers this stage reads (its batch norms
        among them, whose running statistics a recomputation must leave alone)."""
        found: dict[int, nn.Module] = {}
        for program in self.programs.values():
            for binding in program.bindings:
                if binding.owner is not None:
                    found.setdefault(id(binding.owner), binding.owner)
        return list(found.values())

    def forward(self, live: Any) -> Any:
        return self.programs[self.training](live)
