"""``Runtime``: what one pipeline runs with, built in one place for both faces.

A runtime holds a :class:`~conveyor.graph.layout.Layout` (the stages this process runs),
the schedule table, the transport between stages and the executor that walks the
table. Threads of this process or ranks under torchrun: the difference is its *wiring*
(:mod:`conveyor.runtime.wiring`), chosen once, never asked about again.
``GPipe`` and ``Pipeline`` build one; re-balancing replaces it as a whole
(:meth:`Runtime.replaced`) when layers move, carrying over what must survive a move: the
step count that messages carry, the runs counted, a recording under way.

Its collectives (the step's loss from the last stage, the all-reduces of ties, replicas
and clipping) wait at most the step's timeout and note in this rank's position that it
is in them, so that a hang report says where each rank stood.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from conveyor.distributed.faults import collective
from conveyor.distributed.topology import Topology
from conveyor.engine.devices import KeepsPlacement
from conveyor.engine.executor import Executor
from conveyor.engine.offload import Offloader, OffloadMeter
from conveyor.engine.stage import Stage
from conveyor.engine.step import StepState
from conveyor.engine.transport import Transport
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.graph.firstcall import not_cut
from conveyor.graph.layout import Layout
from conveyor.runtime.export import save_pretrained
from conveyor.runtime.vocabranks import VocabRanks
from conveyor.runtime.vocabulary import (
    VocabParallelCrossEntropy,
    VocabShards,
    hidden_of,
    replace_hidden,
)
from conveyor.runtime.wiring import Columns, Wiring
from conveyor.schedules import Kind, Schedule, actions_of

__all__: list[str] = []


class Runtime:
    """The layout, schedule, transport and executor of one pipeline in this process.

    Args:
        layout: the stages this process runs, as :func:`~conveyor.graph.layout.cut`
            built them.
        schedule: the table every rank walks (with the layout's edges).
        topology: where this process sits (one process: ``Topology(pipeline_size=K)``).
        devices: one device per pipeline rank.
        deadlines: the seconds a wait may take.
        wiring: how the stages reach each other (threads, or ranks).
        previous: the runtime this one replaces (its step count, runs and recording
            carry over).
        fuse_accumulation: let each stage whose backward the schedule never splits add
            its linear layers' weight gradients into ``.grad`` as they are computed
            (:mod:`conveyor.engine.backward.accumulation`; not for compiled or sharded stages).
        offload: the stages whose saved activations wait on the host
            (:mod:`conveyor.engine.offload`), counted per pipeline rank in
            ``offload_meters``.
    """

    def __init__(self, layout: Layout, schedule: Schedule, topology: Topology,
                 devices: Sequence[torch.device], deadlines: Deadlines, wiring: Wiring, *,
                 previous: Runtime | None = None, fuse_accumulation: bool = False,
                 offload: frozenset[int] = frozenset()) -> None:
        self.layout = layout
        self.schedule = schedule
        self.topology = topology
        self.devices = list(devices)
        self.deadlines = deadlines
        self.wiring = wiring
        self.fuse_accumulation = fuse_accumulation
        self._phases: dict[tuple[tuple[Kind, ...], int | None], Columns] = {}
        split = {a.stage for a in schedule.actions if a.kind is Kind.INPUT}
        for number, stage in layout.stages.items():
            if fuse_accumulation and number not in split:
                stage.fuse_accumulation()
        self.offload = offload
        #: under torchrun with a vocabulary-parallel head, this rank's part in it
        self.vocabulary: VocabRanks | None = previous.vocabulary if previous else None
        self.offload_meters: dict[int, OffloadMeter] = (
            previous.offload_meters if previous is not None else
            {rank: OffloadMeter() for rank in {schedule.stage_ranks[s] for s in offload}})
        for number in offload & layout.stages.keys():
            layout.stages[number].offloader = Offloader(
                layout.stages[number].device, self.offload_meters[schedule.stage_ranks[number]])
        self.transport: Transport = wiring.transport(
            schedule, [self.stage_device(s) for s in range(schedule.num_stages)], deadlines,
            previous.transport if previous is not None else None)
        self.executor = Executor(layout.stages, schedule, self.transport, deadlines)
        self.executor.reports = wiring.reports
        self.executor.route = wiring.route(self.transport)
        if previous is not None:
            old = previous.executor
            self.executor.runs, self.executor.recorder = old.runs, old.recorder
            self.executor.abandoned = old.abandoned

    @property
    def stages(self) -> dict[int, Stage]:
        """The stages this process runs, by stage number."""
        return self.layout.stages

    @property
    def device(self) -> torch.device:
        """The device this process's collectives run on."""
        return self.topology.device or self.devices[-1]

    def stage_device(self, stage: int) -> torch.device:
        return self.devices[self.schedule.stage_ranks[stage]]

    def replaced(self, layout: Layout) -> Runtime:
        """A runtime for ``layout`` (the same stages, other layers) in this one's place."""
        return Runtime(layout, self.schedule, self.topology, self.devices, self.deadlines,
                       self.wiring, previous=self, fuse_accumulation=self.fuse_accumulation,
                       offload=self.offload)

    # ------------------------------------------------------------------ a step

    def run(self, kinds: Sequence[Kind], state: StepState, *, commit: bool = True,
            microbatches: int | None = None) -> None:
        """Runs the actions of ``kinds`` of every local rank's column; with ``commit``,
        deferred batch-norm statistics are committed after (discarded on failure).
        With ``microbatches`` = n, only the actions of micro-batches 0..n-1 (a batch
        smaller than the table's): every action depends only on actions of its own
        micro-batch, so each column's remaining actions keep a valid order.

        Raises:
            StageError, StepTimeout, PeerFailure: as the executor's run; under torchrun
                the error carries the report of where every rank stood.
        """
        everyone = self._phase(tuple(kinds), microbatches)
        columns = self.wiring.columns(self.transport, everyone)
        if self.vocabulary is not None and state.loss_fn is not None and state.grad_enabled:
            state.joins = {self.topology.table_rank: self.vocabulary.joins(everyone,
                                                                           self.schedule)}
        try:
            if commit:
                self.executor.run_committed(columns, state, pool=self._pooling())
            else:
                self.executor.run(columns, state)
        except BaseException as exc:
            self.explain(exc)
            raise

    def _phase(self, kinds: tuple[Kind, ...], microbatches: int | None) -> Columns:
        """Every rank's column of the actions of ``kinds`` (of micro-batches below
        ``microbatches``), found once: the same columns from step to step, so that what
        is learned from them (the messages each rank awaits) is kept."""
        key = (kinds, microbatches)
        if key not in self._phases:
            everyone = actions_of(self.schedule, list(kinds))
            self._phases[key] = {
                rank: tuple(a for a in column if microbatches is None
                            or a.microbatch < microbatches)
                for rank, column in everyone.items()}
        return self._phases[key]

    def _pooling(self) -> Callable[[], None] | None:
        """With replicated stages, what pools the deferred batch norms' statistics over
        this stage's replicas before they are committed (None: nothing to pool)."""
        group = self.topology.replica_group
        norms = [m for stage in self.stages.values() for m in stage.deferred_batch_norms]
        if group is None or not norms:
            return None
        what = "the pooling of batch-norm statistics over the stage's replicas"

        def pool() -> None:
            for norm in norms:
                norm.merge_pooled(lambda packed: self.all_reduce(packed, group, what))
        return pool

    def explain(self, error: BaseException) -> None:
        """Under torchrun, gives a failed step's ``error`` the report of where every rank
        stood (see :mod:`conveyor.distributed.faults.explain`)."""
        self.wiring.explain(error, self.executor, self.transport)

    def snapshot(self) -> dict[str, Any] | None:
        """This rank's place in the current (or last) step, as plain data."""
        position = self.executor.positions.get(self.topology.table_rank)
        return None if position is None else position.snapshot()

    # ------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, group: Any, what: str, op: Any = None, *,
                   seconds: float | None = None) -> None:
        """An all-reduce over ``group`` whose wait is bounded (the step's, by default);
        this rank's position says it is in ``what`` once its part is issued."""
        collective.all_reduce(tensor, group=group, what=what, op=op,
                              seconds=self.deadlines.within if seconds is None else seconds,
                              notice=self.notice(), joined=lambda: self.joining(what))

    def joining(self, what: str) -> None:
        """Notes in this rank's position that it is in the collective ``what``."""
        position = self.executor.positions.get(self.topology.table_rank)
        if position is not None:
            position.joining(what)

    def broadcast(self, tensor: torch.Tensor, source: int, group: Any, what: str) -> None:
        """A broadcast of ``tensor`` from pipeline rank ``source`` over ``group``,
        bounded and noted as :meth:`all_reduce` is."""
        collective.broadcast(tensor, src=self.topology.global_rank(source), group=group,
                             what=what, seconds=self.deadlines.within, notice=self.notice(),
                             joined=lambda: self.joining(what))

    def head_logits(self, output: Any, shards: VocabShards | None, loss_fn: Any) -> Any:
        """Inference: the last stage's ``output`` with a vocabulary-parallel head's whole
        logits in its place (under torchrun every rank calls it, each computing its
        shard; ``output`` is None but at the last stage); ``output`` itself without one.
        Over a tensor group the last stage's ranks gather their parts."""
        if shards is None:
            if output is not None and isinstance(loss_fn, VocabParallelCrossEntropy):
                return loss_fn.whole_logits(output)
            return output
        if self.vocabulary is None:
            return None if output is None else shards.with_logits(output)
        logits = self.vocabulary.logits(None if output is None else hidden_of(output))
        return None if output is None or logits is None else replace_hidden(output, logits)

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the last stage's rank has it, on every rank of this pipeline
        (in one process: ``value`` itself). A collective: every rank calls it."""
        if not self.topology.distributed:
            return value
        last = self.schedule.stage_ranks[-1] == self.topology.table_rank
        shared = value.to(self.device) if last else torch.zeros_like(value, device=self.device)
        # A sum to which the other ranks add zeros, not a broadcast: a rank may leave a
        # broadcast once the data has reached it, whether or not every rank joined, and
        # would end a step that another rank failed (its last backward, say) as done.
        # (Replicas of the last stage each add their micro-batches' share.)
        self.sum_over_pipeline(shared, "the all-reduce of the step's loss from the last stage")
        return shared.to(value.device)

    def sum_over_pipeline(self, tensor: torch.Tensor, what: str) -> None:
        """Sums ``tensor`` (on this rank's device) over the ranks of this pipeline, in
        place (in one process: left as it is). A collective: every rank calls it."""
        if self.topology.distributed:
            self.all_reduce(tensor, self.topology.pipeline_group, what)

    def from_first_stage(self, count: int) -> int:
        """``count`` as the first stage's rank has it, on every rank of this pipeline
        (in one process: ``count`` itself). A collective: every rank calls it."""
        topology = self.topology
        if not topology.distributed:
            return count
        shared = torch.tensor([count], dtype=torch.int64, device=self.device)
        what = "the broadcast of the number of micro-batches from the first stage"
        collective.broadcast(shared, src=topology.global_rank(self.schedule.stage_ranks[0]),
                             group=topology.pipeline_group, what=what,
                             seconds=self.deadlines.within, notice=self.notice(),
                             joined=lambda: self.joining(what))
        return int(shared.item())

    def notice(self) -> collective.Notice | None:
        """How a collective of this step looks for a rank's announced failure."""
        return self.wiring.notice(self.transport)


class RunsRuntime(KeepsPlacement):
    """What the two faces, ``GPipe`` and ``Pipeline``, share: a module that runs a
    :class:`Runtime` (set as ``_runtime`` by the face's constructor, or at the first
    call of a model cut on it) and shows its cut."""

    @property
    def _runtime(self) -> Runtime:
        built: Runtime | None = self.__dict__.get("_built")
        return built if built is not None else not_cut()

    @_runtime.setter
    def _runtime(self, runtime: Runtime) -> None:
        self.__dict__["_built"] = runtime

    @property
    def runtime(self) -> Runtime:
        """The layout, schedule table, transport and executor this process runs."""
        return self._runtime

    def save_pretrained(self, directory: str | Path, *, tokenizer: Any = None,
                        config: Any = None) -> Path:
        """Writes the model's weights as a standard model directory: safetensors files
        (one per stage) by the plain model's names and their index, a Hugging Face
        model's ``config.json`` (and generation config), and ``tokenizer`` when given;
        ``from_pretrained(directory)`` (or ``weights=directory``) reads them back
        bit-exact. Stage by stage, from any layout; every rank of a torchrun job calls it.

        Args:
            directory: a new or empty folder.
            tokenizer: anything with ``save_pretrained(directory)`` (a tokenizer).
            config: the model's config, when it is not the Hugging Face model's own.

        Returns:
            The folder.

        Raises:
            SaveError: the folder is a file or is not empty (nothing written).
        """
        model_config = config if config is not None else self.__dict__.get("_model_config")
        return save_pretrained(self, self._runtime, directory, config=model_config,
                               generation_config=self.__dict__.get("_generation_config"),
                               tokenizer=tokenizer)

    @property
    def balance(self) -> list[int]:
        """Layers per stage (one per stage for a model cut at ``split_at``)."""
        return self._runtime.layout.balance

    @property
    def split_at(self) -> list[str] | None:
        """Where the model was cut (as given, or chosen among its blocks); None for a
        sequence of layers run as they are."""
        return self._runtime.layout.split_at
