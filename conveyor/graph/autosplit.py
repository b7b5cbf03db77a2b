"""Choosing where to cut a model: among its repeated blocks, by parameters or by time.

``Pipeline(model, stages=K, sample=...)`` (or ``GPipe``) with no ``split_at`` comes here.
The blocks are the children of the model's largest ``nn.ModuleList`` (or ``nn.Sequential``
of modules of one class): a Transformer's layers, a ResNet's stages. Stage k begins at a
block, so the cut is a balance of blocks; what runs before the first block (embeddings)
stays on the first stage and what runs after the last (final norm, head) on the last,
and they weigh there::

    costs  [embeddings + block 0,  block 1,  ...,  block N-2,  block N-1 + norm + head]
    cut    |---- stage 0 ----|---- stage 1 ----| ... |------- stage K-1 -------|

By parameters, a block costs the parameter elements its operations read in the traced
graph (a weight tied between the embedding and the head counts on both ends, as each
end's stage holds a copy). By time, it costs its forward and backward on the sample,
measured with hooks at the blocks' boundaries. :func:`conveyor.solve_balance` finds the
cut. An ``nn.Sequential`` is cut by ``balance=`` (layers per stage) and never comes here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.export.graph_signature import InputKind

from conveyor.errors import BalanceError, ModelError
from conveyor.graph.balance import solve_balance, solve_measured_balance, stage_costs
from conveyor.graph.export import export_model
from conveyor.graph.profile import block_times

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Blocks:
    """A model's repeated blocks.

    Attributes:
        owner: the name of the list that holds them (``"transformer.h"``).
        names: the blocks' names, in the list's order (``"transformer.h.0"`` ...).
    """

    owner: str
    names: list[str]


def find_blocks(model: nn.Module) -> Blocks:
    """The children of ``model``'s largest ``nn.ModuleList``, or ``nn.Sequential`` whose
    children are all of one class (a ``Sequential(conv, tanh)`` is a block, not a list of
    blocks): the most children, then the most parameters, then the first found.

    Raises:
        ModelError: no such list with two children or more.
    """
    found: list[tuple[int, int, str, list[str]]] = []
    for name, module in model.named_modules():
        if module is model or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(key, child) for key, child in module._modules.items() if child is not None]
        if len(children) < 2:
            continue
        if isinstance(module, nn.Sequential) and len({type(c) for _, c in children}) > 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        found.append((len(children), size, name, [f"{name}.{key}" for key, _ in children]))
    if not found:
        top = [name for name, _ in model.named_children()]
        raise ModelError(
            f"{type(model).__name__} has no repeated blocks (an nn.ModuleList, or an "
            "nn.Sequential of modules of one class) among which to choose where stages "
            "begin; give split_at=[the submodules where stages 1..K-1 begin], e.g. among "
            f"its children {top}")
    _, _, owner, names = max(found, key=lambda f: (f[0], f[1]))
    return Blocks(owner, names)


def choose_split_at(model: nn.Module, stages: int, sample: Any, *,
                    by: str = "parameters") -> list[str]:
    """The submodules where stages 1..K-1 begin: blocks of :func:`find_blocks`, cut so
    that the largest stage's cost is least.

    Args:
        model: any ``nn.Module`` (on the meta device too, by parameters).
        stages: the number of stages K (with interleaving, ranks x virtual stages).
        sample: one micro-batch as the model takes it, to trace (and time) the model.
        by: ``"parameters"`` or ``"time"`` (forward and backward on ``sample``).

    Raises:
        ModelError: no repeated blocks, or they do not run in their order.
        BalanceError: fewer blocks than stages, no sample, or ``by="time"`` on meta.
    """
    if stages == 1:
        return []
    blocks = find_blocks(model)
    _check_enough(model, blocks, blocks.names, stages)
    if sample is None:
        raise BalanceError(
            f"choosing where to cut {type(model).__name__} among its blocks traces it: pass "
            "sample=<one micro-batch as the model takes it>, or give split_at=")
    if by == "time":
        ran, costs = block_times(model, blocks.names, sample)
    elif by == "parameters":
        ran, costs = block_parameters(model, blocks.names, sample)
    else:
        raise BalanceError(f"cannot balance by {by!r}: use 'parameters' or 'time'")
    _check_enough(model, blocks, ran, stages)
    balance = (solve_measured_balance if by == "time" else solve_balance)(costs, stages)
    starts = [sum(balance[:k]) for k in range(stages)]
    split_at = [ran[start] for start in starts[1:]]
    shown = [f"{1e3 * cost:.3g} ms" if by == "time" else f"{cost:.0f} parameters"
             for cost in stage_costs(costs, balance)]
    logger.info("split_at=%s: %d stages among the %d blocks of %r, by %s (per stage: %s)",
                split_at, stages, len(ran), blocks.owner, by, ", ".join(shown))
    return split_at


def block_parameters(model: nn.Module, names: Sequence[str],
                     sample: Any) -> tuple[list[str], list[float]]:
    """The blocks that the traced forward runs, and the parameter elements each one's
    operations read; what runs before the first (after the last) counts on the first
    (the last). Traced in training mode, as the pipeline's training program.

    Raises:
        ModelError: tracing fails, or the blocks do not run in their order.
    """
    was_training = model.training
    try:
        model.train(True)
        program = export_model(model, sample)
    finally:
        model.train(was_training)
    index = {name: i for i, name in enumerate(names)}
    segment: dict[str, int] = {}  # node -> the block it runs in or after (-1: before all)
    current = -1
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        inside = [index[p] for p in _paths(node) if p in index]
        if inside and max(inside) < current:
            raise ModelError(
                f"{type(model).__name__}'s forward runs {names[max(inside)]!r} after "
                f"{names[current]!r}: its blocks do not run in their order, so conveyor "
                "cannot choose the cut among them; give split_at=")
        current = max([current, *inside])
        segment[node.name] = current
    ran = sorted({s for s in segment.values() if s >= 0})
    weights = {s: 0.0 for s in [-1, *ran]}
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.PARAMETER or spec.target is None:
            continue
        size = model.get_parameter(spec.target).numel()
        node = next(n for n in program.graph.nodes if n.name == spec.arg.name)
        for s in {segment[user.name] for user in node.users if user.name in segment}:
            weights[s] += size
    costs = [weights[s] for s in ran]
    if costs:
        costs[0] += weights[-1]
    return [names[s] for s in ran], costs


def _paths(node: Any) -> list[str]:
    """The module paths a graph node runs in, innermost included."""
    return [path for path, _ in node.meta.get("nn_module_stack", {}).values()]


def _check_enough(model: nn.Module, blocks: Blocks, ran: Sequence[str], stages: int) -> None:
    if len(ran) >= stages:
        return
    listed = len(blocks.names)
    counted = (f"{blocks.owner!r} holds {listed} blocks" if len(ran) == listed else
               f"the forward runs {len(ran)} of the {listed} blocks of {blocks.owner!r}")
    raise BalanceError(
        f"{counted}, fewer than the {stages} stages asked of {type(model).__name__}; use at "
        f"most {len(ran)} stages, or give split_at= (the submodules where stages 1.."
        f"{stages - 1} begin)")


def choose_cut(module: Any, split_at: Sequence[str] | None, balance: Any, sample: Any,
               stages: int | None) -> tuple[list[str] | None, Any]:
    """``split_at`` and ``balance`` as a pipeline should use them: as given, or for a
    model that is neither an ``nn.Sequential`` nor a layer function, with no
    ``split_at`` and no list of layers per stage, the cut into ``stages`` chosen here
    (and no balance left to apply).

    Raises:
        BalanceError: ``stages`` is not known.
        ModelError, BalanceError: as :func:`choose_split_at`.
    """
    if split_at is not None:
        return list(split_at), balance
    if not isinstance(module, nn.Module) or isinstance(module, nn.Sequential) or \
            balance not in (None, "time"):  # layers per stage: an nn.Sequential's path
        return None, balance
    if stages is None:
        raise BalanceError(f"to choose where to cut {type(module).__name__}, conveyor needs "
                           "the number of stages: give stages= or devices= (one per "
                           "stage), or split_at=")
    return choose_split_at(module, stages, sample,
                           by="time" if balance == "time" else "parameters"), None
