"""One stage: consecutive layers on one device, run on one micro-batch at a time.

The layers are held by a :class:`Partition`, an ``nn.Sequential`` that the stage calls
as one module, so that hooks a user puts on ``pipe.partitions[k]`` fire for every
micro-batch (and again when it is recomputed; ``conveyor.is_recomputing()`` tells).
Inside that call the stage runs the layers one by one: each layer call gets its own
random stream, and each output is checked (tensors only, dim 0 kept) so that an error
can name the layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn

from conveyor.engine.batchnorm import DeferredBatchNorm
from conveyor.engine.recompute import (
    Recomputation,
    checkpointed,
    is_recomputing,
    running_stat_layers,
)
from conveyor.engine.rng import LayerRandomness
from conveyor.errors import (
    ConveyorError,
    LayerOutputError,
    ModelError,
    StageError,
    add_note,
)

__all__: list[str] = []

LayerLoop = Callable[[Any], Any]

# torch.utils.checkpoint stops a recomputation early by raising this through the layers.
_STOP_RECOMPUTATION: type[BaseException] = getattr(
    torch.utils.checkpoint, "_StopRecomputationError", ConveyorError
)


class WholeStage(nn.Module):
    """A layer that is a whole stage of a traced model (``conveyor.graph`` makes them).

    It reads parameters and buffers that live elsewhere (the model's, under the model's
    names), takes the values that cross into it and hands on a dict of the values it
    makes, which :meth:`route` splits by the stage that uses each.
    """

    def bound_parameters(self) -> list[nn.Parameter]:
        """The parameters this stage reads."""
        raise NotImplementedError

    def bound_modules(self) -> list[nn.Module]:
        """The modules whose parameters or buffers this stage reads."""
        raise NotImplementedError

    def route(self, made: dict[str, Any], destinations: Sequence[int]) -> dict[int, Any]:
        """What this stage made, split by the stage each value goes to."""
        raise NotImplementedError


class Partition(nn.Sequential):
    """A stage's layers as one module.

    Called by its stage, it runs the stage's loop over its layers (seeded, checked);
    called directly, it is the plain ``nn.Sequential``.
    """

    def forward(self, input: Any, loop: LayerLoop | None = None) -> Any:
        return super().forward(input) if loop is None else loop(input)


class Stage:
    """Layers ``first_layer .. first_layer + len(layers) - 1`` of the model on ``device``.

    Args:
        index: the stage number k.
        layers: this stage's layers, already on ``device``.
        first_layer: the global index of the first layer (seeds and messages use it).
        device: where the layers live and run.
        randomness: how this stage's layer calls get their random streams.
    """

    def __init__(
        self,
        index: int,
        layers: Partition,
        *,
        first_layer: int,
        device: torch.device,
        randomness: LayerRandomness,
    ) -> None:
        self.index = index
        self.layers = layers
        self.first_layer = first_layer
        self.device = device
        self.randomness = randomness
        self._norms = running_stat_layers(layers) + [
            norm for layer in layers if isinstance(layer, WholeStage)
            for module in layer.bound_modules() for norm in running_stat_layers(module)]
        self._deferred = [m for m in layers.modules() if isinstance(m, DeferredBatchNorm)]
        # A traced stage: its values go to the stages that use them, not all to the next.
        self._graph = layers[0] if len(layers) == 1 and isinstance(layers[0], WholeStage) \
            else None

    def __repr__(self) -> str:
        last = self.first_layer + len(self.layers) - 1
        return f"Stage({self.index}, layers {self.first_layer}-{last}, {self.device})"

    def trainable_parameters(self) -> list[nn.Parameter]:
        params = [p for layer in self.layers for p in (
            layer.bound_parameters() if isinstance(layer, WholeStage) else layer.parameters())]
        return [p for p in params if p.requires_grad]

    def route(self, outputs: Any, destinations: Sequence[int]) -> dict[int, Any]:
        """What the stage sends to each of ``destinations`` (the schedule's
        ``forward_to``): a sequence of layers its whole output to the next stage, a
        traced stage each value it made to the stages that use it.

        Raises:
            ModelError: a sequence of layers asked to send past the next stage.
        """
        if self._graph is not None:
            return self._graph.route(outputs, destinations)
        if tuple(destinations) != (self.index + 1,):
            raise ModelError(
                f"stage {self.index} is a sequence of layers, whose output goes to stage "
                f"{self.index + 1} alone, but the schedule sends it to stages "
                f"{list(destinations)}; edges need a traced model (split_at=)")
        return {self.index + 1: outputs}

    def join(self, received: Mapping[int, Any]) -> Any:
        """The stage's input from what each earlier stage sent it (by sending stage)."""
        if self._graph is None:
            return received[self.index - 1]
        values: dict[str, Any] = {}
        for part in received.values():
            values.update(part)
        return values

    def forward(self, inputs: Any, microbatch: int, *, step_seed: int | None,
                recompute: bool) -> Any:
        """Runs the stage's layers on one micro-batch.

        Args:
            inputs: the micro-batch, on this stage's device.
            microbatch: its index m (seeds and messages use it).
            step_seed: the seed of this pipelined call, or None for no seeding (eval).
            recompute: keep only ``inputs`` and recompute the layers in backward.
        """
        def loop(x: Any) -> Any:
            return self._run_layers(x, microbatch, step_seed)

        def run(x: Any) -> Any:
            return self.layers(x, loop)  # through the module, so that its hooks run

        if recompute and torch.is_grad_enabled():
            return checkpointed(run, inputs, self._norms)
        return run(inputs)

    def recompute(self, inputs: Any, microbatch: int, *, step_seed: int | None) -> Any:
        """The forward of :meth:`forward` again, recording the whole graph: the same
        random numbers, and batch norm's running statistics left as they are."""
        with Recomputation(self._norms), torch.enable_grad():
            return self.layers(inputs, lambda x: self._run_layers(x, microbatch, step_seed))

    def _run_layers(self, x: Any, microbatch: int, step_seed: int | None) -> Any:
        rows = _batch_rows(x)
        for offset, layer in enumerate(self.layers):
            index = self.first_layer + offset
            seeded = (
                self.randomness.layer_call(step_seed, index, microbatch, layer)
                if step_seed is not None
                else contextlib.nullcontext()
            )
            try:
                with seeded:
                    x = layer(x)
            except _STOP_RECOMPUTATION:
                raise
            except Exception as exc:
                error = self._layer_error(exc, offset, microbatch)
                if error is exc:
                    raise
                raise error from exc
            if not isinstance(layer, WholeStage):  # values crossing stages may broadcast
                self._check_output(x, rows, offset, microbatch)
        return x

    def _describe_layer(self, offset: int) -> str:
        layer = self.layers[offset]
        return f"layer {self.first_layer + offset} ({type(layer).__name__})"

    def _layer_error(self, exc: Exception, offset: int, microbatch: int) -> Exception:
        recomputing = is_recomputing()
        during = " while recomputing for backward" if recomputing else ""
        hint = ""
        if "in-place" in str(exc) and "leaf" in str(exc):
            hint = (
                "\nhint: the first layer of a stage receives its input as a leaf tensor "
                "that requires grad, so it cannot modify it in place; use inplace=False "
                "for that layer or move the stage boundary"
            )
        return failure(
            exc,
            f"stage {self.index}, {self._describe_layer(offset)} failed on micro-batch "
            f"{microbatch}{during}",
            hint=hint,
            stage=self.index,
            microbatch=microbatch,
            action=f"{self.index}{'B' if recomputing else 'F'}{microbatch}",
            layer=self.first_layer + offset,
        )

    def _check_output(self, output: Any, rows: tuple[int, torch.Size] | None, offset: int,
                      microbatch: int) -> None:
        """Refuses an output that is not tensors, or whose batch dimension differs from
        the stage input's (``rows``; None: the input has none): micro-batches are
        concatenated along dim 0, so the pipeline's result would be wrong."""
        if isinstance(output, torch.Tensor):  # the common case, without flattening
            got = (output.shape[0], output.shape) if output.dim() else None
        else:
            got = None
            for path, leaf in pytree.tree_flatten_with_path(output)[0]:
                if isinstance(leaf, torch.Tensor):
                    if got is None and leaf.dim():
                        got = leaf.shape[0], leaf.shape
                elif leaf is not None:
                    where = "" if not path else f" (at output{pytree.keystr(path)})"
                    raise LayerOutputError(
                        f"stage {self.index}, {self._describe_layer(offset)} returned "
                        f"{type(leaf).__name__}{where} on micro-batch {microbatch}; a layer "
                        "must return a tensor or a tuple/list/dict of tensors"
                    )
        if rows is None or (got is not None and got[0] == rows[0]):
            return
        found = f"{got[0]} rows (shape {list(got[1])})" if got is not None else "no batched tensor"
        raise LayerOutputError(
            f"stage {self.index}, {self._describe_layer(offset)} returned {found} on "
            f"micro-batch {microbatch}, which has {rows[0]} rows; a layer must keep dim 0, "
            "the batch, along which the pipeline splits and concatenates micro-batches"
        )

    def end_step(self, *, commit: bool) -> None:
        """Commits (or, after a failure, discards) deferred batch-norm statistics."""
        for module in self._deferred:
            if commit:
                module.commit()
            else:
                module.discard()


def _batch_rows(value: Any) -> tuple[int, torch.Size] | None:
    """Dim 0 of the first tensor in ``value`` that has one, with its shape."""
    if isinstance(value, torch.Tensor):  # the common case, without flattening
        return (value.shape[0], value.shape) if value.dim() else None
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return leaf.shape[0], leaf.shape
    return None


def failure(
    exc: Exception,
    context: str,
    *,
    hint: str = "",
    stage: int,
    microbatch: int,
    action: str,
    layer: int | None = None,
) -> Exception:
    """The exception to raise for ``exc``, which happened in ``context``.

    conveyor's own typed errors already say where they happened and pass as they are.
    Out-of-memory errors keep their type too (``except torch.cuda.OutOfMemoryError``
    must keep working) and get ``context`` as a note. Anything else is wrapped in a
    StageError whose message starts with ``context``.
    """
    if isinstance(exc, ConveyorError):
        return exc
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        add_note(exc, context)
        return exc
    return StageError(f"{context}: {type(exc).__name__}: {exc}{hint}", stage=stage,
                      microbatch=microbatch, action=action, layer=layer)
