"""One stage: consecutive layers on one device, run on one micro-batch at a time.

The layers are held by a :class:`Partition`, an ``nn.Sequential`` that the stage calls
as one module, so that hooks a user puts on ``pipe.partitions[k]`` fire for every
micro-batch (and again when it is recomputed eagerly; ``conveyor.is_recomputing()``
tells). Inside that call the stage runs the layers one by one: each layer call gets its
own random stream, and each output is checked (tensors only, dim 0 kept) so that an
error can name the layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.engine.backward.accumulation import FusedAccumulation
from conveyor.engine.backward.weightpath import WeightPath, fixed_path
from conveyor.engine.actions import StageActions
from conveyor.engine.batchnorm import DeferredBatchNorm
from conveyor.engine.compiled.stages import (CompiledCall, CompiledStage, before_compiled_call,
                                             compile_stage, is_compiled, run_aside)
from conveyor.engine.compiled.cudagraphs import GraphedStage
from conveyor.engine.offload import Offloader
from conveyor.engine.layers import (Partition, WholeStage, batch_rows, check_output,
                                    copied_leaves, failure, keeps_rows, shares_a_leaf,
                                    shares_a_tensor, writes_into_leaf)
from conveyor.engine.recompute.firstlook import FirstLook
from conveyor.engine.recompute.replay import Recomputation, checkpointed, is_recomputing
from conveyor.engine.recompute.sideeffects import ModuleState, SideEffects, refuse_on_replicas
from conveyor.engine.recompute.rng import LayerRandomness
from conveyor.errors import ModelError
from conveyor.torchprivate import STOP_RECOMPUTATION, pytree

__all__: list[str] = []

_log = logging.getLogger(__name__)

class Stage(StageActions):
    """Layers ``first_layer .. first_layer + len(layers) - 1`` of the model on ``device``.

    Args:
        index: the stage number k.
        layers: this stage's layers, already on ``device``.
        first_layer: the global index of the first layer (seeds and messages use it).
        device: where the layers live and run.
        randomness: how this stage's layer calls get their random streams.
        last: whether it is the model's last stage (its output is the model's, its
            forward computes the loss).

    Besides running its layers on a micro-batch, a stage owns what each action of the
    table means for it (:class:`~conveyor.engine.actions.StageActions`): the executor
    only walks the table, receiving what an action needs and sending what it made.
    """

    def __init__(
        self,
        index: int,
        layers: Partition,
        *,
        first_layer: int,
        device: torch.device,
        randomness: LayerRandomness,
        last: bool = False,
    ) -> None:
        self.index = index
        self.last = last
        self.layers = layers
        self.first_layer = first_layer
        self.device = device
        self.randomness = randomness
        #: what a forward changes in the stage's modules, for its recomputation
        self.module_state = ModuleState(self._modules)
        #: what its first forward in each mode changed that a pipeline cannot replay
        self.first_look = FirstLook(index, self._modules)
        self._deferred = [m for m in layers.modules() if isinstance(m, DeferredBatchNorm)]
        # A traced stage: its values go to the stages that use them, not all to the next.
        self._graph = layers[0] if len(layers) == 1 and isinstance(layers[0], WholeStage) \
            else None
        #: whether the stage works on a copy of its input: a layer writes into it in
        #: place (found on the first micro-batch that does).
        self.copies_input = False
        #: fused weight gradients in ``B`` (:meth:`fuse_accumulation`), or None.
        self.accumulator: FusedAccumulation | None = None
        #: the stage's layers compiled as one graph (:meth:`compile`), or None.
        self.compiled: CompiledStage | None = None
        #: whether the stage runs compiled graphs (``compile=True``)
        self.compiles = False
        #: the CUDA graphs its compiled graph replays from (``cuda_graphs=True``), or None
        self.graphed: GraphedStage | None = None
        #: where the stage's saved activations wait for their backward
        #: (``offload="activations"``), or None: on the device.
        self.offloader: Offloader | None = None
        #: whether other processes hold replicas of the stage (its forwards must not
        #: change its modules' state, but for deferred batch norm's)
        self.replicated = False
        #: where a split backward's ``W`` starts (measured on its first micro-batches)
        self.weight_path = WeightPath(index, device, fixed_path())
        self._traced = any(isinstance(layer, WholeStage) for layer in layers)

    def __repr__(self) -> str:
        last = self.first_layer + len(self.layers) - 1
        return f"Stage({self.index}, layers {self.first_layer}-{last}, {self.device})"

    def _modules(self) -> list[nn.Module]:
        """Every module the stage's forward may run."""
        return [module for layer in self.layers for module in (
            layer.bound_modules() if isinstance(layer, WholeStage) else layer.modules())]

    def fuse_accumulation(self) -> None:
        """Lets the linear layers' weight gradients add themselves into ``.grad`` in
        ``B`` (see :mod:`conveyor.engine.backward.accumulation`); for a stage whose backward the
        schedule never splits into ``I`` and ``W``."""
        accumulator = FusedAccumulation(
            (module for layer in self.layers if not isinstance(layer, WholeStage)
             for module in layer.modules()),
            (graph for layer in self.layers if isinstance(layer, WholeStage)
             for graph in layer.graphs()))
        self.accumulator = accumulator if accumulator.fuses else None  # (none large enough)

    def compile(self, *, cuda_graphs: bool = False) -> None:
        """Compiles the stage (``compile=True``, see :mod:`conveyor.engine.compiled.stages`):
        its layers run as one graph in each mode in which none draws random numbers or
        updates a buffer; with ``cuda_graphs``, replayed from CUDA graphs (see
        :mod:`conveyor.engine.compiled.cudagraphs`; a traced stage runs its compiled graphs
        without)."""
        self.compiled = compile_stage(self.layers, index=self.index, first_layer=self.first_layer)
        self.compiles = True
        if cuda_graphs and self.compiled is not None:
            self.graphed = GraphedStage(self.compiled.graph, self.layers, self.index)

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
                recompute: bool, loss_of: Callable[[Any], torch.Tensor] | None = None
                ) -> tuple[Any, SideEffects | None]:
        """Runs the stage's layers on one micro-batch.

        Args:
            inputs: the micro-batch, on this stage's device.
            microbatch: its index m (seeds and messages use it).
            step_seed: the seed of this pipelined call, or None for no seeding (eval).
            recompute: keep only ``inputs`` and recompute the layers in backward.
            loss_of: with ``recompute``, the loss of the outputs, recomputed with the
                layers (a stage run as one graph that recomputes inside its backward
                keeps its outputs for it).

        Returns:
            The outputs (with ``loss_of``: the outputs and their loss), and (recomputed
            only) what the forward changed in the stage's modules, which its
            recomputation puts back as the forward saw it; None where the stage's
            compiled graph recomputes inside its own backward (a stage run as one graph).
        """
        in_graph = (recompute and torch.is_grad_enabled() and self.compiled is not None
                    and not self.replicated and self._stage_graph(
                        inputs, batch_rows(inputs), self.compiled.modes()) is not None
                    and not self.copies_input)  # (a copy written into, kept for backward)

        def loop(x: Any) -> Any:
            return self._run_layers(x, microbatch, step_seed, in_graph)

        def run(x: Any) -> Any:
            outputs = self.layers(x, loop)  # through the module, so that its hooks run
            return outputs if loss_of is None or in_graph else (outputs, loss_of(outputs))

        recomputed = recompute and torch.is_grad_enabled()
        call: Callable[[Any], Any] = run
        if self.first_look.due(self.layers.training, recomputed):  # once per mode
            call = self.first_look.watching(run, self.layers.training, recomputed, microbatch)
        if recompute and torch.is_grad_enabled() and not in_graph:
            outputs, effects = checkpointed(call, inputs, self.module_state)
            watched = effects
        elif self.replicated:
            watched, effects = SideEffects(), None
            outputs = self.module_state.run(call, inputs, watched)
        elif in_graph and loss_of is not None:
            outputs = call(inputs)
            return (outputs, checkpointed(loss_of, outputs, self.module_state)[0]), None
        else:
            return call(inputs), None
        if self.replicated:  # what its forward changes would differ between replicas
            refuse_on_replicas(watched, self.layers.named_modules(), self.index, microbatch,
                               pooled=(DeferredBatchNorm,))
        return outputs, effects

    def recompute(self, inputs: Any, microbatch: int, effects: SideEffects, *,
                  step_seed: int | None,
                  loss_of: Callable[[Any], torch.Tensor] | None = None) -> Any:
        """The forward of :meth:`forward` again, recording the whole graph: the same
        random numbers, and the modules' state as the forward saw it (``effects``).
        Returns the outputs, or with ``loss_of`` their loss."""
        with Recomputation(effects), torch.enable_grad():
            outputs = self.layers(inputs, lambda x: self._run_layers(x, microbatch, step_seed))
            return outputs if loss_of is None else loss_of(outputs)

    def _run_layers(self, x: Any, microbatch: int, step_seed: int | None,
                    in_graph: bool = False) -> Any:
        if self.accumulator is None:
            return self._run_layers_checked(x, microbatch, step_seed, in_graph)
        with self.accumulator.layers():  # (fused weight gradients)
            return self._run_layers_checked(x, microbatch, step_seed, in_graph)

    def _run_layers_checked(self, x: Any, microbatch: int, step_seed: int | None,
                            in_graph: bool) -> Any:
        rows = batch_rows(x)
        modes = self.compiled.modes() if self.compiled is not None else ()
        graph = self._stage_graph(x, rows, modes) if self.compiled is not None else None
        if graph is not None and in_graph:
            assert self.compiled is not None
            graph = self.compiled.recomputing
        if self.copies_input:  # (the compiled stage's probe may have found it just now)
            x = copied_leaves(x)
        if graph is not None:
            return self._run_graph(graph, x, rows, microbatch)
        received = x  # as it arrived: its leaves that require grad
        # (_call_layer's looks cost a host-bound stage of small layers a tenth of its time)
        plainly = self.compiled is None and not self._traced and (
            step_seed is None or self.randomness.all_silent(self.first_layer, self.layers))
        batch = rows[0] if rows is not None else -1
        for offset, layer in enumerate(self.layers):
            try:
                x = layer(x) if plainly else self._call_layer(layer, offset, x, microbatch,
                                                              step_seed, modes)
            except STOP_RECOMPUTATION:
                raise
            except Exception as exc:
                if not (self.index > 0 and writes_into_leaf(exc)
                        and shares_a_leaf(x, received)):
                    error = self._layer_error(exc, offset, microbatch)
                    if error is exc:
                        raise
                    raise error from exc
                # A layer writes into the stage's input (handed on unchanged by the layers
                # before it), which arrives as a leaf that requires grad: from now on the
                # stage works on a copy of it, as the plain model's layer writes into the
                # one before's output. The layer runs again on the copy.
                self.copies_input = True
                _log.debug("stage %d, layer %d writes into the stage's input in place; the "
                           "stage copies its input from now on", self.index,
                           self.first_layer + offset)
                x = self._call_layer(layer, offset, copied_leaves(x), microbatch, step_seed,
                                     modes)
            # (a whole stage's outputs may broadcast; the common output told inline)
            if not (type(x) is torch.Tensor and x.dim() and x.shape[0] == batch
                    or isinstance(layer, WholeStage) or keeps_rows(x, rows)):
                self._check_output(x, rows, offset, microbatch)
        return x

    def _stage_graph(self, x: Any, rows: tuple[int, torch.Size] | None,
                     modes: tuple[bool, ...]) -> CompiledCall | None:
        """The stage's compiled graph if its layers run as one in ``modes`` (their
        training flags), decided at the first call in them (:meth:`_eager_aside`)."""
        assert self.compiled is not None
        if modes not in self.compiled.eager:
            self.compiled.eager[modes] = self._eager_aside(x, rows)
        return self.compiled.graph if not self.compiled.eager[modes] else None

    def _eager_aside(self, x: Any, rows: tuple[int, torch.Size] | None) -> frozenset[int]:
        """The offsets of the layers that must run eagerly in the current mode: those
        that draw random numbers or update a buffer (see
        :mod:`conveyor.engine.compiled.stages`), found by running the layers eagerly aside on
        a copy of ``x`` (each under the probe that routes its draws where workers share
        the device; random numbers and buffers put back). A first layer that writes into
        the stage's input makes the stage copy its input from now on, as the eager
        stage does. A layer that fails here, or changes the batch dimension, makes them
        all eager: their own calls raise the error, naming the layer."""
        eager = set()
        received = x = pytree.tree_map_only(  # what a layer writes into, put back
            torch.Tensor, lambda t: t.detach().clone() if t.requires_grad else t, x)
        try:
            for offset, layer in enumerate(self.layers):
                index = self.first_layer + offset
                updated: list[torch.Tensor] = []
                with self.randomness.probing(index, layer):
                    x = run_aside(layer, (x,), updated)
                self._check_output(x, rows, offset, 0)
                if offset == 0 and self.index > 0 and shares_a_tensor(updated, received):
                    self.copies_input = True
                buffers = {id(b) for b in layer.buffers()}
                if any(id(t) in buffers for t in updated) or self.randomness.draws(index, layer):
                    eager.add(offset)
        except Exception as exc:  # noqa: BLE001 - the layer's own call raises it, named
            _log.debug("stage %d: a layer failed aside (%s); its layers run eagerly",
                       self.index, exc)
            return frozenset(range(len(self.layers)))
        return frozenset(eager)

    def _run_graph(self, graph: CompiledCall, x: Any, rows: tuple[int, torch.Size] | None,
                   microbatch: int) -> Any:
        try:
            output = self.graphed(x, microbatch) if self.graphed is not None else graph(x)
        except STOP_RECOMPUTATION:
            raise
        except Exception as exc:
            error = self._layer_error(exc, None, microbatch)
            if error is exc:
                raise
            raise error from exc
        self._check_output(output, rows, None, microbatch)
        return output

    def _call_layer(self, layer: nn.Module, offset: int, x: Any, microbatch: int,
                    step_seed: int | None, modes: tuple[bool, ...]) -> Any:
        call: Callable[[Any], Any] = \
            self.compiled.call_of(offset, modes) if self.compiled else layer
        index = self.first_layer + offset
        if isinstance(layer, WholeStage) and is_compiled(layer):  # its graph may be compiled
            before_compiled_call(x)
            graph = layer.graph()
            if graph is not None and is_compiled(graph) and step_seed is not None \
                    and not self.randomness.knows(index, layer):
                # A compiled graph draws nothing (one that draws stays eager); its
                # first call must not run under the probe's dispatch mode, which
                # torch.compile leaves eager (and its recomputation would not: the two
                # would save different tensors for backward).
                self.randomness.draws_nothing(index, layer)
        if step_seed is None or self.randomness.silent(index, layer):  # (most layers)
            return call(x)
        with self.randomness.layer_call(step_seed, index, microbatch, layer):
            return call(x)

    def _describe_layer(self, offset: int | None) -> str:
        """Layer ``offset`` of the stage; None: its layers, compiled as one graph."""
        if offset is None:
            last = self.first_layer + len(self.layers) - 1
            return f"layers {self.first_layer}-{last} (compiled as one graph)"
        layer = self.layers[offset]
        return f"layer {self.first_layer + offset} ({type(layer).__name__})"

    def _layer_error(self, exc: Exception, offset: int | None, microbatch: int) -> Exception:
        recomputing = is_recomputing()
        # Recomputation runs inside B or I: the executor names which
        during = (" while recomputing for backward" if recomputing
                  else f" ({self.index}F{microbatch})")
        hint = ""
        if offset is None:
            hint = "\nhint: compile=False runs the layers one by one and names the one that fails"
        elif writes_into_leaf(exc):
            hint = (
                f"\nhint: the stage receives its input as a leaf tensor that requires grad; "
                f"a layer may write into that input (the stage then works on a copy), but "
                f"layer {self.first_layer + offset} writes into a view of it; use "
                "inplace=False for it or move the stage boundary to it"
            )
        return failure(exc, f"stage {self.index}, {self._describe_layer(offset)} failed on "
                       f"micro-batch {microbatch}{during}", hint=hint, stage=self.index,
                       microbatch=microbatch,
                       action=f"{self.index}{'B' if recomputing else 'F'}{microbatch}",
                       layer=None if offset is None else self.first_layer + offset)

    def _check_output(self, output: Any, rows: tuple[int, torch.Size] | None,
                      offset: int | None, microbatch: int) -> None:
        check_output(output, rows, lambda: f"stage {self.index}, "
                     f"{self._describe_layer(offset)}", microbatch)

    @property
    def deferred_batch_norms(self) -> list[DeferredBatchNorm]:
        """The stage's batch norms whose statistics are pooled until the step ends."""
        return self._deferred

    def end_step(self, *, commit: bool) -> None:
        """Commits (or, after a failure, discards) deferred batch-norm statistics."""
        for module in self._deferred:
            if commit:
                module.commit()
            else:
                module.discard()

