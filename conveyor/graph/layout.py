"""One way to build a pipeline's stages, shared by ``GPipe`` and ``Pipeline``.

Both faces check their options the same way, resolve devices the same way, register the
model's layers under their own names on the pipeline module (refusing a name that would
shadow an attribute), convert batch norms for deferred statistics, give each stage its
random streams, and start every call with the same kind of :class:`StepState`. What
differs stays with them: ``GPipe`` cuts an ``nn.Sequential`` by a balance and runs the
GPipe table in this process; ``Pipeline`` takes any schedule and may hold only one
rank's stages of a model built elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.engine.batchnorm import convert_deferred_batch_norm
from conveyor.engine.executor import StepState
from conveyor.graph.export import split_model
from conveyor.engine.microbatch import microbatch_sizes
from conveyor.engine.recompute import recomputes, validate_mode
from conveyor.engine.rng import LayerRandomness, draw_step_seed
from conveyor.engine.stage import Partition, Stage
from conveyor.engine.ties import TiedParameter
from conveyor.graph.weights import InitFn, Weights
from conveyor.errors import BalanceError, ModelError
from conveyor.schedules import Edge

__all__: list[str] = []

NamedLayers = list[tuple[str, nn.Module]]


def check_options(*, chunks: int, checkpoint: str) -> None:
    """Checks the options every pipeline takes.

    Raises:
        MicroBatchError: ``chunks`` is not a positive integer.
        ValueError: ``checkpoint`` is not a checkpoint mode.
    """
    microbatch_sizes(chunks, chunks)
    validate_mode(checkpoint)


def build_stages(
    owner: nn.Module,
    stage_layers: Mapping[int, NamedLayers],
    *,
    names: Sequence[str],
    first_layers: Mapping[int, int],
    devices: Mapping[int, torch.device],
    concurrent: Sequence[torch.device],
    deferred_batch_norm: bool,
) -> dict[int, Stage]:
    """Builds the stages this process runs and registers their layers on ``owner``.

    Args:
        owner: the pipeline module; layers become its children under their names, so
            its ``state_dict()`` has the plain model's keys.
        stage_layers: per local stage, its (name, layer) pairs in order.
        names: the names of every layer of the model, local or not: a clash is found on
            every rank alike, whichever stage holds the layer.
        first_layers: per local stage, the global index of its first layer.
        devices: per local stage, its device.
        concurrent: the devices of the workers that run at once in this process; a
            device listed twice shares its random generator between workers.
        deferred_batch_norm: convert batch norms to :class:`DeferredBatchNorm`.

    Raises:
        ModelError: a layer name would shadow an attribute or method of ``owner``.
    """
    _check_layer_names(owner, names)
    stages = {}
    for s, named in stage_layers.items():
        if deferred_batch_norm:
            named = [(name, convert_deferred_batch_norm(layer)) for name, layer in named]
        for name, layer in named:
            owner.add_module(name, layer)
        device = devices[s]
        layers = Partition(*[layer for _, layer in named]).to(device)
        randomness = LayerRandomness(device, shared=list(concurrent).count(device) > 1)
        stages[s] = Stage(s, layers, first_layer=first_layers[s], device=device,
                          randomness=randomness)
    return stages


def build_traced_stages(
    owner: nn.Module,
    module: nn.Module,
    *,
    split_at: Sequence[str],
    sample: Any,
    balance: Any,
    deferred_batch_norm: bool,
    devices: Mapping[int, torch.device],
    concurrent: Sequence[torch.device],
    init_fn: InitFn | None = None,
    weights: Weights | None = None,
) -> tuple[dict[int, Stage], list[TiedParameter], tuple[Edge, ...]]:
    """Traces ``module`` on ``sample``, cuts it at ``split_at``, builds the stages listed
    in ``devices`` (stage k on ``devices[k]``; under torchrun, this rank's) and registers
    the model's own modules on ``owner``; returns the stages, the ties found in the graph
    (every tie, with this process's copies), and the edges (values sent past the next
    stage) that the schedule must carry.

    Raises:
        BalanceError: ``balance`` given too, no ``sample``, or deferred batch norm.
        ModelError: the model cannot be traced or cut there (see ``split_model``).
    """
    if balance is not None:
        raise BalanceError("give balance= or split_at=, not both")
    if sample is None:
        raise BalanceError("split_at= traces the model to cut it: pass sample=<a "
                           "micro-batch as the model takes it> (every rank, under torchrun)")
    if deferred_batch_norm:
        raise BalanceError("deferred_batch_norm=True needs an nn.Sequential with "
                           "balance=; a traced model's batch norms update per micro-batch")
    split = split_model(module, sample, split_at, devices, init_fn=init_fn, weights=weights)
    for stage in split.stages.values():  # runs the program of the model's mode
        stage.train(module.training)
    stages = build_stages(
        owner, {k: [(split.names[k], stage)] for k, stage in split.stages.items()},
        names=split.names, first_layers={k: k for k in split.stages},
        devices=devices, concurrent=concurrent, deferred_batch_norm=False)
    adopt(owner, module)
    return stages, split.ties, split.edges


def refuse_initialisation(init_fn: Any, weights: Any) -> None:
    """Refuses ``init_fn=``/``weights=`` where they have no effect (no ``split_at=``).

    Raises:
        BalanceError: either is given.
    """
    if init_fn is not None or weights is not None:
        raise BalanceError("init_fn= and weights= initialise a model split with split_at=; "
                           "an nn.Sequential on the meta device initialises each layer by "
                           "its reset_parameters()")


def adopt(owner: nn.Module, model: nn.Module) -> None:
    """Registers ``model``'s children, parameters and buffers on ``owner`` under their
    own names, so that ``owner.state_dict()`` has the model's keys.

    Raises:
        ModelError: a name would shadow an attribute or method of ``owner``.
    """
    children = dict(model.named_children())
    params = dict(model.named_parameters(recurse=False))
    buffers = dict(model.named_buffers(recurse=False))
    _check_layer_names(owner, [*children, *params, *buffers])
    for name, child in children.items():
        owner.add_module(name, child)
    for name, param in params.items():
        owner.register_parameter(name, param)
    for name, buffer in buffers.items():
        owner.register_buffer(name, buffer,
                              persistent=name not in model._non_persistent_buffers_set)


def _check_layer_names(owner: nn.Module, names: Sequence[str]) -> None:
    for name in names:
        if hasattr(owner, name):
            kind = type(owner).__name__
            raise ModelError(
                f"layer name {name!r} clashes with an attribute of {kind}; rename the "
                f"layer in the nn.Sequential (e.g. nn.Sequential(OrderedDict(...)) with "
                f"another name for it)"
            )


def new_step(microbatches: Sequence[Any], *, chunks: int, checkpoint: str,
             grad_enabled: bool, training: bool, **options: Any) -> StepState:
    """The state of one pipelined call.

    Args:
        microbatches: stage 0's micro-batches (empty where stage 0 does not run).
        chunks: the number of micro-batches M.
        checkpoint: the recomputation mode, deciding which micro-batches recompute.
        grad_enabled: whether forward records graphs for a backward.
        training: whether the model is in training mode.
        options: the other fields of :class:`StepState` (loss, targets ...).
    """
    return StepState(
        inputs=microbatches,
        recompute=lambda m: recomputes(checkpoint, m, chunks),
        grad_enabled=grad_enabled,
        # Seeded whenever a backward may recompute, in eval mode too (a layer random
        # in eval mode, MC dropout, must draw the same numbers again); inference in
        # eval mode draws from torch's generators as the plain model does.
        step_seed=draw_step_seed() if training or grad_enabled else None,
        **options,
    )
