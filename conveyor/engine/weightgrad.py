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
(every parameter of a stage whose input needs no gradient) are reached from the stage
outputs in W. Built on public autograd APIs (GradientEdge, node pre-hooks); the same
idea as torch.distributed.pipelining's stage_backward_input/weight.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradient", "backward_input"]


class WeightGradient:
    """The deferred W of one stage and micro-batch: call :meth:`run` once."""

    def __init__(self, groups: list[tuple[list[tuple[Node, tuple[Any, ...]]], list[torch.Tensor]]],
                 pinned: list[Node]) -> None:
        self._groups = groups
        self._pinned = pinned

    def run(self) -> None:
        """Computes the weight gradients and adds them to each parameter's ``.grad``."""
        captured = {node: grads for group, _ in self._groups for node, grads in group}
        handles = [node.register_prehook(lambda grads, fixed=captured[node]: fixed)
                   for node in self._pinned]
        try:
            for edges_and_grads, params in self._groups:
                edges, grads = [], []
                for node, node_grads in edges_and_grads:
                    for slot, grad in enumerate(node_grads):
                        if grad is not None:
                            edges.append(GradientEdge(node, slot))
                            grads.append(grad)
                if not edges:
                    continue
                results = torch.autograd.grad(edges, params, grads, retain_graph=True,
                                              allow_unused=True)
                for param, grad in zip(params, results):
                    if grad is None:
                        continue
                    if param.grad is None:
                        param.grad = grad
                    else:
                        param.grad += grad
        finally:
            for handle in handles:
                handle.remove()
            self._groups = []


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """Runs I: gradients of ``outputs`` (given ``grads``; None for a scalar loss) w.r.t.
    ``inputs``, keeping the graph for the W that is returned.

    Returns:
        The input gradients (None where an input is unused) and the deferred W.
    """
    roots = [_node(t) for t in outputs]
    parents = _parents(roots)
    input_nodes = [_node(t) for t in inputs if t.requires_grad]
    on_input_path = _ancestors(input_nodes, parents)
    param_nodes = {_node(p): p for p in params}

    # For each parameter, the nodes on the input path where its subgraph begins.
    boundary: dict[Node, set[Node]] = {}
    for node in param_nodes:
        found: set[Node] = set()
        seen, queue = {node}, [node]
        while queue:
            current = queue.pop()
            for parent in parents.get(current, ()):
                if parent in on_input_path:
                    found.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    queue.append(parent)
        boundary[node] = found

    # Parameters that share a boundary node are computed together.
    groups: list[tuple[set[Node], list[Node]]] = []
    direct: list[Node] = []  # subgraph reached from the outputs without the input path
    for node, found in boundary.items():
        if not found:
            direct.append(node)
            continue
        merged = [g for g in groups if g[0] & found]
        nodes, members = set(found), [node]
        for group in merged:
            nodes |= group[0]
            members += group[1]
            groups.remove(group)
        groups.append((nodes, members))

    captured: dict[Node, tuple[Any, ...]] = {}
    handles = []
    for nodes, _ in groups:
        for node in nodes:
            def note(node_grads: tuple[Any, ...], node: Node = node) -> None:
                captured[node] = tuple(node_grads)
            handles.append(node.register_prehook(note))
    try:
        wanted = [t for t in inputs if t.requires_grad]
        input_grads: list[torch.Tensor | None] = [None] * len(inputs)
        if wanted and outputs:
            results = iter(torch.autograd.grad(list(outputs), wanted, list(grads),
                                               retain_graph=True, allow_unused=True))
            input_grads = [next(results) if t.requires_grad else None for t in inputs]
    finally:
        for handle in handles:
            handle.remove()

    work = [([(node, captured.get(node, ())) for node in nodes],
             [param_nodes[p] for p in members]) for nodes, members in groups]
    if direct:
        output_grads = [g if g is not None else torch.ones_like(t) for t, g in zip(outputs, grads)]
        work.append(([(root, (grad,)) for root, grad in zip(roots, output_grads)],
                     [param_nodes[p] for p in direct]))
    # Within a group, a boundary node below another one would receive the gradient
    # again through it in W: pin such nodes to the gradient noted in I.
    pinned = []
    for nodes, _ in groups:
        if len(nodes) > 1:
            below = set().union(*(_descendants(node) for node in nodes))
            pinned += [node for node in nodes if node in below]
    return input_grads, WeightGradient(work, pinned)


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
