"""The pipeline's side of :func:`conveyor.check`: the pipeline, watched (the plain model's
side is :mod:`conveyor.checking.plain`).

The pipeline runs as a K-rank torchrun job would, emulated on CPU threads: each rank
builds its layers from a copy of the model of its own, so a weight that two ranks share
by a path the pipeline cannot see (a layer holding another layer in a list, not as a
parameter) is two weights, as it would be in two processes; weights the layers share
as one ``nn.Parameter`` stay tied, as the pipeline ties them. Forward hooks on each
layer (each traced stage) note its output per micro-batch, the first time and when a
recomputation runs it again; a recorder on the executor tells them which action, and
so which micro-batch, each thread is running.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from conveyor.engine.recompute.firstlook import Shared, find_shared
from conveyor.engine.recorder import Recorder
from conveyor.engine.ties import find_ties
from conveyor.errors import ConveyorError
from conveyor.graph.layout import resolve_balance
from conveyor.graph.source import sequential_layers
from conveyor.graph.source import LayerSource
from conveyor.checking.causes import Program, programs_of
from conveyor.checking.probe import digest
from conveyor.distributed.topology import Topology
from conveyor.pipeline import Pipeline
from conveyor.runtime.planning import local_ranks
from conveyor.schedules import Action, Kind, Schedule
from conveyor.schedules import build as build_schedule
from conveyor.tensor.apply import kind_of

from conveyor.checking.plain import Leaves, leaves
from conveyor.torchprivate import pytree

__all__: list[str] = []

@dataclass
class Layer:
    """A unit the check compares: a layer of an ``nn.Sequential``, or a traced stage.

    Attributes:
        index: the layer's index (a traced stage's: the stage's).
        name: its name in the model (a traced stage: ``stage{k}``).
        module: the pipeline's module for it.
        stage: the stage that runs it.
        first: whether it is the first layer of its stage (it receives the stage's input).
    """

    index: int
    name: str
    module: nn.Module | None
    stage: int
    first: bool
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.kind and self.module is not None:
            self.kind = kind_of(self.module)

    def describe(self) -> str:
        return (f"layer {self.index} ({self.kind})" if self.name == str(self.index)
                else f"layer {self.index} {self.name!r} ({self.kind})")


class _Tap(Recorder):
    """The executor's recorder, used to know which action each thread is running."""

    def __init__(self) -> None:
        super().__init__()
        self._now = threading.local()

    def measure(self, rank: int, action: Action, run: Callable[[], None]) -> None:
        self._now.action = action
        try:
            run()
        finally:
            self._now.action = None

    def action(self) -> Action | None:
        return getattr(self._now, "action", None)


@dataclass
class PipelineRun:
    """What the watched pipeline did in one step.

    Attributes:
        pipe: the pipeline (its parameters hold the step's gradients).
        layers: the units compared, in order.
        forward: per (layer index, micro-batch), the output of its forward.
        recomputed: the same, from the first recomputation for backward.
        mutated: layer indices whose call changed an input tensor in place.
        loss: the step's loss (None: the step failed).
        error: the exception the step raised.
        rank_models: per rank, the model copy its layers came from (None: one model).
        shared: what the plain model's layers of two stages hold as one object (a buffer,
            a generator, a container), which the ranks' copies hold apart.
        gradients: after the step, every parameter's gradient by its name in the model
            (zeros where it has none): a tensor-parallel shard put back whole.
        buffers: after the step, every buffer by its name in the model.
        owners: each parameter's stage, by name.
        programs: what each traced stage's program makes and returns.
        disagree: for a tensor-parallel stage, the replicated parameters whose gradient
            its tensor ranks hold differently, by name: the stage.
        split_inputs: the layers whose input its tensor ranks hold apart (each its part
            of the features), by index: where the input comes from, in words.
    """

    pipe: Pipeline
    layers: list[Layer]
    forward: dict[tuple[int, int], Leaves] = field(default_factory=dict)
    recomputed: dict[tuple[int, int], Leaves] = field(default_factory=dict)
    mutated: set[int] = field(default_factory=set)
    loss: torch.Tensor | None = None
    error: BaseException | None = None
    rank_models: dict[int, nn.Module] | None = None
    shared: list[Shared] = field(default_factory=list)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    owners: dict[str, int] = field(default_factory=dict)
    programs: dict[int, Program] = field(default_factory=dict)
    disagree: dict[str, int] = field(default_factory=dict)
    split_inputs: dict[int, str] = field(default_factory=dict)

    def watch(self) -> list[Any]:
        """Puts a recorder on the executor and hooks on every layer; returns the hooks."""
        tap = _Tap()
        self.pipe.runtime.executor.recorder = tap
        lock = threading.Lock()
        inputs: dict[tuple[int, int], tuple[list[int], str]] = {}

        def seen(args: Any, first: bool) -> tuple[list[int], str]:
            """The versions of the input tensors, and (a stage's input) their digest."""
            tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            return [t._version for t in tensors], digest(args) if first else ""

        def before(layer: Layer) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any) -> None:
                inputs[(layer.index, threading.get_ident())] = seen(args, layer.first)
            return hook

        def after(layer: Layer) -> Callable[..., None]:
            index = layer.index

            def hook(module: nn.Module, args: Any, output: Any) -> None:
                action = tap.action()
                changed = seen(args, layer.first) != inputs.pop(
                    (index, threading.get_ident()), None)
                if action is None:
                    return
                key = (index, action.microbatch)
                taken = self.forward if action.kind is Kind.FORWARD else self.recomputed
                with lock:
                    if changed:
                        self.mutated.add(index)
                    taken.setdefault(key, leaves(output))
            return hook

        handles = []
        for layer in self.layers:
            assert layer.module is not None, "a layer shipped from another rank"
            handles.append(layer.module.register_forward_pre_hook(before(layer)))
            handles.append(layer.module.register_forward_hook(after(layer)))
        return handles

    def step(self, inputs: Any, targets: Any, seed: int) -> None:
        """One step of the pipeline, watched, with torch seeded by ``seed``."""
        handles = self.watch()
        try:
            torch.default_generator.manual_seed(seed)
            # A recomputation may stop once it has remade what backward needs, before a
            # layer's output exists; here every recomputation runs to the end, to be seen.
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                self.loss = self.pipe.step(inputs, targets)
        except Exception as exc:  # noqa: BLE001 - reported as a finding
            self.error = exc
        finally:
            self.pipe.runtime.executor.recorder = None
            for handle in handles:
                handle.remove()
        self._settle()

    def _settle(self) -> None:
        """Reads what the step left: gradients, buffers, the stage of each parameter and
        what each traced stage makes."""
        stages = self.pipe.runtime.stages
        stage_of = {id(p): k for k, stage in stages.items() for p in stage.trainable_parameters()}
        for name, param in self.pipe.named_parameters():
            self.gradients[name] = (param.grad.detach() if param.grad is not None
                                    else torch.zeros_like(param))
            if id(param) in stage_of:
                self.owners[name] = stage_of[id(param)]
        self.buffers = dict(self.pipe.named_buffers())
        self.programs = programs_of(stages)


def build_pipeline(plain: nn.Module, *, builder: bool, loss_fn: Callable[[Any, Any], Any],
                   stages: int, chunks: int,
                   balance: Sequence[int] | str | None, split_at: Sequence[str] | None,
                   sample: Any, schedule: str | Schedule, virtual_stages: int,
                   recompute: str | tuple[str, ...], tie_weights: Sequence[Sequence[str]],
                   deferred_batch_norm: bool, tensor_parallel: int = 1,
                   tp_plan: Any = None) -> PipelineRun:
    """The pipeline to watch, on ``stages`` CPU threads, built from copies of ``plain``
    (in this process, under torchrun too); with ``tensor_parallel`` above 1, this
    rank's stages of the torchrun job's pipeline, split over its tensor group.

    Raises:
        BalanceError, ModelError, ScheduleError, TensorParallelError: the options do
            not fit the model.
        ConveyorError: torch.distributed is initialised with several processes (one
            process's check).
    """
    options: dict[str, Any] = dict(
        stages=stages, chunks=chunks, schedule=schedule, virtual_stages=virtual_stages,
        recompute=recompute, loss_fn=loss_fn, deferred_batch_norm=deferred_batch_norm)
    if tensor_parallel > 1:
        make: Callable[..., Pipeline] = functools.partial(
            Pipeline, tensor_parallel=tensor_parallel, tp_plan=tp_plan)
    else:
        make, options["devices"] = _local_pipeline, ["cpu"] * stages
    if traced(plain, builder=builder, balance=balance, split_at=split_at):
        # Cut as Pipeline cuts it: at split_at, or among its blocks (stages=K alone).
        pipe = make(copy.deepcopy(plain), split_at=split_at, sample=sample,
                    balance=balance, tie_weights=tie_weights, **options)
        layers = [Layer(k, f"stage{k}", stage.layers[0], k, True)
                  for k, stage in sorted(pipe.runtime.stages.items())]
        return PipelineRun(pipe, layers)
    named = sequential_layers(plain)
    table = (schedule if isinstance(schedule, Schedule)
             else build_schedule(schedule, stages, chunks, virtual_stages=virtual_stages))
    counts = resolve_balance(balance, LayerSource(plain, None), table.num_stages, sample)
    stage_of = [s for s, n in enumerate(counts) for _ in range(n)]
    shared = find_shared({k: [(name, layer) for i, (name, layer) in enumerate(named)
                              if stage_of[i] == k] for k in range(len(counts))})
    rank_models: dict[int, nn.Module] | None = None
    if tensor_parallel > 1:  # this process is one rank: its copy is its own
        assembled = copy.deepcopy(plain)
    else:
        rank_models = {rank: copy.deepcopy(plain) for rank in sorted(set(table.stage_ranks))}
        assembled = nn.Sequential(OrderedDict(
            (name, rank_models[table.stage_ranks[stage_of[i]]].get_submodule(name))
            for i, (name, _) in enumerate(named)))
        if not builder:  # layers sharing an nn.Parameter stay tied, as Pipeline ties them
            _retie(assembled, find_ties(named))
    pipe = make(assembled, balance=counts, sample=sample, tie_weights=tie_weights, **options)
    layers = [Layer(i, name, pipe.get_submodule(name), stage_of[i],
                    i == 0 or stage_of[i - 1] != stage_of[i])
              for i, (name, _) in enumerate(named) if stage_of[i] in pipe.runtime.stages]
    once = {id(found): found for found in (x for held in shared.values() for x in held)}
    return PipelineRun(pipe, layers, rank_models=rank_models, shared=list(once.values()))


def traced(model: nn.Module, *, builder: bool, balance: Sequence[int] | str | None,
           split_at: Sequence[str] | None) -> bool:
    """Whether Pipeline traces ``model`` to cut it: ``split_at`` given, or any module
    but an ``nn.Sequential`` with no list of layers per stage (the cut chosen among its
    blocks, by parameters or by time)."""
    return split_at is not None or (not builder and not isinstance(model, nn.Sequential)
                                    and (balance is None or balance == "time"))


def _local_pipeline(module: nn.Module, **options: Any) -> Pipeline:
    """A Pipeline of every stage in this process, even under torchrun: built on an
    explicit topology of this process alone, not on the environment's.

    Raises:
        ConveyorError: torch.distributed is already initialised with several processes.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConveyorError(
            "conveyor.check runs every stage in this process, but torch.distributed is "
            "already initialised here; check before the first Pipeline (or outside torchrun)")
    ranks = local_ranks(options.get("stages"), options.get("devices"), options.get("balance"),
                        options.get("virtual_stages", 1), options.get("schedule"))
    return Pipeline(module, topology=Topology(pipeline_size=ranks), **options)


def _retie(model: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Makes each group of parameter names one ``nn.Parameter`` again (the first's)."""
    for names in groups:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, shared)
