"""Building a pipeline from its options, in two parts.

:func:`place`, when the pipeline is made: where its ranks are (the given topology, or
the environment's, whose ranks then agree on every option), its devices and its table.
:func:`build`, then or at its first call (a model cut on its first micro-batch keeps a
:class:`Pending` until that call): the cut, the table's edges and ties, the wiring,
data parallelism, compilation and re-balancing, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.distributed.faults import collective
from conveyor.distributed.faults.agreement import agree, model_shapes
from conveyor.distributed.sharding import Sharding, check_sharding
from conveyor.distributed.ties import connect_ties
from conveyor.distributed.topology import Topology
from conveyor.engine.backward.accumulation import fusing_allowed
from conveyor.engine.compiled.cudagraphs import check_cuda_graphs
from conveyor.engine.devices import resolve_devices
from conveyor.engine.executor import thread_devices
from conveyor.engine.loss import LossScaler, compute_dtype
from conveyor.engine.offload import offloaded_stages
from conveyor.errors import ConfigError, ConveyorError
from conveyor.engine.recompute.replay import check_stage_modes
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.graph.firstcall import (
    cuts_at_first_step,
    first_microbatch,
    keep_copies_equal,
)
from conveyor.graph.layout import Layout, adopt, cut, refuse_edges
from conveyor.graph.source import LayerBuilder
from conveyor.runtime.options import PipelineOptions
from conveyor.runtime.planning import (
    local_ranks,
    make_schedule,
    refuse_one_process,
    refuse_replicated,
    table_ranks,
    with_model_edges,
)
from conveyor.runtime.rebalance.rebalancing import Rebalancing, check_rebalance
from conveyor.runtime.runtime import Runtime
from conveyor.runtime.steps import TrainingStep
from conveyor.runtime.verify import Certificate
from conveyor.runtime.vocabranks import (
    VocabRanks,
    refuse_across_processes,
    vocabulary_group,
)
from conveyor.runtime.vocabulary import (
    VocabParallelCrossEntropy,
    VocabShards,
    split_head,
    take_head,
)
from conveyor.runtime.wiring import Ranks, Threads, Wiring
from conveyor.schedules import Schedule
from conveyor.tensor.mesh import TensorSplit, split_model

__all__: list[str] = []


@dataclass
class Pending:
    """What a pipeline not cut yet keeps until it is.

    Attributes:
        at_first_call: the model is cut on the first call's first micro-batch (no
            ``sample=``); until then the pipeline has adopted its weights.
    """

    module: nn.Module | LayerBuilder
    deadlines: Deadlines
    sharded: bool
    at_first_call: bool
    vocabulary: VocabShards | None = None


@dataclass
class Placed:
    """Where a pipeline runs, decided when it is made (and a vocabulary-parallel
    head's shards over its ranks' devices)."""

    topology: Topology
    devices: list[torch.device]
    schedule: Schedule
    pending: Pending
    vocabulary: VocabShards | None = None


def place(owner: nn.Module, module: nn.Module | LayerBuilder,
          options: PipelineOptions) -> Placed:
    """The topology (``options.topology``, else the environment's: under torchrun the
    ranks first agree on every option and the model's shapes), devices and table of a
    pipeline of ``module``. A model cut at the first call is adopted by ``owner`` until
    then (its ``parameters()`` and ``state_dict()`` are the model's).

    Raises:
        ConfigError: under torchrun, the ranks were given different options.
        ScheduleError, BalanceError, ConveyorError: the options do not fit.
    """
    # The cut never sees a head split over the pipeline's ranks; over a tensor group
    # the head stays in the model, split column-wise (see split_model).
    head = take_head(module, options.loss_fn) if options.tensor_parallel == 1 else None
    deadlines = Deadlines(options.timeout)
    given = options.topology
    if given is None:
        refuse_one_process(options.data_parallel, options.stages, options.plan)
    topology = given or Topology.from_environment(
        data_parallel=options.data_parallel, stages=options.stages, timeout=deadlines.opening,
        tensor_parallel=options.tensor_parallel)
    if topology is not None and topology.distributed:
        agree({"ranks": topology.pipeline_size, **options.agreed(),
               "model": model_shapes(module)}, seconds=deadlines.opening)
    ranks = (table_ranks(topology) if topology and (given or topology.distributed)
             else local_ranks(options.stages, options.devices, options.balance,
                              options.virtual_stages, options.schedule))
    if topology is None or not topology.distributed:
        topology = Topology(pipeline_size=ranks)
    schedule = make_schedule(options.schedule, ranks, options.chunks, options.virtual_stages)
    if topology.replicas is not None:
        refuse_replicated(topology.replicas, schedule, sharding=options.sharding,
                          rebalance=options.rebalance)
    devices = (resolve_devices(options.devices, ranks, what=f"the pipeline has {ranks} ranks",
                               per="pipeline rank")
               if not topology.distributed
               else [topology.device or torch.device("cpu")] * ranks)
    sharded = check_sharding(options.sharding, schedule, topology)
    refuse_edges(schedule.edges, module, options.split_at)
    at_first_call = options.sample is None and isinstance(module, nn.Module) and \
        cuts_at_first_step(module, options.balance, options.split_at,
                           distributed=topology.distributed)
    if at_first_call:
        assert isinstance(module, nn.Module)
        adopt(owner, module)
    vocabulary = None
    if head is not None:
        assert isinstance(options.loss_fn, VocabParallelCrossEntropy)
        mine = [topology.table_rank] if topology.distributed else range(ranks)
        if topology.distributed:
            refuse_across_processes(topology, sharding=options.sharding,
                                    precision=options.precision, rebalance=options.rebalance)
        vocabulary = split_head(owner, options.loss_fn, head, {r: devices[r] for r in mine},
                                ranks)
    return Placed(topology, devices, schedule,
                  Pending(module, deadlines, sharded, at_first_call, vocabulary), vocabulary)


@dataclass
class Built:
    """A built pipeline: its table (with the model's edges), runtime, how it trains
    (with its shards), and its re-balancing (None: none)."""

    schedule: Schedule
    runtime: Runtime
    training: TrainingStep
    rebalancing: Rebalancing | None


def build(owner: nn.Module, pending: Pending, options: PipelineOptions, schedule: Schedule,
          topology: Topology, devices: Sequence[torch.device], *, sample: Any,
          snapshot: Callable[[], dict[str, Any] | None],
          scaler: LossScaler | None) -> Built:
    """Cuts ``pending.module`` into ``owner`` (its layers registered there) and builds
    the runtime of this process's stages.

    Args:
        sample: a batch to cut on (a model cut at the first call: that call's inputs,
            cut on their first micro-batch).
        snapshot: this rank's place in a step (what it answers other ranks).
        scaler: float16's loss scaler (None: no loss scaling).
    """
    check_stage_modes(options.mode, schedule.num_stages)
    if options.cuda_graphs:
        modes = options.mode
        check_cuda_graphs(
            devices=[devices[schedule.stage_ranks[s]] for s in range(schedule.num_stages)],
            compiled=options.compile, splits=schedule.splits_backward,
            modes=[modes] * schedule.num_stages if isinstance(modes, str) else list(modes),
            offloaded=bool(offloaded_stages(options.offload, schedule.num_stages)),
            sharded=pending.sharded)
    distributed = topology.distributed
    if pending.at_first_call:
        assert isinstance(pending.module, nn.Module)  # a layer builder is cut when built
        sample = first_microbatch(sample, options.chunks, pending.module)
    split = _split_over_tensor_ranks(pending, topology, options)
    layout = cut(
        owner, pending.module, stages=schedule.num_stages,
        devices={s: devices[schedule.stage_ranks[s]] for s in range(schedule.num_stages)},
        local=[s for s in range(schedule.num_stages)
               if not distributed or schedule.stage_ranks[s] == topology.table_rank],
        concurrent=thread_devices(devices if not distributed else devices[:1]),
        sample=sample, decide=_from_rank_zero(topology, pending.deadlines), **options.cut())
    if layout.edges:
        schedule = with_model_edges(schedule, layout.edges)
    if distributed:
        connect_ties(layout.ties, topology, schedule.stage_ranks, pending.deadlines.opening)
    if topology.replicas is not None:
        for number, stage in layout.stages.items():
            stage.replicated = topology.replicas.counts[number] > 1
    sharding = Sharding(layout.stages, topology, schedule, layout.ties) \
        if pending.sharded else None
    if split is not None:
        split.after_cut(owner, sharding)
    wiring: Wiring = Ranks(topology, snapshot) if distributed else Threads()
    runtime = Runtime(layout, schedule, topology, devices, pending.deadlines, wiring,
                      fuse_accumulation=fusing_allowed() and not options.compile
                      and not sharding,
                      offload=_offloaded(options, schedule.num_stages, sharded=bool(sharding)))
    _keep_weight_groups(layout, pending.vocabulary is not None or sharding is not None
                        or topology.tensor_size > 1)
    if pending.vocabulary is not None and distributed:
        assert isinstance(options.loss_fn, VocabParallelCrossEntropy)
        runtime.vocabulary = VocabRanks(runtime, pending.vocabulary,
                                        vocabulary_group(topology))
        options.loss_fn.exchange = runtime.vocabulary.lead
    if pending.at_first_call:  # the optimizer holds the adopted weights
        keep_copies_equal(owner, layout.ties)
    for stage in layout.stages.values() if options.compile else ():
        stage.compile(cuda_graphs=options.cuda_graphs)
    rebalancing = None
    if options.rebalance is not None:
        check_rebalance(runtime, options.rebalance, sharded=pending.sharded)
        assert layout.source is not None  # check_rebalance refuses a traced model
        rebalancing = Rebalancing(options.rebalance, len(layout.source.names))
    certificate = _certificate(options, runtime)
    training = TrainingStep(options.chunks, options.mode, options.check_finite,
                            compute_dtype(options.precision), scaler, sharding, certificate)
    return Built(schedule, runtime, training, rebalancing)


def _certificate(options: PipelineOptions, runtime: Runtime) -> Certificate | None:
    """``verify_every=``'s certificate (None: off).

    Raises:
        ConfigError: not every stage runs in this process.
    """
    if not options.verify_every:
        return None
    stages = runtime.schedule.num_stages
    if set(runtime.stages) != set(range(stages)):
        raise ConfigError(
            f"verify_every={options.verify_every}: this process runs stages "
            f"{sorted(runtime.stages)} of {stages}; the certificate re-runs every stage in "
            "one process, not yet across torchrun's ranks (drop verify_every there, or "
            "check the pipeline with conveyor check)")
    return Certificate(options.verify_every, options.chunks)



def _split_over_tensor_ranks(pending: Pending, topology: Topology,
                             options: PipelineOptions) -> TensorSplit | None:
    """The model split over this rank's tensor group (None: no tensor parallelism); a
    VocabParallelCrossEntropy's head column-wise over it, the loss told its group."""
    vocabulary = options.loss_fn if isinstance(
        options.loss_fn, VocabParallelCrossEntropy) else None
    split = split_model(pending.module, topology, options.tp_plan, pending.deadlines.opening,
                        untried={"rebalance=": options.rebalance is not None},
                        split_head=vocabulary.head if vocabulary else None)
    if split is not None and vocabulary is not None:
        vocabulary.split_over(split.group)
    return split


def _keep_weight_groups(layout: Layout, shared: bool) -> None:
    """Where a stage's backward works with other ranks or the head (``shared``: a
    vocabulary-parallel head, tensor parallelism, FSDP), its input path's backward must
    run once: ``W`` starts by parameter groups (see
    :mod:`conveyor.engine.backward.weightpath`)."""
    for stage in layout.stages.values() if shared else ():
        stage.weight_path.keep_groups("what its backward does with other ranks or the head "
                                      "must happen once")


def _offloaded(options: PipelineOptions, stages: int, *, sharded: bool) -> frozenset[int]:
    """The stages whose activations are offloaded.

    Raises:
        ValueError: one entry per stage expected.
        ConveyorError: offload with FSDP (not supported yet).
    """
    offloaded = offloaded_stages(options.offload, stages)
    if offloaded and sharded:
        raise ConveyorError("offload= is not supported with sharding=\"fsdp\" yet; use "
                            "one of them, or recompute= to save activation memory")
    return offloaded


def _from_rank_zero(topology: Topology, deadlines: Deadlines) -> Callable[[list[int]], list[int]]:
    """What the cut calls to make the balance this rank measured the job's: under
    torchrun, global rank 0's (a bounded exchange); in one process, its own."""
    def decide(balance: list[int]) -> list[int]:
        if not topology.distributed:
            return balance
        shared = collective.exchange(balance, group=None, seconds=deadlines.opening,
                                     what="the sharing of rank 0's balance by time",
                                     device=topology.device)
        return [int(count) for count in shared[0]]
    return decide
