"""A compiled graph's backward as two compiled graphs: input gradient (I), weight gradient (W).

torch.compile makes one autograd node per graph, and inductor one backward graph that
computes the gradients of all the graph's inputs at once. Zero-bubble schedules need
them apart: I now, to send upstream, W later. The backend here
(:func:`split_backend`) lets inductor compile the forward as always, and cuts the
backward graph AOTAutograd partitioned in two before inductor compiles each half:

* the I graph computes the gradients of the graph's inputs that are not parameters;
* the W graph, those of its parameters, from the same saved tensors and output
  gradients. A weight gradient that is one matrix product (a linear layer's) leaves
  the graph as the product's two operands, and adds itself into ``.grad`` inside
  that product (``addmm_``, as :mod:`~conveyor.engine.backward.accumulation` does
  eagerly): no pass over memory as large as the weights per micro-batch.

When W runs is told to the node, on the thread that runs it, by a pre-hook that the
stage's backward puts on it (:func:`planned`):

* in ``I``: W waits in a list for the micro-batch's ``W`` action; the node returns no
  gradient for the parameters;
* in ``B``: W runs at once, adding into ``.grad`` itself;
* otherwise (autograd called by anyone else, a parameter that is not a plain leaf
  without hooks): W runs at once and the node returns every gradient, as torch's own.

The node's parameters are found at run time, from its edges (``next_functions``),
never kept from the compilation: a graph may run on other parameter objects with the
same shapes.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from conveyor.torchprivate import (
    COMPILED_BACKWARD,
    has_gradient_hooks,
    inductor,
    inductor_graph,
    recomputed_in_backward,
)

__all__: list[str] = []

_planned = threading.local()  # .plan: the Plan of the node this thread runs next
_MATRIX_PRODUCT = torch.ops.aten.mm.default


class Plan:
    """When the W of one compiled node runs: into ``waiting`` (I), or at once (B);
    none once the backward that planned it is over (``expired``)."""

    def __init__(self, node: Node, waiting: list[Callable[[], None]] | None) -> None:
        self.node = node
        self.waiting = waiting
        self.expired = False

    def remove(self) -> None:
        """Expires the plan: a node whose backward failed before its post-hook ran
        leaves it armed on its thread, for no later backward to take."""
        self.expired = True


def planned(nodes: Sequence[Node], waiting: list[Callable[[], None]] | None) -> list[Any]:
    """Plans the W of each compiled node of ``nodes`` (see the module's notes): into
    ``waiting``, or at once where it is None. Returns handles (the hooks', the plans')
    to remove once the backward has run."""
    handles: list[Any] = []
    for node in nodes:
        plan = Plan(node, waiting)
        handles.append(node.register_prehook(functools.partial(_arm, plan)))
        handles.append(node.register_hook(_disarm))
        handles.append(plan)
    return handles


def _arm(plan: Plan, grads: tuple[Any, ...]) -> None:
    _planned.plan = plan


def _disarm(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
    _planned.plan = None


def compiled_nodes(roots: Sequence[Node]) -> list[Node]:
    """The nodes of compiled graphs in the autograd graph below ``roots``."""
    found, seen, queue = [], set(roots), list(roots)
    while queue:
        node = queue.pop()
        if node.name() == COMPILED_BACKWARD:
            found.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return found


def split_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A ``torch.compile`` backend: inductor, each backward cut into I and W graphs."""
    parameters = [tuple(t.shape) if isinstance(t, nn.Parameter) else None
                  for t in example_inputs]
    tensors = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)]
    return inductor(graph, example_inputs, functools.partial(
        _compile_partition, parameters=parameters, tensors=tensors))


def recomputing_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """:func:`split_backend` for a recomputed micro-batch: every op of the graph is
    recomputed in backward (AOTAutograd's partitioner keeps the graph's inputs alone
    for it), as torch.utils.checkpoint around the stage would, but inside the backward
    graph: only what the gradients need (not a stage's last matrix product), and no
    second forward call."""
    recomputed_in_backward(graph)
    return split_backend(graph, example_inputs)


def _compile_partition(graph: torch.fx.GraphModule, example_inputs: list[Any], *,
                       parameters: list[tuple[int, ...] | None], tensors: list[int],
                       **settings: Any) -> Any:
    """Inductor's compilation of a forward graph, or of a backward graph cut in two
    (:class:`SplitBackward`). ``parameters``: per input of the dynamo graph, its shape
    if it is a parameter (else None); ``tensors``: the inputs that are tensors."""
    if not settings.get("is_backward"):
        return inductor_graph(graph, example_inputs, **settings)
    outputs = list(graph.graph.find_nodes(op="output")[0].args[0])
    # One gradient per input of the forward graph, in its order; anything else (inputs
    # AOTAutograd merged or rebased) is compiled whole, W coming with I.
    weights = [i for i, out in enumerate(outputs) if out is not None and i < len(parameters)
               and parameters[i] is not None]
    if len(outputs) != len(parameters) or not weights:
        return inductor_graph(graph, example_inputs, **settings)
    weight_outputs: list[torch.fx.Node] = []
    products = []
    for i in weights:
        out = outputs[i]
        product = out.target is _MATRIX_PRODUCT and len(out.args) == 2
        weight_outputs += list(out.args) if product else [out]
        products.append(product)
    firsts = [None if i in weights else out for i, out in enumerate(outputs)]
    handed = _handed_on(graph, [out for out in firsts if out is not None], weight_outputs)
    input_graph = _with_outputs(graph, [*firsts, *handed])
    weight_graph = _weight_graph(graph, handed, weight_outputs)
    return SplitBackward(
        inductor_graph(input_graph, example_inputs, **settings),
        inductor_graph(weight_graph, [*example_inputs, *(n.meta["val"] for n in handed)],
                       **settings),
        len(outputs), weights, products, tensors,
        [parameters[i] for i in weights])


def _ancestors(nodes: Sequence[torch.fx.Node],
               given: Sequence[torch.fx.Node] = ()) -> set[torch.fx.Node]:
    """``nodes`` and every node they are computed from, but for the values ``given``."""
    found: set[torch.fx.Node] = set()
    queue = list(nodes)
    while queue:
        node = queue.pop()
        if node not in found:
            found.add(node)
            if node not in given:
                queue += node.all_input_nodes
    return found


def _handed_on(graph: torch.fx.GraphModule, firsts: Sequence[torch.fx.Node],
               weight_outputs: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """The values the I graph computes that the W graph needs (the gradient reaching
    each layer's output, as eager's split notes it): I hands them on, so that W does
    not compute the input path again."""
    first = _ancestors(firsts)
    weight = _ancestors(weight_outputs) - first
    wanted = set(weight_outputs)
    handed = []
    for node in graph.graph.nodes:
        if node not in first or node.op == "placeholder" or not (
                node in wanted or any(user in weight for user in node.users)):
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            handed.append(node)
        elif isinstance(value, (tuple, list)):  # (a convolution's backward): the parts W reads
            handed += [user for user in node.users if user in weight
                       and user.target is operator.getitem
                       and isinstance(user.meta.get("val"), torch.Tensor)]
        # a size (a symbolic integer): W computes it again from the arguments
    return handed


def _weight_graph(graph: torch.fx.GraphModule, handed: Sequence[torch.fx.Node],
                  outputs: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
    """The W graph: the backward's arguments, then the values I hands on, in; what
    ``outputs`` need beyond those, out."""
    copy = torch.fx.Graph()
    values: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.graph.find_nodes(op="placeholder"):
        values[node] = copy.node_copy(node)
    for index, node in enumerate(handed):
        values[node] = copy.placeholder(f"handed_{index}")
        values[node].meta.update(node.meta)
    needed = _ancestors(outputs, given=handed)
    for node in graph.graph.nodes:
        if node in needed and node not in values:
            values[node] = copy.node_copy(node, values.__getitem__)
    copy.output([values[out] for out in outputs]).meta["user_visible_output_idxs"] = \
        list(range(len(outputs)))
    return torch.fx.GraphModule(graph, copy)


def _with_outputs(graph: torch.fx.GraphModule,
                  outputs: Sequence[torch.fx.Node | None]) -> torch.fx.GraphModule:
    """A copy of ``graph`` returning ``outputs``, what they do not need left out (its
    inputs stay: both halves take the backward's one list of arguments)."""
    copy = torch.fx.Graph()
    values: dict[torch.fx.Node, torch.fx.Node] = {}
    copy.graph_copy(graph.graph, values, return_output_node=False)
    node = copy.output([None if out is None else values[out] for out in outputs])
    node.meta["user_visible_output_idxs"] = [
        i for i, out in enumerate(outputs) if out is not None]
    copy.eliminate_dead_code()
    return torch.fx.GraphModule(graph, copy)


class SplitBackward:
    """The backward of one compiled graph, as its I and W graphs (called by
    AOTAutograd with the saved tensors and output gradients as one list). The W graph
    takes that list and what the I graph hands on."""

    def __init__(self, inputs: Any, weights: Any, gradients: int, slots: list[int],
                 products: list[bool], tensors: list[int],
                 shapes: list[tuple[int, ...] | None]) -> None:
        # Takes its arguments as one list, which it empties (torch's boxed convention);
        # set on the object, so that torch's wrappers of the function copy it.
        self._boxed_call = True
        self._inputs = inputs  # the I graph: the gradients, then what it hands W
        self._weights = weights
        self._gradients = gradients  # how many the backward returns
        self._slots = slots  # the outputs that are parameters' gradients
        self._products = products  # per slot: given as a matrix product's two operands
        self._edges = [tensors.index(i) if i in tensors else -1 for i in slots]
        self._shapes = shapes  # per slot, its parameter's

    def __call__(self, *args: Any) -> list[Any]:
        plan: Plan | None = getattr(_planned, "plan", None)
        _planned.plan = None
        if plan is not None and plan.expired:
            plan = None
        boxed = len(args) == 1 and isinstance(args[0], list)  # (else called unboxed)
        held = list(args[0]) if boxed else list(args)
        if boxed:
            args[0].clear()
        results = list(self._inputs(list(held)))
        grads, held = results[:self._gradients], [*held, *results[self._gradients:]]
        params = self._parameters(plan.node) if plan is not None else None
        if plan is None or params is None:
            for slot, grad in zip(self._slots, self._weight_gradients(held)):
                grads[slot] = grad
        elif plan.waiting is not None:
            plan.waiting.append(functools.partial(self._accumulate, held, params))
        else:
            self._accumulate(held, params)
        return grads

    def _parameters(self, node: Node) -> list[nn.Parameter] | None:
        """The parameters whose gradients the W graph makes, in order: the variables
        of the node's edges; None unless each is a plain leaf without hooks, of the
        shape compiled for."""
        edges = node.next_functions
        found = []
        for edge, shape in zip(self._edges, self._shapes):
            if not 0 <= edge < len(edges):
                return None
            variable = getattr(edges[edge][0], "variable", None)
            if type(variable) is not nn.Parameter or tuple(variable.shape) != shape \
                    or has_gradient_hooks(variable) \
                    or getattr(variable, "_post_accumulate_grad_hooks", None):
                return None
            found.append(variable)
        return found

    def _weight_outputs(self, held: list[Any]) -> list[Any]:
        """Per slot, the W graph's gradient, or its matrix product's two operands."""
        flat = iter(self._weights(list(held)))
        return [(next(flat), next(flat)) if product else next(flat)
                for product in self._products]

    def _weight_gradients(self, held: list[Any]) -> list[torch.Tensor]:
        return [torch.mm(*out) if product else out
                for out, product in zip(self._weight_outputs(held), self._products)]

    def _accumulate(self, held: list[Any], params: list[nn.Parameter]) -> None:
        """Runs the W graph and adds each weight gradient into its ``.grad``, as
        autograd's accumulation would."""
        # Memory a gradient must not be adopted in: an argument (an output gradient,
        # held elsewhere) or another parameter's new .grad (inductor may hand one
        # tensor out twice). Gathered at the first .grad to make (none, mostly).
        taken: set[int] | None = None
        with torch.no_grad():
            for param, out, product in zip(params, self._weight_outputs(held),
                                           self._products):
                if product and param.grad is not None and _addable(param.grad, out[0]):
                    param.grad.addmm_(*out)
                    continue
                grad = torch.mm(*out) if product else out
                if param.grad is not None:
                    param.grad += grad
                    continue
                if taken is None:
                    taken = {t.untyped_storage().data_ptr() for t in held
                             if isinstance(t, torch.Tensor)}
                memory = grad.untyped_storage().data_ptr()
                param.grad = grad.clone() if memory in taken else grad
                taken.add(memory)


def _addable(grad: torch.Tensor, operand: torch.Tensor) -> bool:
    return (grad.dtype == operand.dtype and grad.layout == torch.strided
            and not grad.requires_grad and grad.is_contiguous())
