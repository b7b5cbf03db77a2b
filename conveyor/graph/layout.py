"""One way to cut a model into a pipeline's stages, shared by every face.

:func:`cut` turns (model, ``balance`` or ``split_at``, ``sample``, the number of stages,
the stages this process runs) into a :class:`Layout`: the local stages, built and on
their devices, with the balance, the cut, the tied weights and the values a traced model
sends past the next stage. ``GPipe`` and ``Pipeline`` (and so ``conveyor.check``) cut
here; re-balancing builds its moved stages with :func:`build_stages`, the same last step::

    nn.Sequential (+ balance)  --resolve balance-->  skips cross a stage? --no--> layers
    any nn.Module (+ split_at) --choose the cut---------------------yes--> traced stages

Every path registers the model's layers under their own names on the pipeline module
(so its ``state_dict()`` has the plain model's keys), converts batch norms for deferred
statistics where asked, and gives each stage its random streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.engine.batchnorm import convert_deferred_batch_norm
from conveyor.engine.layers import Partition
from conveyor.engine.recompute.firstlook import find_shared
from conveyor.engine.recompute.rng import LayerRandomness
from conveyor.engine.stage import Stage
from conveyor.engine.ties import (
    NamedLayers,
    TiedParameter,
    distinct_per_stage,
    find_ties,
    stage_of_layer,
    tie_layers,
)
from conveyor.errors import BalanceError, ModelError, ScheduleError
from conveyor.graph.autosplit import choose_cut
from conveyor.graph.binding import COPY_MARK, keep_out_of_state_dict, restore_ties
from conveyor.graph.balance import balance_by_time, solve_balance, validate_balance
from conveyor.graph.export import split_model
from conveyor.graph.skipcut import split_at_skips
from conveyor.graph.source import LayerBuilder, LayerSource
from conveyor.graph.weights import InitFn, Weights, draw_init_seed
from conveyor.schedules import Edge

__all__: list[str] = []

logger = logging.getLogger("conveyor")


@dataclass
class Layout:
    """A model cut into stages, as one process holds it.

    Attributes:
        stages: the stages this process runs, by stage number.
        balance: layers per stage (one per stage for a traced model).
        split_at: where a traced model was cut (as given or chosen); None for a
            sequence of layers run as they are.
        ties: weights used by several stages (every one, with this process's copies).
        edges: values a traced model sends from a stage past the next one.
        source: the layers as the user gave them (a sequence or a layer function), from
            which moved layers are built again; None for a traced model.
        deferred_batch_norm: whether batch norms keep statistics over the mini-batch
            (a layer built again is converted too).
    """

    stages: dict[int, Stage]
    balance: list[int]
    split_at: list[str] | None
    ties: list[TiedParameter]
    edges: tuple[Edge, ...] = ()
    source: LayerSource | None = None
    deferred_batch_norm: bool = False


def cut(
    owner: nn.Module,
    module: nn.Module | LayerBuilder,
    *,
    stages: int,
    devices: Mapping[int, torch.device],
    local: Collection[int],
    concurrent: Sequence[torch.device],
    balance: Sequence[int] | str | None = None,
    split_at: Sequence[str] | None = None,
    sample: Any = None,
    layers: int | None = None,
    tie_weights: Sequence[Sequence[str]] = (),
    deferred_batch_norm: bool = False,
    init_fn: InitFn | None = None,
    weights: Weights | None = None,
    decide: Callable[[list[int]], Sequence[int]] = list,
) -> Layout:
    """Cuts ``module`` into ``stages`` stages and builds those in ``local``.

    Args:
        owner: the pipeline module the layers are registered on, under their names.
        module: an ``nn.Sequential`` (possibly on the meta device), a function that
            builds layer i (with ``layers``), or any ``nn.Module`` (cut at ``split_at``,
            or where :func:`~conveyor.graph.autosplit.choose_cut` says).
        stages: the number of stages K.
        devices: the device of every stage, by stage number.
        local: the stages this process runs (all of them in one process).
        concurrent: the devices of the workers that run at once in this process.
        balance: layers per stage; None evens out parameters, "time" forward and
            backward time on ``sample``.
        split_at: the submodules where stages 1, 2, ... begin.
        sample: one micro-batch, to trace or profile the model.
        layers: the number of layers, when ``module`` is a function.
        tie_weights: groups of parameter names that are one weight.
        deferred_batch_norm: batch-norm statistics over the whole mini-batch.
        init_fn, weights: how a traced model on the meta device gets its values.
        decide: a balance this process measured ("time") as the job's (under torchrun:
            rank 0's, shared by a bounded collective).

    Raises:
        BalanceError: the balance or the cut does not fit the model or ``stages``.
        ModelError: the model cannot be traced or cut there.
    """
    if isinstance(module, nn.Module) and not isinstance(module, nn.Sequential):
        restore_ties(module)  # cut before: traced tied, as built
    chosen, balance = choose_cut(module, split_at, balance, sample, stages)
    if chosen is not None:
        if not isinstance(module, nn.Module):
            raise ModelError("split_at= cuts a model object; give the nn.Module itself")
        if len(chosen) + 1 != stages:
            raise BalanceError(f"split_at gives {len(chosen) + 1} stages but the schedule "
                               f"has {stages} (ranks x virtual stages)")
        layout = _cut_traced(owner, module, chosen, sample, devices, local, concurrent,
                             balance=balance, deferred_batch_norm=deferred_batch_norm,
                             init_fn=init_fn, weights=weights)
        return _named(owner, layout)
    refuse_initialisation(init_fn, weights)
    source = LayerSource(module, layers)
    resolved = resolve_balance(balance, source, stages, sample, decide)
    crossing = split_at_skips(source.layers_if_known(), resolved, sample=sample,
                              deferred_batch_norm=deferred_batch_norm)
    if crossing is not None:  # a layer pops what an earlier stage stashed: trace
        assert isinstance(module, nn.Module)
        layout = _cut_traced(owner, module, crossing, sample, devices, local, concurrent)
        layout.balance = resolved
        return _named(owner, layout)
    # Found on the model as given: materialising gives layers new Parameter objects.
    tied = [tuple(g) for g in tie_weights] + find_ties(source.layers_if_known())
    starts = [sum(resolved[:s]) for s in range(stages + 1)]
    init_seed = draw_init_seed() if source.builds_layers() else 0
    known = source.layers_if_known()  # as the user holds them: before any copy
    shared = find_shared({s: known[starts[s]:starts[s + 1]] for s in range(stages)}) \
        if known else {}
    stage_layers = distinct_per_stage({
        s: [(source.names[i], source.layer(i, devices[s], init_seed))
            for i in range(starts[s], starts[s + 1])]
        for s in sorted(local)
    })
    ties = tie_layers(tied, stage_layers, stage_of_layer(source.names, starts),
                      {s: devices[s] for s in stage_layers})
    built = build_stages(owner, stage_layers, names=source.names,
                         first_layers={s: starts[s] for s in stage_layers},
                         devices=devices, concurrent=concurrent,
                         deferred_batch_norm=deferred_batch_norm)
    for s, stage in built.items():
        stage.first_look.shared = shared.get(s, [])
    return _named(owner, Layout(built, resolved, None, ties, source=source,
                                deferred_batch_norm=deferred_batch_norm))


def _named(owner: nn.Module, layout: Layout) -> Layout:
    """``layout``, its stages given the model's names of modules and parameters, for
    what their first forwards may refuse (see :mod:`conveyor.engine.recompute.firstlook`)."""
    names = {id(value): name for name, value in [
        *owner.named_modules(remove_duplicate=False),
        *owner.named_parameters(remove_duplicate=False)]}
    for stage in layout.stages.values():
        stage.first_look.names = names
    return layout


def resolve_balance(balance: Sequence[int] | str | None, source: LayerSource,
                    num_stages: int, sample: Any,
                    decide: Callable[[list[int]], Sequence[int]] = list) -> list[int]:
    """Layers per stage of a sequence of layers: as given (checked), by parameters
    (None) or by time on ``sample`` ("time": ``decide`` makes this process's timings
    the job's; under torchrun rank 0's decide).

    Raises:
        BalanceError: the balance does not fit the layers or the number of stages.
    """
    if balance is None:
        return solve_balance(source.parameter_counts(), num_stages)
    if isinstance(balance, str):
        if balance != "time":
            raise BalanceError(f"balance={balance!r}: give a list, None (by parameters) or "
                               "'time'")
        model = source.layers_if_known()
        if sample is None or not model:
            raise BalanceError("balance='time' profiles the model on a batch: pass "
                               "sample=<a micro-batch> with an nn.Sequential built on a device")
        result = balance_by_time(nn.Sequential(*[layer for _, layer in model]), sample,
                                 num_stages)
        return list(decide(result))  # one rank's timings decide for all
    result = validate_balance(balance, len(source.names))
    if len(result) != num_stages:
        raise BalanceError(f"balance {result} has {len(result)} stages but the schedule has "
                           f"{num_stages} (ranks x virtual stages)")
    return result


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
                          randomness=randomness,
                          last=first_layers[s] + len(named) == len(names))
    return stages


def _cut_traced(owner: nn.Module, module: nn.Module, split_at: Sequence[str], sample: Any,
                devices: Mapping[int, torch.device], local: Collection[int],
                concurrent: Sequence[torch.device], *, balance: Any = None,
                deferred_batch_norm: bool = False, init_fn: InitFn | None = None,
                weights: Weights | None = None) -> Layout:
    """Traces ``module`` on ``sample``, cuts it at ``split_at``, builds the ``local``
    stages and registers the model's own modules on ``owner`` (under torchrun each rank
    gives storage only to the tensors of its own stages).

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
    split = split_model(module, sample, split_at, {s: devices[s] for s in sorted(local)},
                        init_fn=init_fn, weights=weights)
    for stage in split.stages.values():  # runs the program of the model's mode
        stage.train(module.training)
    stages = build_stages(
        owner, {k: [(split.names[k], stage)] for k, stage in split.stages.items()},
        names=split.names, first_layers={k: k for k in split.stages},
        devices=devices, concurrent=concurrent, deferred_batch_norm=False)
    adopt(owner, module)
    return Layout(stages, [1] * split.count, list(split_at), split.ties, split.edges)


def refuse_edges(edges: Sequence[Edge], module: Any, split_at: Sequence[str] | None) -> None:
    """Refuses a schedule table with edges for a sequence of layers (no ``split_at``).

    Raises:
        ScheduleError: the table has edges, and the model is a sequence of layers.
    """
    if split_at is None and edges and (
            isinstance(module, nn.Sequential) or not isinstance(module, nn.Module)):
        raise ScheduleError(
            f"the schedule table has edges ({' '.join(map(str, edges))}), but a sequence of "
            "layers sends each stage's output to the next stage alone; drop the edges, or "
            "give a model to trace with split_at=")


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
    held = {**owner._modules, **owner._parameters, **owner._buffers}
    _check_layer_names(owner, [name for name, value in [*children.items(), *params.items(),
                                                        *buffers.items()]
                               if held.get(name, None) is not value])  # adopted before
    for name, child in children.items():
        owner.add_module(name, child)
    for name, param in params.items():
        owner.register_parameter(name, param)
        if COPY_MARK in name:  # a tie's copy at the model's top
            keep_out_of_state_dict(owner, name)
    for name, buffer in buffers.items():
        owner.register_buffer(name, buffer,
                              persistent=name not in model._non_persistent_buffers_set)
    for what in ("config", "generation_config"):  # a Hugging Face model's: save_pretrained
        if callable(getattr(getattr(model, what, None), "save_pretrained", None)):
            owner.__dict__[f"_model_{what}" if what == "config" else f"_{what}"] = \
                getattr(model, what)


def _check_layer_names(owner: nn.Module, names: Sequence[str]) -> None:
    for name in names:
        if hasattr(type(owner), name) or hasattr(owner, name):
            kind = type(owner).__name__
            raise ModelError(
                f"layer name {name!r} clashes with an attribute of {kind}; rename the "
                f"layer in the nn.Sequential (e.g. nn.Sequential(OrderedDict(...)) with "
                f"another name for it)"
            )
