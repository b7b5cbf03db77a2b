"""Choosing where to cut a model: among its repeated blocks, by parameters or by time.

``Pipeline(model, stages=K, sample=...)`` (or ``GPipe``) with no ``split_at`` comes here.
The blocks are the children of the model's largest ``nn.ModuleList`` or
``nn.Sequential`` of blocks of one kind (one class, two or more holding parameters): a
Transformer's layers, a ResNet's stages; never a list of mixed modules such as a
feed-forward's ``[Linear, Dropout, Linear]``, whose cut would leave a stage with the
dropout alone. Stage k begins at a block, so the cut is a balance of blocks; what runs
before the first block (embeddings) stays on the first stage and what runs after the last (final norm, head) on the last,
and they weigh there::

    costs  [embeddings + block 0,  block 1,  ...,  block N-2,  block N-1 + norm + head]
    cut    |---- stage 0 ----|---- stage 1 ----| ... |------- stage K-1 -------|

By parameters, a block costs the parameter elements its operations read in the traced
graph (a weight tied between the embedding and the head counts on both ends, as each
end's stage holds a copy). By time, it costs its forward and backward on the sample,
measured with hooks at the blocks' boundaries. :func:`conveyor.balance.solve_balance` finds the
cut. A cut that leaves a stage without parameters is refused (``split_at=`` cuts there
if that is what you want). The cut is logged at INFO with each stage's blocks and share
of the parameters, and :func:`auto_cut` returns it as an :class:`AutoCut` to inspect
before building. An ``nn.Sequential`` is cut by ``balance=`` (layers per stage) and
never comes here.
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
from conveyor.graph.tracing import export_model, in_mode, on_traced_device
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


@dataclass(frozen=True)
class StagePlan:
    """One stage of a chosen cut.

    Attributes:
        blocks: the blocks it holds (the first stage also runs what comes before the
            first block, the last what comes after the last).
        parameters: by parameters, the parameter elements its operations read (a tied
            weight counts on each stage that reads it); by time, those its blocks hold.
        share: ``parameters`` as a fraction of all stages'.
        seconds: by time, its forward and backward on the sample; else None.
    """

    blocks: list[str]
    parameters: int
    share: float
    seconds: float | None = None


@dataclass(frozen=True)
class AutoCut:
    """The cut conveyor chose: ``split_at`` and what each stage holds."""

    owner: str
    by: str
    split_at: list[str]
    stages: list[StagePlan]

    def __str__(self) -> str:
        count = sum(len(stage.blocks) for stage in self.stages)
        lines = [f"split_at={self.split_at}: {len(self.stages)} stages among the {count} "
                 f"blocks of {self.owner!r}, by {self.by}"]
        for k, stage in enumerate(self.stages):
            held = (stage.blocks[0] if len(stage.blocks) == 1
                    else f"{stage.blocks[0]}..{stage.blocks[-1]}")
            time = "" if stage.seconds is None else f"{1e3 * stage.seconds:.3g} ms, "
            what = "parameters" if self.by == "parameters" else "parameters in its blocks"
            lines.append(f"  stage {k}: {held} ({len(stage.blocks)} blocks): {time}"
                         f"{stage.parameters} {what} ({100 * stage.share:.1f}%)")
        return "\n".join(lines)


def find_blocks(model: nn.Module) -> Blocks:
    """The children of ``model``'s largest ``nn.ModuleList`` or ``nn.Sequential`` of
    blocks of one kind (of a list of ``nn.ModuleList`` objects, their children in
    order): all of one class, two or more holding parameters (a ``Sequential(conv,
    tanh)`` is a block, not a list of blocks; a feed-forward's ``ModuleList([Linear,
    Dropout, Linear])`` is not a list of blocks either): the most children, then the most
    parameters, then the first found.

    Raises:
        ModelError: no such list with two children or more.
    """
    found: list[tuple[int, int, str, list[str]]] = []
    for name, module in model.named_modules():
        if module is model or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(key, child) for key, child in module._modules.items() if child is not None]
        if children and all(type(c) is nn.ModuleList for _, c in children):
            # A list of lists (Funnel's encoder.blocks): the lists are never called, their
            # modules are; the blocks are those, in order.
            children = [(f"{key}.{inner}", block) for key, c in children
                        for inner, block in c._modules.items() if block is not None]
        if len(children) < 2:
            continue
        holding = sum(any(True for _ in c.parameters()) for _, c in children)
        if len({type(c) for _, c in children}) > 1 or holding < 2:
            continue
        size = sum(p.numel() for p in module.parameters())
        found.append((len(children), size, name, [f"{name}.{key}" for key, _ in children]))
    if not found:
        top = [name for name, _ in model.named_children()]
        raise ModelError(
            f"{type(model).__name__} has no repeated blocks (an nn.ModuleList or "
            "nn.Sequential of modules of one class, two or more with parameters) among which "
            "to choose where stages begin; give split_at=[the submodules where stages "
            "1..K-1 begin], e.g. among "
            f"its children {top}")
    _, _, owner, names = max(found, key=lambda f: (f[0], f[1]))
    return Blocks(owner, names)


def choose_split_at(model: nn.Module, stages: int, sample: Any, *,
                    by: str = "parameters") -> list[str]:
    """The submodules where stages 1..K-1 begin: :func:`auto_cut`'s ``split_at``."""
    return [] if stages == 1 else auto_cut(model, stages, sample, by=by).split_at


def auto_cut(model: nn.Module, stages: int, sample: Any, *,
             by: str = "parameters") -> AutoCut:
    """The cut of ``model`` into ``stages`` stages among the blocks of
    :func:`find_blocks` for which the largest stage's cost is least, with each stage's
    blocks and share of the parameters (also logged at INFO).

    Args:
        model: any ``nn.Module`` (on the meta device too, by parameters).
        stages: the number of stages K >= 2 (with interleaving, ranks x virtual stages).
        sample: one micro-batch as the model takes it, to trace (and time) the model.
        by: ``"parameters"`` or ``"time"`` (forward and backward on ``sample``).

    Raises:
        ModelError: no repeated blocks, or they do not run in their order.
        BalanceError: fewer blocks than stages, no sample, ``by="time"`` on meta, or a
            stage would hold no parameters.
    """
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
    starts = [sum(balance[:k]) for k in range(stages + 1)]
    held = [ran[starts[k]:starts[k + 1]] for k in range(stages)]
    if by == "time":
        counts = [sum(p.numel() for name in names
                      for p in model.get_submodule(name).parameters()) for names in held]
        seconds: list[float | None] = list(stage_costs(costs, balance))
    else:
        counts = [int(c) for c in stage_costs(costs, balance)]
        seconds = [None] * stages
    total = sum(counts) or 1
    cut = AutoCut(blocks.owner, by, [names[0] for names in held[1:]],
                  [StagePlan(names, count, count / total, time)
                   for names, count, time in zip(held, counts, seconds)])
    empty = [k for k, count in enumerate(counts) if count == 0]
    if empty:
        k = empty[0]
        raise BalanceError(
            f"cutting {type(model).__name__} into {stages} stages among the blocks of "
            f"{blocks.owner!r} leaves stage {k} ({', '.join(held[k])}) without parameters:\n"
            f"{cut}\nuse fewer stages, or give split_at= to cut there anyway")
    logger.info("%s", cut)
    return cut


def block_parameters(model: nn.Module, names: Sequence[str],
                     sample: Any) -> tuple[list[str], list[float]]:
    """The blocks that the traced forward runs, and the parameter elements each one's
    operations read; what runs before the first (after the last) counts on the first
    (the last). Traced in training mode, as the pipeline's training program.

    Raises:
        ModelError: tracing fails, or the blocks do not run in their order.
    """
    with in_mode(model, True):
        program = export_model(model, on_traced_device(model, sample))
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
