"""A pipeline built without ``sample=``: cut at its first call, on its first micro-batch.

Until then the pipeline adopts the model (its ``parameters()`` and ``state_dict()`` are
the model's, so an optimizer can be built over them); at the cut, tied weights become a
copy per stage, which :func:`keep_copies_equal` keeps equal to the weight the optimizer
was built over::

    Pipeline(model) ── adopt(model) ── optimizer(pipe.parameters()) ── step(x): cut on x[:m]
                                                                  ties: copies kept equal
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from conveyor.engine.microbatch import microbatch_count, split
from conveyor.engine.ties import TiedParameter
from conveyor.errors import BalanceError, ConveyorError
from conveyor.torchprivate import pytree

__all__: list[str] = []

logger = logging.getLogger("conveyor")


def cuts_at_first_step(module: Any, balance: Any, split_at: Sequence[str] | None, *,
                       distributed: bool) -> bool:
    """Whether a pipeline built without ``sample=`` cuts ``module`` at its first step,
    on the first micro-batch: a model to trace (not an ``nn.Sequential``), in one
    process, with storage (its parameters are the pipeline's until the cut).

    Raises:
        BalanceError: the model must be traced, but under torchrun or on the meta device.
    """
    if not isinstance(module, nn.Module) or isinstance(module, nn.Sequential) or (
            split_at is None and balance not in (None, "time")):
        return False
    name = type(module).__name__
    if distributed:
        raise BalanceError(
            f"conveyor traces {name} to cut it, and under torchrun every rank cuts it the "
            "same way when the pipeline is built (each keeps only its stages' parameters, "
            "for its optimizer), while only the first stage's rank sees the inputs: pass "
            "sample=<one micro-batch as the model takes it>, the same shapes on every rank")
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        raise BalanceError(
            f"{name} is on the meta device and gets its storage when it is cut, which traces "
            "it: pass sample=<one micro-batch as the model takes it>, so that the pipeline "
            "is cut (and its parameters are real) when it is built")
    return True


def first_microbatch(inputs: Any, chunks: int, model: nn.Module) -> Any:
    """The first micro-batch of ``inputs``, on the device of ``model``'s first tensor:
    the sample of a pipeline built without one (logged at INFO)."""
    tensors = [*model.parameters(), *model.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    sample = split(inputs, microbatch_count(inputs, chunks))[0]  # a smaller batch: a sample
    shapes = [tuple(t.shape) for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor)]
    logger.info("conveyor cuts %s on the first micro-batch of the first step (tensor shapes "
                "%s): no sample= was given", type(model).__name__, shapes)
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, sample)


def keep_copies_equal(owner: nn.Module, ties: Sequence[TiedParameter]) -> None:
    """Keeps the copies of tied weights that a cut made after an optimizer was built
    equal to the weight: an optimizer that steps a tied weight but not its copies sets
    them to its value after each step (and clears their gradients), as the plain model
    has one weight. For as long as ``owner`` lives (an optimizer over all copies steps
    them alike, so nothing changes)."""
    pairs = [(weakref.ref(tie.copies[0]), [weakref.ref(c) for c in tie.copies[1:]])
             for tie in ties if len(tie.copies) > 1]
    if not pairs:
        return

    def after_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for held, copies in pairs:
            weight = held()
            if weight is None or id(weight) not in stepped:
                continue
            for copy in (c() for c in copies):
                if copy is not None and id(copy) not in stepped:
                    with torch.no_grad():
                        copy.copy_(weight)
                    copy.grad = None

    handle = register_optimizer_step_post_hook(after_step)
    weakref.finalize(owner, handle.remove)


def not_cut() -> NoReturn:
    """Raises the error of a pipeline asked for its stages before its first call cut it.

    Raises:
        ConveyorError: always.
    """
    raise ConveyorError("the pipeline cuts the model at its first call (no sample= was "
                        "given), not made yet; call step() or eval_step() first, or build "
                        "it with sample=")
