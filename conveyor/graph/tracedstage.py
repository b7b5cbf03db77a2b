"""A traced stage at run time: :class:`GraphStage`, the layer that runs stage k of a
model cut by :mod:`conveyor.graph.export`.

Stage 0 takes the micro-batch as the model takes it, a later stage the dict of values
made before it that it uses; each returns the values it makes that later stages use
(stage 0: the model's inputs among them), which :meth:`GraphStage.route` sorts by the
stage each goes to, and the last returns what the model returns. Parameters and buffers are read from the model's own modules at each
call (a batch norm's running statistics are current; a recomputation reads the copies
:class:`conveyor.engine.recompute.replay.Recomputation` puts in their place).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from conveyor.engine.layers import WholeStage
from conveyor.engine.recompute.replay import is_recomputing
from conveyor.errors import ModelError
from conveyor.graph.calls import CallForm
from conveyor.graph.calls import as_call as as_call  # profile, plan and check import it here
from conveyor.torchprivate import assert_tensor_metadata, pytree

__all__: list[str] = []



@dataclass
class Binding:
    """A parameter, buffer or constant a stage's graph reads, and where it lives."""

    placeholder: str
    kind: str  # "parameter", "buffer" or "constant"
    owner: nn.Module | None  # the module holding it (None: a constant)
    attribute: str
    constant: torch.Tensor | None = None


@dataclass
class CutPlan:
    """One traced program (one mode) cut into stages."""

    program: ExportedProgram
    stage_of: dict[fx.Node, int]
    live_in: list[list[fx.Node]]  # per stage, the values it receives (stage 0: none)
    uses: dict[str, set[int]]  # placeholder of a parameter/buffer -> the stages using it
    fixed_sizes: list[dict[int, int]]  # per user input, the dims the trace fixed: size
    sends: list[dict[int, list[fx.Node]]]  # per stage, per later stage, what goes there
    differentiable: set[fx.Node]  # the values that may carry a gradient
    form: CallForm  # how a micro-batch calls the model


class StageProgram:
    """Stage k of one traced program: its graph and what it reads and returns."""

    def __init__(self, model: nn.Module, plan: CutPlan, k: int, stages: int,
                 bindings: list[Binding]) -> None:
        program = plan.program
        signature = program.graph_signature
        self.first, self.last = k == 0, k == stages - 1
        self.bindings = bindings
        self.in_spec = program.call_spec.in_spec
        self.out_spec = program.call_spec.out_spec
        self.fixed_sizes = plan.fixed_sizes
        self.form = plan.form
        self.receives = [node.name for node in plan.live_in[k]]
        # What goes to each later stage, by name; the values made here, each once.
        self.sends = {j: [node.name for node in nodes] for j, nodes in plan.sends[k].items()}
        made = list(dict.fromkeys(node for nodes in plan.sends[k].values() for node in nodes))
        self.made = [node.name for node in made]
        # Values sent that are a buffer written in place (or a view of one): sent as
        # copies, so that a later stage reads the value of its micro-batch, not of the
        # micro-batch this stage runs when that stage gets to it.
        buffers = {spec.arg.name for spec in signature.input_specs
                   if spec.kind == InputKind.BUFFER}
        self.state_values = [i for i, node in enumerate(made) if _state_of(node) in buffers]
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
            elif node.target is assert_tensor_metadata:
                # A dtype the trace saw: under autocast (precision=) it differs, on purpose.
                continue
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
            results += [env[v] for v in made]
        graph.output(tuple(results))
        self.module = fx.GraphModule(program.graph_module, graph)

    def __call__(self, live: Any) -> Any:
        values = [_read(b) for b in self.bindings]
        if self.first:
            args, kwargs = self.form.call(live)
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != self.in_spec:
                raise self._mismatch(args, kwargs, spec)
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
        for i in self.state_values:
            results[i] = results[i].clone()
        if self.last:
            return pytree.tree_unflatten(results, self.out_spec)
        return dict(zip(self.made, results))

    def route(self, made: dict[str, Any], destinations: Sequence[int]) -> dict[int, Any]:
        """The values ``made`` by this stage, as a dict for each stage of
        ``destinations`` (empty for one that takes nothing from it in this mode)."""
        return {j: {name: made[name] for name in self.sends.get(j, ())} for j in destinations}

    def _mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                  spec: pytree.TreeSpec) -> ModelError:
        """The error of a micro-batch that does not call the model as the sample did."""
        traced = {*self.form.names, *self.form.added}
        given = set(kwargs)
        if "labels" in given - traced:
            return ModelError(
                f"this micro-batch gives labels, which the sample of {self.form.model} did "
                "not: a model given labels reduces its own loss over each micro-batch. Leave "
                "labels out of the inputs: give them to step() as the targets, and a loss_fn "
                "on the model's output (conveyor.token_loss for tokens with padding)")
        if given != traced and self.form.signature is not None:
            missing, extra = sorted(traced - given), sorted(given - traced)
            said = [f"lacks {missing}" if missing else "",
                    f"gives {extra}, which the sample did not" if extra else ""]
            return ModelError(
                f"the pipeline traced {self.form.model} on a sample with the inputs "
                f"{sorted(traced)}, but this micro-batch {' and '.join(s for s in said if s)}"
                "; give every micro-batch the sample's inputs, or build the pipeline on a "
                "sample with these")
        return ModelError(
            f"the pipeline was traced on inputs structured as {self.in_spec}, but this "
            f"micro-batch is {spec}; call it with the sample's structure")

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


def _state_of(node: fx.Node) -> str | None:
    """The placeholder of the program of which ``node`` is an alias (written in place or
    viewed, also inside a ``torch.no_grad()`` block's subgraph), if any: its name."""
    root = _alias_root(node)
    return root.name if root is not None else None


def _alias_root(node: fx.Node) -> fx.Node | None:
    """The placeholder (of ``node``'s graph) that ``node`` aliases, or None."""
    while node.op == "call_function":
        body = _body(node.args[0]) if node.target is operator.getitem and node.args \
            and isinstance(node.args[0], fx.Node) else None
        if body is not None:  # an output of a subgraph: what it aliases inside
            graph, inputs = body
            output = next(n for n in graph.graph.nodes if n.op == "output")
            inner = _alias_root(output.args[0][node.args[1]])  # type: ignore[index]
            if inner is None:
                return None
            node = inputs[[n for n in graph.graph.nodes if n.op == "placeholder"].index(inner)]
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.arguments or schema.arguments[0].alias_info is None \
                or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return node if node.op == "placeholder" else None


def _body(node: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]] | None:
    """A higher-order op's subgraph (``torch.no_grad()``, autocast blocks) and the
    values it is called with, or None."""
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            graph = getattr(node.graph.owning_module, str(arg.target), None)
            if isinstance(graph, fx.GraphModule):
                return graph, [a for a in node.args[i + 1:] if isinstance(a, fx.Node)]
    return None


def _writes(node: fx.Node) -> list[fx.Node]:
    """What ``node`` writes in place, as values of its graph (through a subgraph's)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.arguments and schema.arguments[0].alias_info is not None \
            and schema.arguments[0].alias_info.is_write and isinstance(node.args[0], fx.Node):
        return [node]
    body = _body(node) if node.op == "call_function" else None
    if body is None:
        return []
    graph, inputs = body
    inner = [n for n in graph.graph.nodes if n.op == "placeholder"]
    return [inputs[inner.index(root)] for written in graph.graph.nodes
            for one in _writes(written) for root in [_alias_root(one)]
            if root is not None and root in inner and inner.index(root) < len(inputs)]


def refuse_state_across_stages(model: nn.Module, plan: CutPlan) -> None:
    """Refuses a buffer that one stage writes in place and another reads as it is
    (each stage runs its micro-batches at its own time: the reader would see it as
    some other micro-batch left it); one tensor held by two modules counts once. A
    value computed from the buffer, the written one included, goes to later stages
    with its micro-batch (``state_values``).

    Raises:
        ModelError: naming the buffer, the stages and what to do.
    """
    targets = {spec.arg.name: spec.target for spec in plan.program.graph_signature.input_specs
               if spec.kind == InputKind.BUFFER and spec.target is not None}
    objects: dict[str, int] = {}  # placeholder -> the id of the tensor it is
    for name, target in targets.items():
        try:
            objects[name] = id(model.get_buffer(target))
        except AttributeError:
            objects[name] = id(name)
    writers: dict[int, set[int]] = {}
    for node, stage in plan.stage_of.items():
        for value in _writes(node) if node.op == "call_function" else ():
            name = _state_of(value)
            if name is not None and name in targets:
                writers.setdefault(objects[name], set()).add(stage)
    for tensor, written in writers.items():
        held = [name for name, object_id in objects.items() if object_id == tensor]
        readers: set[int] = set().union(*(plan.uses.get(name, set()) for name in held))
        readers -= written
        if readers:
            raise ModelError(
                f"state shared across stages: the buffer "
                f"{' = '.join(targets[name] for name in held)} is written in "
                f"place by stage {min(written)} and read by stage {min(readers)} of the "
                "cut: each stage "
                "runs its micro-batches at its own time, so that stage would read it as "
                "some other micro-batch left it, not in the plain model's order. Choose "
                "split_at so that the module holding it runs in one stage, or cut an "
                "nn.Sequential with balance=")


def _read(binding: Binding) -> Any:
    if binding.owner is None:
        return binding.constant
    return getattr(binding.owner, binding.attribute)


class GraphStage(WholeStage):
    """Stage k of a traced model, as one layer: a micro-batch (stage 0) or a dict of the
    values crossing into it, to the dict it hands on (or the model's output, last).

    It holds no parameters of its own (they stay in the model, under the model's names):
    :meth:`bound_parameters` lists those it reads.
    """

    def __init__(self, index: int, stages: int) -> None:
        super().__init__()
        self.index = index
        self.stages = stages
        self.programs: dict[bool, StageProgram] = {}  # by training mode

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

    def graphs(self) -> list[fx.GraphModule]:
        return [program.module for program in self.programs.values()]

    def graph(self) -> fx.GraphModule | None:
        program = self.programs.get(self.training)
        return program.module if program is not None else None

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

    def route(self, made: dict[str, Any], destinations: Sequence[int]) -> dict[int, Any]:
        """What this stage made, split by the stage each value goes to."""
        return self.programs[self.training].route(made, destinations)
