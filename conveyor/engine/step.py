"""The state of one pipelined call: what its actions keep between them.

Every face starts a call the same way (:func:`new_step`); the executor hands the state to
each action, and the stage whose action it is reads and fills it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.engine.loss import LossFn
from conveyor.engine.microbatch import microbatch_sizes
from conveyor.engine.offload import Activations, OffloadPlan
from conveyor.engine.recompute.replay import recompute_mode, recomputes
from conveyor.engine.recompute.rng import draw_step_seed
from conveyor.engine.recompute.sideeffects import SideEffects
from conveyor.engine.backward.weightgrad import WeightGradient

__all__: list[str] = []


@dataclass
class StepState:
    """What one pipelined call keeps between its actions.

    Attributes:
        inputs: the micro-batches of stage 0 (only where stage 0 runs).
        recompute: whether micro-batch m is recomputed in backward.
        grad_enabled: whether forward records graphs for a backward.
        step_seed: the seed of this call's random streams (None: not seeded).
        targets: the micro-batches of targets, where the last stage runs a loss.
        loss_fn: ``loss_fn(output, target)`` at the last stage; None returns outputs.
        loss_scale: the weight of each micro-batch's scalar loss in the batch's (its
            share of the samples), so that their sum is the loss of the whole batch.
        grad_scale: what each micro-batch's loss is multiplied by before its backward
            (float16 loss scaling); gradients come out multiplied by it.
        check_finite: raise if a micro-batch's loss is NaN or infinite.
        step: which step of its pipeline this is, from 1 (0: not counted), for messages.
        outputs: the last stage's output per micro-batch (without a loss).
        losses: the last stage's unscaled loss per micro-batch, detached (for a
            ``(loss_sum, count)`` pair, the sum).
        counts: per micro-batch, the count of a ``(loss_sum, count)`` pair (float64).
        output_grads: per micro-batch, gradients of the last stage's output leaves.
        input_grads: per micro-batch, gradients of stage 0's input leaves.

    Parameter gradients are not kept here: backward actions accumulate them into each
    parameter's ``.grad``, as autograd does for the plain model.
    """

    inputs: Sequence[Any]
    recompute: Callable[[int, int], bool]  # (stage, micro-batch)
    grad_enabled: bool
    step_seed: int | None
    targets: Sequence[Any] | None = None
    loss_fn: LossFn | None = None
    loss_scale: Sequence[float] = ()
    grad_scale: float = 1.0
    check_finite: bool = False
    step: int = 0
    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    input_grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    #: per (stage, micro-batch), the weight gradient an ``I`` left for its ``W``.
    weight_work: dict[tuple[int, int], WeightGradient] = field(default_factory=dict)
    #: per stage, the parameters its ``I`` actions leave to ``W``, by the nodes that
    #: accumulate their gradients (found at the step's first ``I``, not at each).
    parameters_by_node: dict[int, Mapping[Any, torch.Tensor]] = field(default_factory=dict)
    #: which micro-batches offload their activations, and when they come back (set by
    #: the executor's run from its lanes).
    offload: OffloadPlan = field(default_factory=OffloadPlan)
    #: per (stage, micro-batch) of an offloading stage, until its backward: the store
    #: of what its forward saved.
    activations: dict[tuple[int, int], Activations] = field(default_factory=dict)
    #: per rank, by position in its column (its length: after its last action), the
    #: collectives it joins there (a vocabulary-parallel head's exchanges).
    joins: Mapping[int, Mapping[int, Sequence[Callable[[], None]]]] = field(
        default_factory=dict)


class LaneWork:
    """What one lane does around its actions, beside them: the offload's moves (by the
    step's plan) and the collectives its ranks join."""

    def __init__(self, state: StepState, lead: int, lane: Sequence[tuple[int, Any]]) -> None:
        self._activations = state.activations
        self._reloads = state.offload.reloads.get(lead, {})
        self._parks = state.offload.parks.get(lead, {})
        self._joins: dict[int, list[Callable[[], None]]] = {}
        done: dict[int, int] = {}  # per rank, its actions before the lane's current one
        for at, (rank, _) in enumerate(lane):
            self._joins.setdefault(at, []).extend(
                state.joins.get(rank, {}).get(done.get(rank, 0), ()))
            done[rank] = done.get(rank, 0) + 1
        for rank, count in done.items():  # after a rank's last action
            self._joins.setdefault(len(lane), []).extend(
                state.joins.get(rank, {}).get(count, ()))

    def before(self, at: int) -> None:
        """Before the lane's action ``at`` (its length: after the last): the
        collectives joined there, and one action ahead of a backward or ``W``, its
        micro-batch's tensors start back."""
        for join in self._joins.get(at, ()):
            join()
        if at in self._reloads:
            self._activations[self._reloads[at]].reload()

    def after(self, at: int) -> None:
        """After an ``I`` whose ``W`` comes later: its tensors go back to the host."""
        if at in self._parks:
            self._activations[self._parks[at]].park()


@dataclass(frozen=True)
class Saved:
    """What a forward keeps for its micro-batch's backward.

    Attributes:
        inputs: the stage's input, detached leaves.
        received: the messages the input was joined from, by sending stage (their
            leaves are the input's).
        outputs: the stage's output (with only ``inputs`` saved, if recomputed; None
            where the loss is recomputed with the stage, which recomputes it too).
        sent: the output as sent to each later stage, by receiving stage.
        loss: at the last stage, the loss backward starts from (None: the outputs).
        effects: for a micro-batch whose stage graph is rebuilt for backward, what its
            forward changed in the stage's modules (None: not recomputed).
        read: at the last stage with a loss, the output as loss_fn read it (if
            recomputed, a view of each tensor; see ``actions._read_apart``); None where
            the loss is recomputed with the stage.
        loss_with_stage: the loss is recomputed with the stage's layers (``loss`` is
            their checkpoint's output; see ``StageActions._loss``).
    """

    inputs: Any
    received: Mapping[int, Any]
    outputs: Any
    sent: dict[int, Any]
    loss: torch.Tensor | None
    effects: SideEffects | None
    read: Any = None
    loss_with_stage: bool = False


def check_options(*, chunks: int, recompute: str | Sequence[str] | None,
                  checkpoint: str | Sequence[str] | None) -> str | tuple[str, ...]:
    """Checks the options every pipeline takes; returns the recompute mode.

    Raises:
        MicroBatchError: ``chunks`` is not a positive integer.
        ValueError: not a recompute mode, or both ``recompute`` and its alias
            ``checkpoint`` given.
    """
    microbatch_sizes(chunks, chunks)
    return recompute_mode(recompute, checkpoint)


def new_step(microbatches: Sequence[Any], *, chunks: int, recompute: str | tuple[str, ...],
             grad_enabled: bool, training: bool, **options: Any) -> StepState:
    """The state of one pipelined call.

    Args:
        microbatches: stage 0's micro-batches (empty where stage 0 does not run).
        chunks: the number of micro-batches M.
        recompute: the recompute mode, deciding which micro-batches recompute.
        grad_enabled: whether forward records graphs for a backward.
        training: whether the model is in training mode.
        options: the other fields of :class:`StepState` (loss, targets ...).
    """
    return StepState(
        inputs=microbatches,
        recompute=lambda stage, m: recomputes(recompute, m, chunks, stage),
        grad_enabled=grad_enabled,
        # Seeded whenever a backward may recompute, in eval mode too (a layer random
        # in eval mode, MC dropout, must draw the same numbers again); inference in
        # eval mode draws from torch's generators as the plain model does.
        step_seed=draw_step_seed() if training or grad_enabled else None,
        **options,
    )
