"""The Hugging Face ``Trainer``, pipelined: :class:`PipelineTrainer` runs the model as a
``conveyor.Pipeline`` and keeps the rest of the ``Trainer`` (its loss, gradient
accumulation, clipping, LR schedule, logging, evaluation, saving and resuming)::

    trainer = PipelineTrainer(model=model, args=args, train_dataset=train,
                              pipeline={"stages": 2, "chunks": 4, "schedule": "1f1b"})
    trainer.train()

The same script runs in one process (stages on threads) and under ``torchrun`` (one
stage per process; ``stages`` x ``data_parallel`` processes): every rank of a pipeline
is fed the same batch, each data-parallel replica its own share of the data.

Where it differs from the plain ``Trainer``:

* **Gradient accumulation is micro-batching.** The ``gradient_accumulation_steps``
  batches of one optimizer step run as one pipeline step of ``chunks`` micro-batches
  each (``chunks`` x steps in all): the pipeline's bubble shrinks, and the loss is the
  one the ``Trainer`` computes over the whole accumulated batch (tokens counted over
  every batch and replica). The step's loss is returned for the last of those batches
  (0 for the others), so logged losses, which sum them, are the ``Trainer``'s.
* **The loss** is the model's own (its ``loss_function``, a causal LM's shifted
  cross-entropy) or ``compute_loss_func``, called per micro-batch with
  ``num_items_in_batch=1`` (a sum) and divided by the tokens the ``Trainer`` counts.
  A subclass's ``compute_loss`` is not called.
* **Saving** writes a standard model directory (``Pipeline.save_pretrained``: one
  safetensors file per stage and their index, the config, the tokenizer); a checkpoint
  holds one optimizer file per pipeline rank, and resuming reads each rank's stages
  back from the checkpoint's model directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import Trainer

from conveyor.engine.microbatch import split
from conveyor.errors import ConfigError, ConveyorError
from conveyor.pipeline import Pipeline
from conveyor.runtime.reload import load_pretrained
from conveyor.train.language import logits_of

__all__ = ["PipelineTrainer"]


class PipelineTrainer(Trainer):  # type: ignore[misc]
    """A ``transformers.Trainer`` whose model runs as a ``conveyor.Pipeline``.

    Args:
        *args: as ``Trainer``'s (``model``, ``args``, datasets, collator, callbacks...).
        pipeline: ``conveyor.Pipeline``'s options (``stages``, ``split_at``,
            ``schedule``, ``chunks``, ``plan``, ``data_parallel``, ``devices``, ...):
            ``chunks`` micro-batches per batch of ``per_device_train_batch_size``
            (default 1; a plan's own, with one batch per optimizer step). ``loss_fn``
            is the trainer's (see the module's docstring);
            ``sample`` defaults to the first example of the training set, collated.
            Under torchrun ``data_parallel`` defaults to the world size over ``stages``.
        **kwargs: as ``Trainer``'s.

    Raises:
        ConfigError: an option the pipeline cannot keep (label smoothing, ``loss_fn=``,
            a model that computes no loss of its own without ``compute_loss_func``).
    """

    def __init__(self, *args: Any, pipeline: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = dict(pipeline or {})
        if "loss_fn" in options:
            raise ConfigError("pipeline={'loss_fn': ...}: the trainer's loss is the model's "
                              "(or compute_loss_func=); give it there")
        if self.args.label_smoothing_factor:
            raise ConfigError("label_smoothing_factor is not pipelined yet; pass a "
                              "compute_loss_func= that smooths instead")
        accumulated = max(1, self.args.gradient_accumulation_steps)
        plan = options.get("plan")
        if plan is not None and accumulated > 1:
            raise ConfigError(
                f"plan= sets the micro-batches of one pipeline step, which here holds "
                f"gradient_accumulation_steps={accumulated} batches: plan for "
                f"{accumulated} times as many (conveyor plan --chunks), or accumulate 1")
        self.chunks = int(options.pop("chunks", 1) if plan is None
                          else plan.pipeline_options()["chunks"])
        if "sample" not in options and self.train_dataset is not None:
            options["sample"] = self._sample()
        if "data_parallel" not in options and "plan" not in options and \
                self.args.world_size > 1 and "stages" in options:
            options["data_parallel"] = self.args.world_size // int(options["stages"])
        #: the pipeline: ``self.model`` stays the model given, for its config and name
        model: Any = self.model
        if plan is None:
            options["chunks"] = self.chunks * accumulated
        self.pipe = Pipeline(model, loss_fn=self._loss_fn(), **options)
        self.model_wrapped = self.pipe
        self._waiting: list[dict[str, Any]] = []

    # ----------------------------------------------------------------- the loss

    def _loss_fn(self) -> Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``loss_fn(output, labels)``: the loss summed over a micro-batch's items, and
        their count as the ``Trainer`` counts them (a causal LM's shifted labels)."""
        custom: Any = self.compute_loss_func
        model: Any = self.model
        if custom is None and not self.model_accepts_loss_kwargs:
            raise ConfigError(
                f"{type(model).__name__} takes no num_items_in_batch, so its loss cannot be "
                "summed over micro-batches: pass compute_loss_func=(outputs, labels, "
                "num_items_in_batch) that divides a summed loss by num_items_in_batch")
        shifts = getattr(self, "_loss_shifts_labels",
                         getattr(model, "loss_type", None) == "ForCausalLM")
        vocabulary = getattr(model.config, "vocab_size", None)
        own: Any = model.loss_function if custom is None else None

        def loss_fn(output: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            counted = labels[..., 1:] if shifts else labels
            if own is not None:
                total = own(logits=logits_of(output), labels=labels, vocab_size=vocabulary,
                            num_items_in_batch=1)
            else:
                total = custom(output, labels, num_items_in_batch=1)
            return total, counted.ne(-100).sum()
        return loss_fn

    def _sample(self) -> Any:
        """One example of the training set as the collator makes it, without labels."""
        collate = self._get_collator_with_removed_columns(self.data_collator, "sample")
        dataset: Any = self.train_dataset
        batch = collate([dataset[0]])
        return {k: v for k, v in batch.items() if k not in self.label_names}

    def _split(self, batch: Mapping[str, Any]) -> list[tuple[Any, Any]]:
        """A batch as the pipeline's micro-batches: (inputs, labels) each."""
        inputs = {k: v for k, v in batch.items() if k not in self.label_names}
        if len(self.label_names) != 1:
            raise ConfigError(f"the pipeline takes one label tensor, the trainer has "
                              f"label_names={self.label_names}")
        labels = batch[self.label_names[0]]
        rows = int(labels.shape[0])
        return list(zip(split(inputs, min(self.chunks, rows)),
                        split(labels, min(self.chunks, rows))))

    # ----------------------------------------------------------------- training

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The pipeline, never wrapped again (no DDP: it reduces its own gradients)."""
        return self.pipe

    def create_optimizer(self, model: Any = None) -> Any:
        """The ``Trainer``'s optimizer over this rank's stages (its weight-decay groups
        by the parameters' own names)."""
        return super().create_optimizer(self.pipe)

    def training_step(self, model: Any, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Keeps the batch until the last of an optimizer step's accumulated batches,
        then runs them all as one pipeline step; returns that step's loss (0 before)."""
        self._waiting.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        self.pipe.train()
        optimizer: Any = self.optimizer
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()
        batches, self._waiting = self._waiting, []
        microbatches = [pair for batch in batches for pair in self._split(batch)]
        loss = self.pipe.step(microbatches=microbatches)
        return loss.to(self.args.device, torch.float32)

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        """Clips by the norm over every stage and rank (conveyor's clip)."""
        return self.pipe.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """The gradients' global norm (computed, not clipped, when not clipping)."""
        if grad_norm is None:
            grad_norm = self.pipe.clip_grad_norm_(float("inf"))
        return grad_norm

    def get_train_dataloader(self) -> Any:
        """The ``Trainer``'s loader, sharded over the data-parallel replicas only."""
        return self._by_replica(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The ``Trainer``'s evaluation loader, sharded over the replicas only."""
        return self._by_replica(super().get_eval_dataloader(eval_dataset))

    def _by_replica(self, loader: Any) -> Any:
        """Every rank of a pipeline reads the same batches: accelerate's shard of the
        world becomes this replica's shard of the replicas (as the ``Trainer`` itself
        undoes the shard for a rank-aware sampler)."""
        topology = self.pipe.topology
        if not topology.distributed:
            return loader
        sampler: Any = getattr(loader, "batch_sampler", None)
        if not hasattr(sampler, "process_index"):
            raise ConfigError(
                f"{type(loader).__name__} cannot be shared out by replica: the pipelined "
                "Trainer takes a map-style dataset (an IterableDataset is not supported yet)")
        sampler.num_processes, sampler.process_index = topology.data_size, topology.data_rank
        return loader

    # ----------------------------------------------------------------- evaluation

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """The pipelined forward of a batch, its loss as the ``Trainer`` computes it
        (normalised by the items counted over the replicas) on every rank, and the
        logits where the last stage runs."""
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get(self.label_names[0]) if len(self.label_names) == 1 else None
        features = {k: v for k, v in inputs.items() if k not in self.label_names}
        self.pipe.eval()
        output = self.pipe.eval_step(features)
        if labels is None:
            return None, (None if prediction_loss_only else logits_of(output)), None
        count = self._get_num_items_in_batch([inputs], self.args.device)
        loss = torch.zeros((), dtype=torch.float64, device=self.args.device)
        if output is not None:
            total, _ = self.pipe.loss_fn(output, labels)
            loss = (total / count * self.accelerator.num_processes).detach().to(loss)
        loss = self.pipe.from_last_stage(loss)
        if prediction_loss_only:
            return loss, None, None
        if self.pipe.topology.distributed:
            raise ConveyorError("under torchrun the pipelined Trainer evaluates the loss "
                                "only: set prediction_loss_only=True (logits for "
                                "compute_metrics are not gathered yet)")
        return loss, logits_of(output).detach(), labels

    # ----------------------------------------------------------------- saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A standard model directory (``from_pretrained`` loads it), gathered from the
        stages by ``Pipeline.save_pretrained``; as the ``Trainer`` does, into a folder
        that may hold other files (checkpoints), replacing a model saved there before."""
        folder = Path(str(output_dir or self.args.output_dir))
        fresh = folder / f".pipelined-{self.state.global_step}"
        self.pipe.save_pretrained(fresh, tokenizer=self.processing_class)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            for old in [*folder.glob("model*.safetensors"), *folder.glob("pytorch_model*.bin"),
                        *folder.glob("model.safetensors.index.json")]:
                old.unlink()
            for made in fresh.iterdir():
                made.replace(folder / made.name)
            fresh.rmdir()
            torch.save(self.args, folder / "training_args.bin")
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """This rank's stages' weights from a checkpoint's model directory."""
        load_pretrained(self.pipe, self.pipe.runtime, resume_from_checkpoint)

    def _optimizer_file(self, folder: str) -> str:
        topology = self.pipe.topology
        name = "optimizer.pt" if not topology.distributed else \
            f"optimizer.stage-{topology.pipeline_rank}-of-{topology.pipeline_size}.pt"
        return os.path.join(folder, name)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer's state of each pipeline rank (replica 0's), and the schedule."""
        optimizer: Any = self.optimizer
        schedule: Any = self.lr_scheduler
        if self.pipe.topology.data_rank == 0:
            torch.save(optimizer.state_dict(), self._optimizer_file(output_dir))
        if self.args.should_save:
            torch.save(schedule.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The state :meth:`_save_optimizer_and_scheduler` wrote, on every rank."""
        if checkpoint is None:
            return
        optimizer: Any = self.optimizer
        schedule: Any = self.lr_scheduler
        optimizer.load_state_dict(torch.load(self._optimizer_file(checkpoint), weights_only=True))
        schedule.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"),
                                            weights_only=True))
