"""``GPipe``: a drop-in ``nn.Module`` that runs a model as a pipeline on one process.

``pipe(x)`` splits the batch into micro-batches and runs the forward half of the GPipe
schedule on one thread per stage; the gathered output is connected to the autograd
graph through one function node, whose backward runs the backward half of the same
table. So ``loss.backward()`` is pipelined too, and parameter gradients arrive through
autograd exactly as for the plain model: summed over micro-batches, they equal the
gradients of the unpartitioned model on the whole mini-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.runtime.finite import check_gradients, check_output_gradients
from conveyor.runtime.runtime import Runtime, RunsRuntime
from conveyor.runtime.wiring import Threads
from conveyor.distributed.topology import Topology
from conveyor.engine.backward.accumulation import SetAside, fusing_allowed
from conveyor.engine.devices import Device, resolve_devices
from conveyor.engine.executor import thread_devices
from conveyor.engine.microbatch import (
    batch_size,
    gather,
    microbatch_count,
    microbatch_sizes,
    split,
)
from conveyor.engine.recompute.replay import check_stage_modes
from conveyor.engine.step import StepState, check_options, new_step
from conveyor.engine.ties import TiedParameter, sum_tied_gradients
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.errors import BalanceError, LayerOutputError, ModelError
from conveyor.graph.layout import cut
from conveyor.graph.weights import InitFn, Weights
from conveyor.schedules import Kind, gpipe, validate
from conveyor.torchprivate import pytree

__all__ = ["GPipe"]


class GPipe(RunsRuntime):
    """Wraps a model so that it trains as a GPipe pipeline: an ``nn.Sequential`` cut by
    ``balance``, or any module cut at named submodules (``split_at``).

    Example::

        pipe = GPipe(model, balance=[3, 5], devices=["cuda:0", "cuda:1"], chunks=8)
        loss = criterion(pipe(x), y.to(pipe.devices[-1]))
        loss.backward()
        optimizer.step()

    The layers keep their names, so ``pipe.state_dict()`` has exactly the keys of the
    plain model's and checkpoints move freely between the two and any partition. A
    weight that layers of two stages share (a language model's embedding and head)
    becomes one copy per stage; gradients are summed into every copy, so an optimizer
    over ``pipe.parameters()`` keeps the copies equal and steps as the plain model.

    Args:
        module: the model: an ``nn.Sequential`` of layers with ``balance``, or any
            ``nn.Module`` with ``sample`` (cut at ``split_at``, or where conveyor
            chooses; then it may be built on the meta device). Its tensors are moved
            to their stages' devices.
        balance: the number of consecutive layers of each stage, e.g. ``[3, 5]``;
            :mod:`conveyor.balance` computes one. Where a layer pops a value
            (:mod:`conveyor.skip`) that a layer of an earlier stage stashed, the layers
            are traced on ``sample`` and cut where the balance says. For a model that
            is not an ``nn.Sequential``: None or "time", how to choose ``split_at``.
        split_at: for any ``nn.Module``, the qualified names of the submodules where
            stages 1, 2, ... begin (``["transformer.h.2"]``); None chooses them among
            the model's repeated blocks (the children of its largest ``nn.ModuleList``)
            by parameters, or by time with ``balance="time"``. The cut is kept as
            ``pipe.split_at``.
        sample: one micro-batch as the model takes it (a tensor, a tuple of positional
            arguments or a dict of keyword arguments), to trace a model cut at
            submodules or a layer list whose skips cross stages.
        stages: the number of stages K when conveyor chooses the cut (default: the
            number of ``devices``).
        devices: one device per stage; may repeat (``["cpu", "cpu"]`` runs two stages
            on parallel CPU threads). Default: ``cuda:0..K-1`` if CUDA is available,
            else the CPU for every stage.
        chunks: the number of micro-batches M each batch is split into.
        recompute: which micro-batches are recomputed in backward rather than kept:
            ``"always"``, ``"except_last"`` (default, as the paper) or ``"never"``.
        checkpoint: another name for ``recompute`` (torchgpipe's).
        deferred_batch_norm: make batch norms update running statistics once per step
            from the whole mini-batch, rather than once per micro-batch.
        init_fn: with ``split_at`` and a model on the meta device, ``init_fn(module)``
            initialises each module (default: the model's ``_init_weights`` if it has
            one, as Hugging Face models do, else each module's ``reset_parameters()``).
        weights: with ``split_at``, a ``state_dict`` or a checkpoint file of the plain
            model (``.safetensors`` or ``torch.save``) to load the meta tensors from.
        timeout: seconds a stage may wait for another, or run one action, before the
            call fails with :class:`~conveyor.StepTimeout` and a report of where every
            stage stood (the stuck thread is left running, and the pipeline refuses
            further calls); None (default) allows 300 s in the first call and then
            10 x the slowest call (at least 30 s).
        check_finite: refuse, in ``backward()``, a gradient of the output (of a micro-
            batch) or of a stage's weights that holds a NaN or an infinity
            (:class:`~conveyor.NonFiniteGradientError`, naming the micro-batch or
            stage), leaving ``.grad`` as it was; default True, False lets it through.

    Raises:
        ModelError: ``module`` is not an ``nn.Module``, cannot be traced or cut where
            asked, or a layer's name would shadow an attribute of GPipe.
        BalanceError: ``balance`` does not fit the model, or ``devices`` the balance;
            nothing says how many stages (``balance``, ``split_at``, ``stages`` or
            ``devices``).
        MicroBatchError: ``chunks`` is not a positive integer.
        ValueError: an unknown ``recompute`` mode, or both it and ``checkpoint``.
    """

    def __init__(
        self,
        module: nn.Module,
        balance: Sequence[int] | str | None = None,
        *,
        split_at: Sequence[str] | None = None,
        sample: Any = None,
        stages: int | None = None,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        recompute: str | Sequence[str] | None = None,
        checkpoint: str | Sequence[str] | None = None,
        deferred_batch_norm: bool = False,
        init_fn: InitFn | None = None,
        weights: Weights | None = None,
        timeout: float | None = None,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ModelError(f"GPipe runs an nn.Module (an nn.Sequential of layers, or any "
                             f"model with sample=), got {type(module).__name__}; for a "
                             "function that builds layer i, use conveyor.Pipeline(layers=)")
        mode = check_options(chunks=chunks, recompute=recompute, checkpoint=checkpoint)
        self.training = getattr(module, "training", True)  # the model's mode
        self.chunks: int = chunks
        self.check_finite, self._calls = check_finite, 0
        self.recompute: str | tuple[str, ...] = mode
        count = _stage_count(module, balance, split_at, stages, devices)
        check_stage_modes(mode, count)
        self.devices: list[torch.device] = resolve_devices(
            devices, count, what=_counted_by(balance, split_at, stages, count))
        # Set before the layers are registered, so that a layer cannot take their names.
        self.partitions: list[nn.Sequential] = []
        layout = cut(self, module, stages=count, devices=dict(enumerate(self.devices)),
                     local=range(count), concurrent=thread_devices(self.devices), balance=balance,
                     split_at=split_at, sample=sample,
                     deferred_batch_norm=deferred_batch_norm, init_fn=init_fn,
                     weights=weights)
        self.partitions.extend(layout.stages[s].layers for s in range(count))
        schedule = gpipe(count, chunks).with_edges(layout.edges)
        validate(schedule)
        self._runtime = Runtime(layout, schedule, Topology(pipeline_size=count), self.devices,
                                Deadlines(timeout), Threads(),
                                fuse_accumulation=fusing_allowed())

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return (f"balance={self.balance}, devices=[{devices}], chunks={self.chunks}, "
                f"recompute={self.recompute!r}")

    def forward(self, input: Any) -> Any:
        """Runs the pipeline on a batch; returns the output on the last stage's device.

        Args:
            input: a tensor or nested tuple/list/dict of tensors whose dim 0 is the batch.

        A batch of fewer samples than ``chunks`` runs as one micro-batch per sample.

        Raises:
            MicroBatchError: the batch holds no batched tensor, or they disagree on its size.
            StageError: a layer failed; the message names the stage, layer and micro-batch.
            LayerOutputError: a layer returned something that is not tensors.
        """
        count = microbatch_count(input, self.chunks)
        microbatches = split(input, count)
        leaves = pytree.tree_leaves(input)
        wrt_inputs = [i for i, t in enumerate(leaves)
                      if isinstance(t, torch.Tensor) and t.requires_grad]
        runtime = self._runtime
        params = [p for s in sorted(runtime.stages)
                  for p in runtime.stages[s].trainable_parameters()]
        grad_enabled = torch.is_grad_enabled() and bool(params or wrt_inputs)
        state = new_step(microbatches, chunks=count, recompute=self.recompute,
                         grad_enabled=grad_enabled, training=self.training)
        self._calls += 1
        step = _Step(runtime, state, leaves=leaves, wrt_inputs=wrt_inputs, params=params,
                     ties=runtime.layout.ties, checked=self._calls if self.check_finite else 0)
        if not grad_enabled:
            return step.forward()
        token = _PipelineFunction.apply(step, *[leaves[i] for i in wrt_inputs], *params)
        return step.assemble(_Outputs.apply(step, token))


class _Step:
    """One pipelined call: runs the table's forward half, later its backward half."""

    def __init__(
        self,
        runtime: Runtime,
        state: StepState,
        *,
        leaves: list[Any],
        wrt_inputs: list[int],
        params: list[nn.Parameter],
        ties: list[TiedParameter],
        checked: int = 0,
    ) -> None:
        self.runtime = runtime
        self.checked = checked  # the call's number, whose gradients are checked (0: none)
        self.state = state
        self.leaves = leaves
        self.wrt_inputs = wrt_inputs
        self.params = params
        self.ties = ties
        self.output_spec: Any = None
        self.output_leaves: list[Any] = []
        self.differentiable: list[bool] = []
        self.output_grads: tuple[torch.Tensor | None, ...] = ()
        self.backward_done = False

    def forward(self) -> Any:
        self.runtime.run([Kind.FORWARD], self.state, microbatches=len(self.state.inputs))
        outputs = [self.state.outputs[m] for m in range(len(self.state.inputs))]
        with torch.no_grad():
            gathered = gather(outputs)
        self.output_leaves, self.output_spec = pytree.tree_flatten(gathered)
        if not any(isinstance(t, torch.Tensor) for t in self.output_leaves):
            raise LayerOutputError("the pipeline's output holds no tensor")
        # Whether each output leaf depends on something that requires grad.
        self.differentiable = [
            any(isinstance(t, torch.Tensor) and t.requires_grad for t in column)
            for column in zip(*(pytree.tree_leaves(out) for out in outputs))
        ]
        return gathered

    def tensor_outputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The output tensors, detached, and those of them that carry no gradient."""
        tensors, constant = [], []
        for leaf, differentiable in zip(self.output_leaves, self.differentiable):
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf.detach())
                if not differentiable:
                    constant.append(tensors[-1])
        return tensors, constant

    def assemble(self, flat: Sequence[torch.Tensor]) -> Any:
        """The output pytree with the autograd-connected tensors in place."""
        tensors = iter(flat)
        leaves = [next(tensors) if isinstance(t, torch.Tensor) else t for t in self.output_leaves]
        return pytree.tree_unflatten(leaves, self.output_spec)

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        if self.backward_done:
            raise RuntimeError(
                "GPipe's backward ran twice for one forward; retain_graph=True is not "
                "supported, call the pipeline again instead"
            )
        self.backward_done = True
        state = self.state
        num_microbatches = len(state.inputs)
        sizes = microbatch_sizes(batch_size(self.leaves), num_microbatches)
        full = iter(grads)
        per_leaf = [
            (next(full) if isinstance(t, torch.Tensor) else None) for t in self.output_leaves
        ]
        split_grads = [g.split(sizes) if g is not None else None for g in per_leaf]
        for m in range(num_microbatches):
            state.output_grads[m] = [parts[m] if parts is not None else None
                                     for parts in split_grads]
        if self.checked:
            check_output_gradients([state.output_grads[m] for m in range(num_microbatches)],
                                   self.checked)
        # Let the stages accumulate into fresh .grad fields, then hand the totals to
        # autograd: backward() adds them to the .grad set aside here, and
        # autograd.grad() returns them without touching .grad at all.
        earlier = SetAside(self.params)
        try:
            self.runtime.run([Kind.BACKWARD], state, commit=False,
                             microbatches=num_microbatches)
            sum_tied_gradients(self.ties)
            if self.checked:
                check_gradients(self.runtime, self.params, self.checked)
            param_grads = [p.grad for p in self.params]
        finally:
            earlier.restore()
        state.outputs.clear()
        input_grads: list[torch.Tensor | None] = []
        for i in self.wrt_inputs:
            parts = [state.input_grads[m][i] for m in range(num_microbatches)]
            input_grads.append(_combine(self.leaves[i], parts))
        return input_grads + param_grads


def _combine(leaf: torch.Tensor, parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The gradient of an input leaf from its micro-batches' gradients."""
    if all(p is None for p in parts):
        return None
    if leaf.dim() == 0:  # broadcast to every micro-batch: gradients add up
        return torch.stack([p for p in parts if p is not None]).sum(0).to(leaf.device)
    sizes = microbatch_sizes(leaf.shape[0], len(parts))
    filled = [
        p if p is not None else torch.zeros((size, *leaf.shape[1:]), dtype=leaf.dtype,
                                            device=leaf.device)
        for p, size in zip(parts, sizes)
    ]
    return torch.cat([p.to(leaf.device) for p in filled])


class _PipelineFunction(torch.autograd.Function):
    """Connects the pipeline to autograd: inputs and parameters in, a CPU token out.

    Its backward runs the stages' backward half and waits for them. Autograd runs a
    node on the thread of its gradients' device: the token keeps this node on the CPU,
    that is on the thread that called ``backward()``. On a CUDA device's autograd
    thread it would deadlock, since each stage's own ``backward`` on that device queues
    its work to that same thread.
    """

    @staticmethod
    def forward(ctx: Any, step: _Step, *tensors: torch.Tensor) -> torch.Tensor:
        step.forward()
        ctx.step = step
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, token_grad: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError("GPipe does not support higher-order gradients "
                               "(backward with create_graph=True)")
        return (None, *ctx.step.backward(ctx.step.output_grads))


class _Outputs(torch.autograd.Function):
    """The pipeline's outputs, after the token: its backward only keeps their gradients."""

    @staticmethod
    def forward(ctx: Any, step: _Step, token: torch.Tensor) -> Any:
        ctx.step = step
        ctx.set_materialize_grads(False)
        outputs, constant = step.tensor_outputs()
        ctx.mark_non_differentiable(*constant)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.step.output_grads = grads
        return None, torch.zeros(())


def _stage_count(module: nn.Module, balance: Sequence[int] | str | None,
                 split_at: Sequence[str] | None, stages: int | None,
                 devices: Sequence[Device] | None) -> int:
    """The number of stages K that GPipe's arguments ask for.

    Raises:
        BalanceError: they disagree, or an ``nn.Sequential`` comes without a balance.
    """
    given = "split_at" if split_at is not None else "balance"
    derived = (len(split_at) + 1 if split_at is not None
               else len(balance) if isinstance(balance, Sequence) and not isinstance(balance, str)
               else None)
    if derived is not None:
        if stages is not None and stages != derived:
            raise BalanceError(f"stages={stages}, but {given} gives {derived} stages")
        return derived
    if isinstance(module, nn.Sequential):
        raise BalanceError("give balance= (layers per stage) for an nn.Sequential, or "
                           "split_at= (submodule names) and sample= for any module"
                           + ("; conveyor.balance.balance_by_time(model, sample, stages) "
                              "computes one by time" if balance == "time" else ""))
    if stages is not None:
        return stages
    if devices is None:
        raise BalanceError(f"to choose where to cut {type(module).__name__}, conveyor needs "
                           "the number of stages: give stages= or devices= (one per "
                           "stage), or split_at=")
    return len(devices)


def _counted_by(balance: Any, split_at: Any, stages: int | None, count: int) -> str:
    """What says there are ``count`` stages, for an error about devices."""
    if split_at is not None:
        return f"split_at gives {count} stages"
    if stages is not None or isinstance(balance, (str, type(None))):
        return f"stages={count}"
    return f"balance has {count} stages"
