"""What each action of the table means for a stage: ``F`` runs a micro-batch and keeps
what its backward needs, ``B`` back-propagates it whole, ``I`` only its input gradient
(leaving the weight gradient to its ``W``), and at the last stage the loss.

A split backward of a recomputed micro-batch rebuilds the stage's graph once, in ``I``,
and keeps it for ``W`` (:meth:`StageActions._rebuilt`)::

    F(m)  keep the input ........ I(m)  rebuild, input gradient ... W(m)  weight gradient
                                        (graph kept) ---------------------^
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from conveyor.engine.backward.accumulation import FusedAccumulation, fusing_allowed
from conveyor.engine.compiled.backward import compiled_nodes, planned
from conveyor.engine.layers import Partition
from conveyor.engine.loss import loss_and_count
from conveyor.engine.offload import Activations, Offloader
from conveyor.engine.recompute.sideeffects import SideEffects
from conveyor.engine.backward.routing import Pair, output_pairs, summed
from conveyor.engine.step import Saved, StepState
from conveyor.engine.transport import deliver
from conveyor.engine.backward.weightgrad import (
    WeightGradient,
    WholeBackward,
    backward_input,
    parameter_nodes,
)
from conveyor.engine.backward.weightpath import WeightPath
from conveyor.errors import ConveyorError, NonFiniteLossError, StageError
from conveyor.engine.recompute.replay import is_recomputing
from conveyor.torchprivate import STOP_RECOMPUTATION, pytree

__all__: list[str] = []


class StageActions:
    """The actions of the table on a stage (:class:`~conveyor.engine.stage.Stage`, which
    provides what is declared here)."""

    index: int
    last: bool
    device: torch.device
    accumulator: FusedAccumulation | None
    compiles: bool
    layers: Partition
    offloader: Offloader | None
    weight_path: WeightPath

    def forward(self, inputs: Any, microbatch: int, *, step_seed: int | None,
                recompute: bool, loss_of: Callable[[Any], torch.Tensor] | None = None
                ) -> tuple[Any, SideEffects | None]:
        raise NotImplementedError

    def recompute(self, inputs: Any, microbatch: int, effects: SideEffects, *,
                  step_seed: int | None,
                  loss_of: Callable[[Any], torch.Tensor] | None = None) -> Any:
        raise NotImplementedError

    def route(self, outputs: Any, destinations: Sequence[int]) -> dict[int, Any]:
        raise NotImplementedError

    def join(self, received: Mapping[int, Any]) -> Any:
        raise NotImplementedError

    def trainable_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def forward_one(self, microbatch: int, received: Mapping[int, Any], state: StepState,
                    destinations: Sequence[int]) -> dict[int, Any]:
        """``F``: runs the micro-batch (stage 0: the step's, later: joined from what the
        earlier stages sent, by sending stage), computes the loss at the last stage, and
        keeps what the backward needs. Returns what goes to each of ``destinations``."""
        m = microbatch
        inputs = (deliver(state.inputs[m], self.device) if self.index == 0
                  else self.join(received))
        recompute = state.grad_enabled and state.recompute(self.index, m)
        has_loss = self.last and state.loss_fn is not None
        with_stage = has_loss and recompute and recomputed_with_stage(state.loss_fn)
        loss = read = None  # read: the output as loss_fn read it
        activations = self._activations(m, inputs, state, recompute)
        with activations.saving() if activations is not None else contextlib.nullcontext():
            if with_stage:
                (outputs, loss), effects = self.forward(
                    inputs, m, step_seed=state.step_seed, recompute=True,
                    loss_of=lambda out: self._loss(m, out, state, again=is_recomputing()))
                outputs = None  # (kept by nothing: backward recomputes it)
            else:
                outputs, effects = self.forward(inputs, m, step_seed=state.step_seed,
                                                recompute=recompute)
            if activations is not None:  # kept for backward anyway; the loss's targets
                activations.keep((outputs, state.targets[m] if self.last and state.targets
                                  else None))
            if has_loss and not with_stage:  # its saved tensors too
                read = _read_apart(outputs) if recompute else outputs
                loss = self._loss(m, read, state)
        sent: dict[int, Any] = {}  # by receiving stage
        if self.last and state.loss_fn is None:
            state.outputs[m] = outputs
        elif not self.last:
            sent = self.route(outputs, destinations)
        if state.grad_enabled:
            state.saved[(self.index, m)] = Saved(inputs, received, outputs, sent, loss,
                                                 effects, read, with_stage)
        return sent

    def _activations(self, m: int, inputs: Any, state: StepState,
                     recompute: bool) -> Activations | None:
        """Where the forward of micro-batch m saves for its backward: on an offloading
        stage, a store that offloads it if the step's plan says so; else None (autograd
        keeps it; a recomputed micro-batch saves nothing: torch.utils.checkpoint keeps
        its own)."""
        if self.offloader is None or not state.grad_enabled or recompute:
            return None
        activations = self.offloader.activations(
            self.layers, inputs, offload=(self.index, m) in state.offload.offloaded)
        state.activations[(self.index, m)] = activations
        return activations

    def backward_one(self, microbatch: int, came: Mapping[int, Any], state: StepState, *,
                     split: bool) -> dict[int, list[torch.Tensor | None]]:
        """``B`` (``split=False``): input and weight gradients at once. ``I``
        (``split=True``): the input gradient; the weight gradient waits for ``W``.

        Args:
            came: the gradients of what this stage sent, by the stage they come from.

        Returns:
            The gradients of the stage's input, by the stage that sent each part.
        """
        m = microbatch
        saved = state.saved.pop((self.index, m))
        if not split:  # the graph holds what the forward saved from here
            state.activations.pop((self.index, m), None)
        pairs: list[Pair]
        if saved.loss is not None:
            pairs = [(saved.loss, None)] if saved.loss.requires_grad else []
        elif self.last:
            pairs = output_pairs(saved.outputs, state.output_grads.pop(m))
        else:
            pairs = summed([pair for j, grads in came.items()  # a value sent to several
                            for pair in output_pairs(saved.sent[j], grads)])  # stages: add
        if pairs and split and saved.effects is not None:
            pairs = self._rebuilt(m, saved, pairs, state)
        input_leaves = pytree.tree_leaves(saved.inputs)
        wanted = [t for t in input_leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        found: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if pairs and split and not wanted and not self.compiles:
            state.weight_work[(self.index, m)] = WholeBackward(
                lambda: self._backward_whole(pairs))
        elif pairs and split:
            params = state.parameters_by_node.get(self.index)
            if params is None:
                params = state.parameters_by_node[self.index] = parameter_nodes(
                    self.trainable_parameters())
            path = self.weight_path.take(m) if not self.compiles else "groups"
            started = self.weight_path.start(m)
            found, state.weight_work[(self.index, m)] = backward_input(
                [out for out, _ in pairs], [g for _, g in pairs], wanted, params,
                from_outputs=path == "outputs")
            self.weight_path.stop(m, started, weight=False)
            if not state.weight_work[(self.index, m)].repeatable:
                self.weight_path.keep_groups("its graph holds a Python autograd function, "
                                             "whose backward must run once")
        elif pairs:
            self._backward_whole(pairs)
            found = [t.grad for t in wanted]
        elif split:
            state.weight_work[(self.index, m)] = WeightGradient([], [])
        grad_of = {id(t): grad for t, grad in zip(wanted, found)}
        if self.index == 0:
            state.input_grads[m] = [grad_of.get(id(t)) for t in input_leaves]
        return {i: [grad_of.get(id(t)) for t in pytree.tree_leaves(part)]
                for i, part in saved.received.items()}

    def _backward_whole(self, pairs: Sequence[Pair]) -> None:
        """The whole backward from ``pairs`` (a ``B``, or the ``W`` of a stage whose
        inputs take no gradient). The graph of a stage starts at its own detached
        inputs, so backward reaches exactly this stage's parameters and input leaves.
        Accumulating into .grad (AccumulateGrad) adds each weight gradient while it is
        still in cache: 5-10% faster on CPU than collecting them with autograd.grad."""
        outputs, grads = [out for out, _ in pairs], [g for _, g in pairs]
        if self.accumulator is None and not self.compiles:  # (nothing to switch on)
            torch.autograd.backward(outputs, grads)
            return
        with self.accumulator.backward() if self.accumulator else contextlib.nullcontext(), \
                self._compiled_weights_at_once(pairs):
            torch.autograd.backward(outputs, grads)

    @contextlib.contextmanager
    def _compiled_weights_at_once(self, pairs: Sequence[Pair]) -> Iterator[None]:
        """In ``B``, each compiled graph's weight half adds its gradients into ``.grad``
        within its matrix products (see :mod:`conveyor.engine.compiled.backward`)."""
        roots = [get_gradient_edge(out).node for out, _ in pairs]
        handles = planned(compiled_nodes(roots) if self.compiles and fusing_allowed() else [],
                          None)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def weight_one(self, microbatch: int, state: StepState) -> None:
        """``W``: the weight gradient that the micro-batch's ``I`` left."""
        state.activations.pop((self.index, microbatch), None)
        started = self.weight_path.start(microbatch)
        state.weight_work.pop((self.index, microbatch)).run()
        self.weight_path.stop(microbatch, started, weight=True)

    def _loss(self, m: int, outputs: Any, state: StepState, *,
              again: bool = False) -> torch.Tensor:
        """The loss of micro-batch m, as its backward starts from: scaled by the
        micro-batch's share of the batch, or (a ``(loss_sum, count)`` pair) the sum
        alone, divided by the whole step's count once every micro-batch is done.

        A recomputed micro-batch computes its loss inside the stage's recomputed region,
        so that it keeps its input alone: not the stage's output nor what the loss saves
        (a language model's logits and their log-softmax, its largest activations, one
        pair per micro-batch in flight). Its backward runs ``loss_fn`` ``again`` (where
        :func:`conveyor.is_recomputing` is true), recording nothing a second time."""
        assert state.loss_fn is not None and state.targets is not None
        targets = deliver(state.targets[m], self.device)
        try:
            result = state.loss_fn(outputs, targets)
        except STOP_RECOMPUTATION:
            raise
        except Exception as exc:  # the loss is part of the last stage's forward
            action = f"{self.index}{'B' if again else 'F'}{m}"
            during = " while recomputing it for backward" if again else ""
            raise StageError(f"loss_fn failed on micro-batch {m} (stage {self.index}, "
                             f"{action}){during}: {type(exc).__name__}: {exc}",
                             stage=self.index, microbatch=m, action=action) from exc
        loss, count = loss_and_count(result, m)
        if again:
            scale = state.grad_scale * (state.loss_scale[m] if count is None else 1.0)
            return loss.reshape(()) * scale
        if state.losses and (count is not None) != bool(state.counts):
            raise ConveyorError(
                f"loss_fn returned {'a (loss_sum, count) pair' if count is not None else 'a scalar'}"
                f" for micro-batch {m} but not for micro-batch {next(iter(state.losses))}; "
                "return the same kind of loss for every micro-batch"
            )
        value = loss.detach().reshape(())
        if state.check_finite and not math.isfinite(float(value)):
            raise NonFiniteLossError(f"the loss of micro-batch {m} is {float(value)} "
                                     f"(stage {self.index}"
                                     + (f", step {state.step} of this pipeline" if state.step
                                        else "")
                                     + "); stopping before it reaches the weights")
        state.losses[m] = value
        if count is None:
            return loss.reshape(()) * (state.loss_scale[m] * state.grad_scale)
        state.counts[m] = count
        return loss.reshape(()) * state.grad_scale

    def _rebuilt(self, m: int, saved: Saved, pairs: list[Pair],
                 state: StepState) -> list[Pair]:
        """``pairs`` (output, gradient) moved onto a graph of the stage rebuilt now.

        A split backward of a recomputed micro-batch rebuilds the stage's graph here,
        once, and I and W both use it; left to torch.utils.checkpoint, each of the two
        backward calls would recompute the stage. A loss recomputed with the stage is
        computed again on the rebuilt outputs. Another loss at the last stage is first
        back-propagated to the stage's outputs (its own graph was kept), as loss_fn read
        them: each through a view of its own (see :func:`_read_apart`), so that the
        gradient of each is what the loss sends into it directly. The gradient of the
        output itself would be the total one, which also counts what flows into it
        through the stage from the other outputs (an output another one is made from,
        an input the stage returns as it is); the rebuilt graph adds that again.
        """
        assert saved.effects is not None
        if saved.loss_with_stage:
            return [(self.recompute(saved.inputs, m, saved.effects, step_seed=state.step_seed,
                                    loss_of=lambda out: self._loss(m, out, state, again=True)),
                     None)]
        if saved.loss is not None:
            read = pytree.tree_leaves(saved.read)
            at = [i for i, t in enumerate(read)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = torch.autograd.grad(saved.loss, [read[i] for i in at], allow_unused=True)
            by_position: list[tuple[int, torch.Tensor | None]] = [
                (i, g) for i, g in zip(at, grads) if g is not None]
        else:
            leaves = pytree.tree_leaves(saved.outputs)
            positions = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
            by_position = [(positions[id(out)], grad) for out, grad in pairs]
        outputs = pytree.tree_leaves(self.recompute(saved.inputs, m, saved.effects,
                                                    step_seed=state.step_seed))
        return [(outputs[i], grad) for i, grad in by_position]


def recomputed_with_stage(loss_fn: Any) -> bool:
    """Whether a recomputed micro-batch's loss is recomputed with the last stage's layers
    (see :meth:`StageActions._loss`): unless ``loss_fn`` says otherwise with
    ``recomputed_with_stage = False`` (as conveyor.VocabParallelCrossEntropy)."""
    return bool(getattr(loss_fn, "recomputed_with_stage", True))


def _read_apart(outputs: Any) -> Any:
    """``outputs`` with each tensor that requires grad replaced by a view of it, made
    for loss_fn alone: the loss's gradient w.r.t. the view is what loss_fn itself sends
    into that output, and taking it runs nothing of the stage's graph (a recomputed
    stage's, whose saved tensors would be recomputed to get through it)."""
    return pytree.tree_map(
        lambda t: t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t,
        outputs)
