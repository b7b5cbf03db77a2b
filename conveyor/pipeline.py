"""``Pipeline``: a training step by any schedule, on threads or on torchrun processes.

::

    pipe = conveyor.Pipeline(model, stages=4, chunks=16, schedule="1f1b", loss_fn=criterion)
    optimizer = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(inputs, targets)      # forward + backward of every micro-batch
    optimizer.step()

The same script runs in one process (stages on threads, one device each) and under
``torchrun --nproc-per-node 4`` (one stage per process, activations and gradients over
torch.distributed). The loss is computed per micro-batch at the last stage and weighted
by the micro-batch's share of the batch, so for a loss that averages over samples the
gradients equal those of the plain model on the whole batch; a loss averaged over a
varying number of elements (tokens with padding) returns ``(loss_sum, count)`` instead,
and is divided by the whole batch's count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.distributed.topology import Topology
from conveyor.engine.devices import Device
from conveyor.engine.loss import LossFn, LossScaler
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.errors import ConveyorError
from conveyor.graph.source import LayerBuilder
from conveyor.graph.weights import InitFn, Weights
from conveyor.runtime.build import Pending, build, place
from conveyor.runtime.options import PipelineOptions
from conveyor.runtime.rebalance.rebalancing import BalancePolicy, Rebalancing
from conveyor.runtime.runtime import RunsRuntime
from conveyor.runtime.steps import clip_gradients, infer, train_step
from conveyor.schedules import Schedule

__all__ = ["Pipeline"]


class Pipeline(RunsRuntime):
    """A model trained by a pipeline schedule, in one process or over many.

    Args:
        module: the model as an ``nn.Sequential`` (possibly on the meta device, to hold
            only local layers in memory), or a function that builds layer i (then give
            ``layers``).
        loss_fn: ``loss_fn(output, target)`` for one micro-batch: a scalar averaging
            over its samples (reduction="mean"), or a pair ``(loss_sum, count)`` for a
            loss averaged over a number of elements that varies (see :meth:`step`).
            ``conveyor.VocabParallelCrossEntropy("lm_head")``: the model's head and its
            cross-entropy split by vocabulary over every rank (the head is taken out of
            ``module``), or with ``tensor_parallel`` over the last stage's tensor group
            (see ``conveyor.runtime.vocabulary``).
        chunks: the number of micro-batches M per batch.
        stages: the number of pipeline ranks K (default: the world size under
            torchrun, else the number of ``devices``).
        layers: the number of layers, when ``module`` is a function.
        balance: layers per stage (K·V entries); None evens out parameters; "time"
            evens out forward+backward time measured on ``sample``. For a model that
            is not an ``nn.Sequential``, None or "time" choose ``split_at``.
        split_at: for any ``nn.Module`` (possibly built on the meta device): the
            qualified names of the submodules where stages 1, 2, ... begin
            (``["model.layers.2"]``); K·V - 1 names. None chooses them among the
            model's repeated blocks (the children of its largest ``nn.ModuleList``),
            balanced as ``balance`` says; the cut is kept as ``pipe.split_at``.
        sample: one micro-batch as the model takes it (a tensor, a tuple of positional
            arguments or a dict of any of forward's arguments by name), to trace or profile
            the model. Optional in one process: the first micro-batch of the first
            :meth:`step` is then the sample (until then ``parameters()`` are the model's).
            Under torchrun each rank keeps only its stages: every rank passes it, alike.
        schedule: "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-v",
            "dualpipe-v", "v-half", "v-min" (``conveyor.schedules.SCHEDULES``), or a
            Schedule table.
        virtual_stages: stages per rank (V) for "interleaved-1f1b".
        devices: in one process, one device per rank (default: the CUDA devices, else
            the CPU for every rank).
        recompute: which micro-batches are recomputed in backward rather than kept:
            "always", "except_last" (default) or "never"; or a list of one per stage
            (``["never", "always"]``: the first stage keeps its activations).
        checkpoint: another name for ``recompute`` (torchgpipe's).
        offload: "activations" moves what each micro-batch's forward saves for its
            backward to host memory until one action before that backward, on every
            stage (micro-batches whose backward follows within two actions, and those
            recomputed, stay); or one entry per stage, "activations" or None
            (``[None, "activations"]``). On CUDA: pinned memory and a side stream,
            overlapped with compute; see ``conveyor.engine.offload``.
        data_parallel: D replicas of the pipeline (under torchrun, world = K·D; each
            replica steps on its own batch); or replicas per stage, ``[2, 1]``:
            PipeDream's replicated stages, one pipeline of 2 + 1 processes in which
            stage 0's two replicas take turns at the micro-batches (every rank steps
            on the same batch, as without replicas).
        sharding: how the D replicas hold a stage: "replicate" (a whole copy each,
            gradients all-reduced) or "fsdp" (torch's FSDP2: 1/D of the parameters,
            gradients and optimizer state each; see ``conveyor.distributed.sharding``).
        tensor_parallel: T processes per stage, its planned modules split over them
            (under torchrun, world = K·D·T on one (pipeline, data, tensor) mesh, tensor
            innermost: global rank (k·D + d)·T + t; see ``conveyor.tensor``). Each
            rank's ``parameters()``, ``state_dict()`` and gradients are its shards
            (plain tensors, the plain model's names); ``conveyor.tensor.full.full_state_dict``
            puts the whole tensors together, and ``weights=`` reads each rank's slice.
        tp_plan: with ``tensor_parallel``: "auto" (a Hugging Face model's own plan) or
            ``{pattern: style}`` over the model's qualified names (``*``: one name),
            a style being "colwise", "rowwise", "colwise_gather_output",
            "embedding_rowwise", "replicated_with_grad_allreduce", "replicated" or a
            torch ``ColwiseParallel()``/``RowwiseParallel()``; any other style is
            refused by name (``TensorParallelError``), as is a size T that does not
            divide a split dimension or the model's heads.
        tie_weights: groups of parameter names that are one weight (needed when the
            model is a function or on the meta device; a model whose layers share a
            Parameter object is tied automatically).
        rebalance: a policy (``conveyor.Rebalance(window=, threshold=)``) that measures
            the stages while training and, when another balance would make the step
            enough faster, moves layers between stages between two steps, with their
            optimizer state (call :meth:`attach_optimizer`); see
            ``conveyor.runtime.rebalance.rebalancing``.
        check_finite: refuse a step whose loss (of a micro-batch) or gradients hold a
            NaN or an infinity, on every rank, naming the step, stage and micro-batch;
            ``.grad`` is left as before the step, so nothing reaches the weights
            (default True; its cost, 0.3 % of a small Transformer's step on a CPU, is
            in ``docs/limits.md``); False lets them through.
        precision: "bf16" or "fp16" runs every stage under ``torch.autocast`` to that
            dtype, weights and gradients staying in their own (float32: master weights);
            "fp16" also scales the loss (:attr:`scaler`, a :class:`LossScaler`: a step
            whose gradients overflow on any rank is dropped on every rank and
            ``pipe.scaler.step(optimizer)`` skips it). None: as called (a caller's own
            ``torch.autocast`` reaches every stage too).
        compile: compile this process's stages with ``torch.compile``: a stage of
            layers as one graph in each mode in which none of them draws random
            numbers, else each layer (dropout modules stay eager); a traced stage each
            of its graphs (one that draws random numbers stays eager). The random
            streams, recomputation and the ``I``/``W`` split stay exact; torch's
            donated buffers are turned off for the process; outputs are handed on laid
            out in memory as eager would (see ``conveyor.engine.compiled.stages``).
        cuda_graphs: with ``compile=True`` on CUDA devices, replay each stage's
            compiled graph, forward and backward, from CUDA graphs: one capture per
            kind of input and micro-batch in flight, each checked against the compiled
            stage at its first replay (see ``conveyor.engine.compiled.cudagraphs``). For
            schedules that do not split the backward, without recomputation, offload
            or FSDP; refused elsewhere. 2.46x eager bf16 under 1F1B on an H200.
        timeout: seconds any wait may take (a receive, a collective, one action) before
            the step fails with a report of where every rank stood; None (default)
            fits them to the phase: 300 s at start-up, in the first step and for a
            peer's first message of a step, later 10 x the slowest recent step (at
            least 30 s). See ``conveyor.engine.watchdog.deadline``.
        deferred_batch_norm: batch-norm statistics over the whole mini-batch.
        init_fn: with ``split_at`` and a model on the meta device, ``init_fn(module)``
            initialises each module of the rank's stages (default: the model's
            ``_init_weights`` if it has one, as Hugging Face models do, else each
            module's ``reset_parameters()``).
        weights: with ``split_at``, a ``state_dict`` or a checkpoint file of the plain
            model (``.safetensors`` or ``torch.save``), or a model directory as stored
            (sharded safetensors and their index, ``pytorch_model.bin``); each rank
            opens only the files holding its own tensors and reads only those.
        topology: where the pipeline's ranks are, given rather than read from the
            environment: ``Topology(pipeline_size=K)`` runs every stage in this process
            (on threads) even under torchrun; a ``Topology`` of process groups (as
            ``Topology.from_environment`` makes) runs one rank of them. Default: read
            from the environment (torchrun's, or one process).
        verify_every: every N-th :meth:`step` (None: never, the default) is re-run
            through the unpartitioned computation, stage by stage on the stages' own
            devices (no schedule, recomputation or accumulation), and its loss and each
            parameter's gradient compared at the run's precision: logs "verified at
            step s" (logger "conveyor", INFO) or raises
            :class:`~conveyor.errors.VerificationError` naming the first tensor that
            differs. Training state is left as it was; costs about one more forward
            and backward per N steps. One process only, for now (see
            ``conveyor.runtime.verify``).
        plan: a :class:`conveyor.planner.PipelinePlan` (``conveyor.planner.solve``, or
            ``PipelinePlan.load`` of ``conveyor plan --save``): its cut, schedule,
            ``chunks``, recomputation per stage and replicas (``data_parallel``) are
            used; giving one of them too is an error unless it agrees.
    """

    def __init__(
        self,
        module: nn.Module | LayerBuilder,
        *,
        loss_fn: LossFn,
        chunks: int | None = None,
        stages: int | None = None,
        layers: int | None = None,
        balance: Sequence[int] | str | None = None,
        split_at: Sequence[str] | None = None,
        sample: Any = None,
        schedule: str | Schedule = "gpipe",
        virtual_stages: int = 1,
        devices: Sequence[Device] | None = None,
        recompute: str | Sequence[str] | None = None,
        checkpoint: str | Sequence[str] | None = None,
        offload: str | Sequence[str | None] | None = None,
        data_parallel: int | Sequence[int] = 1,
        sharding: str = "replicate",
        tensor_parallel: int = 1,
        tp_plan: str | Mapping[str, Any] | None = None,
        tie_weights: Sequence[Sequence[str]] = (),
        check_finite: bool = True,
        precision: str | None = None,
        compile: bool = False,
        cuda_graphs: bool = False,
        timeout: float | None = None,
        deferred_batch_norm: bool = False,
        init_fn: InitFn | None = None,
        weights: Weights | None = None,
        rebalance: BalancePolicy | None = None,
        topology: Topology | None = None,
        verify_every: int | None = None,
        plan: Any = None,
    ) -> None:
        super().__init__()
        self.options = options = PipelineOptions.of(locals())
        if isinstance(module, nn.Module):  # in the model's mode: train() or eval() to change
            self.training = module.training
        self.loss_fn, self.chunks, self.recompute = loss_fn, options.chunks, options.mode
        self.scaler = LossScaler() if precision == "fp16" else None
        placed = place(self, module, options)
        self.topology, self.devices = placed.topology, placed.devices
        #: a vocabulary-parallel head's shards (``loss_fn=VocabParallelCrossEntropy``)
        self.vocab_shards = placed.vocabulary
        self.schedule = placed.schedule  # before the layers: no layer takes the name
        self._rebalancing: Rebalancing | None = None
        self._pending: Pending | None = placed.pending
        if not placed.pending.at_first_call:
            self._build(sample)

    def _build(self, sample: Any) -> None:
        """Cuts the model and builds the runtime (when built, or at the first step)."""
        pending, self._pending = self._pending, None
        assert pending is not None
        built = build(self, pending, self.options, self.schedule, self.topology, self.devices,
                      sample=sample, snapshot=self._snapshot, scaler=self.scaler)
        self.schedule, self._runtime, self._training = built.schedule, built.runtime, \
            built.training
        self._rebalancing = built.rebalancing

    @property
    def certificate(self) -> Any:
        """``verify_every=``'s :class:`~conveyor.runtime.verify.Certificate` (its
        ``verified`` steps), or None."""
        return None if self._pending is not None else self._training.certificate

    @property
    def rebalancing(self) -> Rebalancing | None:
        """The measurements and moves of ``rebalance=`` (``moves`` made so far), or None."""
        return self._rebalancing

    # ----------------------------------------------------------------- the user API

    def step(self, inputs: Any = None, targets: Any = None, *,
             microbatches: Sequence[tuple[Any, Any]] | None = None) -> torch.Tensor:
        """Forward and backward of one batch by the schedule; gradients accumulate.

        Every rank calls it with the batch (ranks that do not hold the first or last
        stage may pass None for inputs or targets). ``loss_fn`` returns, per
        micro-batch, either a scalar that averages over its samples, weighted by the
        micro-batch's share of the batch, or a pair ``(loss_sum, count)``: then the
        batch's loss is the sum of ``loss_sum`` over all micro-batches (and data-parallel
        replicas) divided by the sum of ``count``, exactly as for the plain model on the
        whole batch (a token loss with padding: ``count`` is the number of real tokens).

        ``microbatches=[(inputs, targets), ...]`` takes micro-batches already made, in
        place of the batch: each may have its own shape (its own sequence length, or
        packed sequences with their ``position_ids`` in a dict of inputs), at most
        ``chunks`` of them (the table's first actions run for fewer). Every rank passes
        the same list.

        Returns:
            The batch's loss, detached, as float64, on every rank.

        Raises:
            StageError: a stage failed; on every rank, naming the stage and micro-batch.
            NonFiniteLossError, NonFiniteGradientError: with ``check_finite`` (the
                default), a micro-batch's loss or the step's gradients are NaN or inf
                (on every rank).
            ConveyorError: the counts of a ``(loss_sum, count)`` loss add up to 0.

        A step that raises leaves ``.grad`` as it was before the step.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipeline.step() trains and needs grad enabled; use "
                               "eval_step() for inference")
        if microbatches is not None and (inputs is not None or targets is not None):
            raise ConveyorError("step() takes a batch (inputs, targets) or microbatches=, "
                                "not both")
        first = next(iter(microbatches), (None, None))[0] if microbatches is not None \
            else inputs
        self._cut_at_first_call(first)
        if self._rebalancing is not None:  # between two steps: may move layers
            self._runtime = self._rebalancing.before_step(self._runtime, self)
        completed = False
        certificate = self._training.certificate  # verify_every=
        before = certificate.before(list(self.parameters())) \
            if certificate is not None and certificate.due() else None
        try:
            loss = train_step(self._runtime, self._training, inputs, targets,
                              loss_fn=self.loss_fn, params=list(self.parameters()),
                              training=self.training, microbatches=microbatches)
            completed = True
        finally:
            if self._rebalancing is not None:
                self._rebalancing.after_step(self._runtime, completed=completed)
        if certificate is not None and before is not None and not (
                self.scaler is not None and self.scaler.found_inf):  # (a dropped step)
            certificate.verify(self._runtime, before, list(self.named_parameters()),
                               (inputs, targets) if microbatches is None else microbatches,
                               loss_fn=self.loss_fn, loss=loss, dtype=self._training.dtype,
                               training=self.training)
        return loss

    @torch.no_grad()
    def eval_step(self, inputs: Any) -> Any:
        """The pipelined forward of a batch, without gradients or recomputation.

        A batch of fewer samples than ``chunks`` runs as one micro-batch per sample (the
        first actions of the table), so one pipeline serves batches of any size, a
        single sequence included. Under torchrun, stage 0's rank decides the number
        and tells the others (a broadcast): every rank calls it.

        Returns:
            The gathered output where the last stage runs (in one process: always),
            None on the other ranks.
        """
        self._cut_at_first_call(inputs)
        output = infer(self._runtime, self._training, inputs, training=self.training)
        return self._runtime.head_logits(output, self.vocab_shards, self.loss_fn)

    def forward(self, inputs: Any) -> Any:
        """``pipe(inputs)``: inference, as :meth:`eval_step` (in eval mode, or with
        gradients off). Training goes through :meth:`step`, which runs the backward
        too; ``conveyor.GPipe`` is the face whose forward is differentiable.

        Raises:
            ConveyorError: in training mode with gradients enabled.
        """
        if self.training and torch.is_grad_enabled():
            raise ConveyorError(
                "Pipeline(inputs) runs inference, the same as pipe.eval_step(inputs): call "
                "pipe.eval() first or run it under torch.no_grad(); to train, call "
                "pipe.step(inputs, targets) (forward and backward by the schedule), or use "
                "conveyor.GPipe, whose forward is differentiable")
        return self.eval_step(inputs)

    def _cut_at_first_call(self, inputs: Any) -> None:
        """Built without ``sample=``: cuts the model on the first call's first micro-batch."""
        if self._pending is not None:
            self._build(inputs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips gradients by their norm over every stage and rank; returns that norm."""
        return clip_gradients(self._runtime, list(self.parameters()), max_norm, norm_type,
                              sharded=self._training.sharding is not None)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Lets re-balancing (``rebalance=``) keep ``optimizer`` in step with the layers
        it moves: their state moves with them, and under torchrun the parameters a rank
        gives away leave its optimizer and those it takes over join the group with the
        same hyper-parameters. Needed when layers can change device or process."""
        if self._rebalancing is not None:
            self._rebalancing.optimizer = optimizer

    @property
    def timeouts(self) -> Deadlines:
        """The seconds a wait may take: ``opening`` (start-up, a peer's first message
        of a step, between steps) and ``within`` (any other wait of a step)."""
        return self._pending.deadlines if self._pending is not None else \
            self._runtime.deadlines

    def extra_repr(self) -> str:
        where = (f"rank {self.topology.pipeline_rank} of {self.topology.pipeline_size}"
                 if self.topology.distributed else f"devices={[str(d) for d in self.devices]}")
        balance = "cut at the first call" if self._pending is not None else self.balance
        return (f"schedule={self.schedule.name!r}, balance={balance}, "
                f"chunks={self.chunks}, recompute={self.recompute!r}, {where}")

    # ----------------------------------------------------------------- internals

    def _snapshot(self) -> dict[str, Any] | None:
        """This rank's place in the current (or last) step (the whereabouts' answer)."""
        return self._runtime.snapshot()

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the last stage's rank has it, on every rank of this pipeline
        (in one process: ``value`` itself). A collective: every rank calls it."""
        return self._runtime.from_last_stage(value)
