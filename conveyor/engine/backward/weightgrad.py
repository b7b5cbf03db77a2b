"""Splitting a stage's backward ``B`` into the input gradient (I) and the weight gradient (W).

Zero-bubble schedules send the input gradient upstream first and compute weight
gradients later, when the stage would otherwise wait. Backward through a stage's graph
is split at the nodes where a parameter's subgraph joins the path to the stage's
inputs (for ``y = x @ w.T``, the matmul's backward node):

* I runs autograd from the outputs to the inputs only, and notes the gradient flowing
  into each such node (a node pre-hook);
* W runs autograd from those nodes, with the noted gradients, to the parameters.

Together they do the work of one backward, and W accumulates into ``.grad`` exactly
what the full backward would. Parameters whose subgraph never meets the input path
are reached from the stage outputs in W. A stage whose inputs need no gradient (a first
stage) is not split at all: its I computes nothing and its W is the whole backward
(:class:`WholeBackward`), with no walk of the graph. A compiled graph is one node,
whose backward conveyor compiles as two graphs
(:mod:`~conveyor.engine.compiled.backward`): I runs the node's input half and keeps its
weight half for W. Built on public autograd APIs (GradientEdge, node
pre-hooks); the same idea as torch.distributed.pipelining's stage_backward_input/weight.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from conveyor.engine.compiled.backward import planned
from conveyor.torchprivate import COMPILED_BACKWARD

__all__: list[str] = []


class WeightGradient:
    """The deferred W of one stage and micro-batch: call :meth:`run` once.

    Args:
        groups: per group of parameters, the nodes W starts from with the gradients
            noted there in I, and the parameters it reaches from them.
        pinned: nodes that must receive in W exactly the gradient noted in I.
        compiled: the weight halves of the compiled graphs' backwards that I ran.
        repeatable: whether the graph's backward may run twice, as W from the outputs
            does for the input path: no Python autograd function in it (a collective, an
            accumulation into ``.grad``, a count, ...; False where it was not looked at).
    """

    def __init__(self, groups: list[tuple[list[tuple[Node, tuple[Any, ...]]], list[torch.Tensor]]],
                 pinned: list[Node], compiled: list[Callable[[], None]] | None = None, *,
                 repeatable: bool = False) -> None:
        self._groups = groups
        self._pinned = pinned
        self._compiled = compiled or []
        self.repeatable = repeatable

    def run(self) -> None:
        """Computes the weight gradients and adds them to each parameter's ``.grad``."""
        captured = {node: grads for group, _ in self._groups for node, grads in group}
        # A pre-hook that returns gradients replaces what flowed into the node.
        handles = [node.register_prehook(lambda grads, fixed=captured[node]: fixed)
                   for node in self._pinned]
        try:
            for noted, params in self._groups:
                edges, grads = _starts(noted)
                if not edges:
                    continue
                # Into .grad by autograd's own accumulation, as a full backward adds
                # (and runs the parameters' post-accumulate hooks): no loop here.
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
            for weight_graph in self._compiled:
                weight_graph()
        finally:
            for handle in handles:
                handle.remove()
            self._groups = []
            self._compiled = []


class WholeBackward(WeightGradient):
    """The deferred W of a stage none of whose inputs takes a gradient (a first stage):
    its I has nothing to compute, so W is the whole backward, ``run`` once, adding into
    ``.grad`` as a ``B`` does, and nothing walks the graph to split it."""

    def __init__(self, backward: Callable[[], None]) -> None:
        super().__init__([], [], repeatable=True)
        self._backward: Callable[[], None] | None = backward

    def run(self) -> None:
        backward, self._backward = self._backward, None
        assert backward is not None, "a W runs once"
        backward()


def _starts(noted: list[tuple[Node, tuple[Any, ...]]]) -> tuple[list[GradientEdge], list[Any]]:
    """The edges into the noted nodes that carried a gradient, and those gradients."""
    edges, grads = [], []
    for node, node_grads in noted:
        for slot, grad in enumerate(node_grads):
            if grad is not None:
                edges.append(GradientEdge(node, slot))
                grads.append(grad)
    return edges, grads


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Adds each gradient to its parameter's ``.grad``, as a full backward would."""
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad


# How I and W divide one stage's autograd graph, for two Linear layers with a tanh
# between them (``Linear(tanh(Linear(x)))``; the stage's input x is a leaf that
# requires grad). Gradient flows down; ``*`` marks a capture node, where a parameter's
# branch joins the input path::
#
#       output's grad_fn                                   (a root)
#             |
#       * AddmmBackward   <- g2 noted ---+-------------------+
#             |                          |                   |
#             |                      TBackward       AccumulateGrad(bias 2)
#             |                          |
#       TanhBackward             AccumulateGrad(weight 2)
#             |
#       * AddmmBackward   <- g1 noted ---+-------------------+
#             |                          |                   |
#             |                      TBackward       AccumulateGrad(bias 1)
#             |                          |
#       AccumulateGrad(x)        AccumulateGrad(weight 1)
#
#       input path                       parameter branches
#       (I runs these)                   (W runs these, later)
#
# I is ``autograd.grad(outputs, inputs)``: autograd runs only the nodes on the way to
# the inputs, computing just their input-side gradient (the Addmm nodes skip the weight
# half), and a pre-hook on each capture node notes the gradient that arrives there
# (g2 at the upper one, g1 at the lower). W is, per group of parameters,
# ``autograd.grad(GradientEdge(capture node), params, noted gradient)``: the branch to
# weight 2 and bias 2 from g2, the one to weight 1 and bias 1 from g1, each adding to
# ``.grad``. Parameters whose capture nodes overlap form one group and one call; if
# one capture node of a group lies below another (one weight used in both layers), W
# would send the upper node's gradient down the input path into the lower one as well,
# on top of what it is given there, so the lower node is pinned to the gradient I noted.
# A parameter with no capture node (no input requires grad, or it feeds an output the
# inputs do not reach) gets W from the roots, with the outputs' gradients.

_Group = tuple[set[Node], list[Node]]  # capture nodes, and the nodes of their parameters


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | Mapping[Node, torch.Tensor],
    *,
    from_outputs: bool = False,
) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """Runs I: gradients of ``outputs`` (given ``grads``; None for a scalar loss) w.r.t.
    ``inputs``, keeping the graph for the W that is returned. ``params``: the
    parameters W computes, or :func:`parameter_nodes` of them (found once for every
    micro-batch of a step). ``from_outputs``: W starts at the outputs for every
    parameter, repeating the input path's backward, and I walks the graph only to
    find that it may (see :mod:`~conveyor.engine.backward.weightpath`): one with a
    Python autograd function in it is split by groups all the same, and its W is not
    ``repeatable``.

    Returns:
        The input gradients (None where an input is unused) and the deferred W.

    Raises:
        ValueError: an output, a parameter or an input that requires grad is not part
            of an autograd graph.
    """
    param_of = params if isinstance(params, Mapping) else parameter_nodes(params)
    roots = [_node(t) for t in outputs]
    if from_outputs and _repeatable(roots):
        input_grads, _ = _input_pass(outputs, grads, inputs, [])
        work = [(_at_roots(outputs, grads), list(param_of.values()))] if param_of else []
        return input_grads, WeightGradient(work, [], repeatable=True)
    parents = _parents(roots)
    input_path = _ancestors([_node(t) for t in inputs if t.requires_grad], parents)
    # Without an input that takes a gradient (a first stage), no branch joins an input
    # path: every parameter's W starts at the outputs, and nothing need be walked (a walk
    # per parameter up to the outputs costs a stage of L layers L^2 node visits).
    capture = {node: _capture_nodes(node, parents, input_path) if input_path else set()
               for node in param_of}
    # A compiled graph is one backward node: W cannot start inside it. I runs it, and
    # the node keeps its weight half for W (compiled_weights); it does the same for the
    # parameters W would reach from the outputs where one leaves a compiled graph
    # (torch 2.11 cannot start autograd at such a node's edge either).
    compiled_roots = any(root.name() == COMPILED_BACKWARD for root in roots)
    joint = [node for node, found in capture.items()
             if any(n.name() == COMPILED_BACKWARD for n in found)
             or (not found and compiled_roots)]
    for node in joint:
        del capture[node]
    groups, direct = _groups(capture)
    compiled_weights: list[Callable[[], None]] = []
    compiled = [n for n in {*roots, *parents} if n.name() == COMPILED_BACKWARD] if joint else []
    handles = planned(compiled, compiled_weights)
    try:
        input_grads, captured = _input_pass(outputs, grads, inputs,
                                            [node for nodes, _ in groups for node in nodes],
                                            [param_of[node] for node in joint])
    finally:
        for handle in handles:
            handle.remove()

    work = [([(node, captured.get(node, ())) for node in nodes],
             [param_of[node] for node in members]) for nodes, members in groups]
    if direct:
        work.append((_at_roots(outputs, grads), [param_of[node] for node in direct]))
    repeatable = not any(isinstance(node, BackwardCFunction) for node in (*roots, *parents))
    return input_grads, WeightGradient(work, _pinned(groups), compiled_weights,
                                       repeatable=repeatable)


def _repeatable(roots: Sequence[Node]) -> bool:
    """Whether the graph below ``roots`` may run its backward twice: no Python autograd
    function in it (a walk of its nodes, cheaper than :func:`_parents`'s)."""
    seen, queue = set(roots), list(roots)
    while queue:
        node = queue.pop()
        if isinstance(node, BackwardCFunction):
            return False
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return True


def _at_roots(outputs: Sequence[torch.Tensor],
              grads: Sequence[torch.Tensor | None]) -> list[tuple[Node, tuple[Any, ...]]]:
    """The outputs' gradients as W starts from them: per node, one gradient per output
    slot (None where no output leaves by it). Outputs may leave one node by several
    slots: the halves of a ``chunk``, the outputs of a compiled graph."""
    slots: dict[Node, dict[int, Any]] = defaultdict(dict)
    for t, grad in zip(outputs, grads):
        edge = get_gradient_edge(t)
        grad = grad if grad is not None else torch.ones_like(t)
        noted = slots[edge.node]
        noted[edge.output_nr] = noted[edge.output_nr] + grad if edge.output_nr in noted else grad
    return [(node, tuple(noted.get(slot) for slot in range(max(noted) + 1)))
            for node, noted in slots.items()]


def _capture_nodes(param: Node, parents: dict[Node, list[Node]],
                   input_path: set[Node]) -> set[Node]:
    """The nodes on the input path where the branch above ``param`` joins it."""
    found: set[Node] = set()
    seen, queue = {param}, [param]
    while queue:
        current = queue.pop()
        for parent in parents.get(current, ()):
            if parent in input_path:
                found.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return found


def _groups(capture: dict[Node, set[Node]]) -> tuple[list[_Group], list[Node]]:
    """Parameters whose capture nodes overlap, merged into groups with disjoint capture
    nodes (one W call each); and the parameters with no capture node at all."""
    groups: list[_Group] = []
    direct: list[Node] = []
    for param, found in capture.items():
        if not found:
            direct.append(param)
            continue
        merged = [group for group in groups if group[0] & found]
        nodes, members = set(found), [param]
        for group in merged:
            nodes |= group[0]
            members += group[1]
            groups.remove(group)
        groups.append((nodes, members))
    return groups, direct


def _input_pass(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    capture: Sequence[Node],
    joint: Sequence[torch.Tensor] = (),
) -> tuple[list[torch.Tensor | None], dict[Node, tuple[Any, ...]]]:
    """I itself: the gradients of ``inputs`` (None where none is wanted), and the
    gradient that flowed into each of the ``capture`` nodes on the way. The gradients
    of the ``joint`` parameters are computed too and added to their ``.grad``."""
    captured: dict[Node, tuple[Any, ...]] = {}

    def note(node: Node) -> Any:
        def hook(node_grads: tuple[Any, ...]) -> None:
            captured[node] = tuple(node_grads)
        return hook

    handles = [node.register_prehook(note(node)) for node in capture]
    try:
        wanted = [t for t in inputs if t.requires_grad]
        input_grads: list[torch.Tensor | None] = [None] * len(inputs)
        if (wanted or joint) and outputs:
            results = iter(torch.autograd.grad(list(outputs), [*wanted, *joint], list(grads),
                                               retain_graph=True, allow_unused=True))
            input_grads = [next(results) if t.requires_grad else None for t in inputs]
            _accumulate(joint, list(results))
    finally:
        for handle in handles:
            handle.remove()
    return input_grads, captured


def _pinned(groups: Sequence[_Group]) -> list[Node]:
    """The capture nodes that lie below another capture node of their group: W would
    send them gradient again through it, so they are pinned to what I noted."""
    pinned = []
    for nodes, _ in groups:
        if len(nodes) > 1:
            below = set().union(*(_descendants(node) for node in nodes))
            pinned += [node for node in nodes if node in below]
    return pinned


def parameter_nodes(params: Sequence[torch.Tensor]) -> dict[Node, torch.Tensor]:
    """Each parameter by the node that accumulates its gradient (where W ends)."""
    return {_node(p): p for p in params}


def _node(t: torch.Tensor) -> Node:
    node = get_gradient_edge(t).node
    if node is None:
        raise ValueError("the tensor is not part of an autograd graph")
    return node


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node below ``roots``, the nodes that feed gradient into it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = set(roots), list(roots)
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _ancestors(nodes: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node whose gradient flows into one of them."""
    found, queue = set(nodes), list(nodes)
    while queue:
        for parent in parents.get(queue.pop(), ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


def _descendants(node: Node) -> set[Node]:
    """Every node that ``node`` passes gradient to, directly or not."""
    found: set[Node] = set()
    queue = [node]
    while queue:
        for child, _ in queue.pop().next_functions:
            if child is not None and child not in found:
                found.add(child)
                queue.append(child)
    return found
