"""Running the actions of a schedule on stages.

Each rank walks its column of the table in order; in one process every rank is a
thread, under torchrun a process runs its own rank's column. The executor only walks:
for each action it receives what the action needs, has the stage do it and sends what
the stage made. What an action means is the stage's (:class:`~conveyor.engine.stage.Stage`):
``F`` runs the micro-batch (and the loss at the last stage), ``B`` back-propagates it,
``I`` computes only its input gradient and keeps what the weight gradient needs for the
micro-batch's ``W``, which runs later. Each action's kind alone says what it does.
What a stage receives and sends is the
schedule's: from and to its neighbours, and over the table's edges (a traced model's
values that skip stages go from the stage that makes them straight to each stage that
uses them; the gradients of those that carry one come back the same way, and a value
sent to several stages gets their gradients summed). With GPipe on two stages and three
micro-batches the ranks overlap like this (one tick per action)::

    rank 0  0F0 0F1 0F2 .   .   0B2 0B1 0B0
    rank 1  .   1F0 1F1 1F2 1B2 1B1 1B0 .

If any action raises, the transport is aborted and every rank stops before its next
action (the transport's ``poll``) or at the receive it waits in, whichever comes first;
the first error is raised in the caller, naming the stage and micro-batch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.engine import actionlog
from conveyor.engine.allocator import tune_malloc
from conveyor.engine.layers import failure
from conveyor.engine.offload import offload_plan
from conveyor.engine.recorder import Recorder
from conveyor.engine.backward.routing import check_no_gradient
from conveyor.engine.stage import Stage
from conveyor.engine.step import LaneWork, StepState
from conveyor.engine.transport import Aborted, LocalTransport, MessageKind, Transport
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.engine.watchdog.hangreport import render_report
from conveyor.engine.watchdog.position import KIND_WORDS, Awaited, Position
from conveyor.engine.watchdog.threads import WatchedRanks, attach_report, notes
from conveyor.errors import (
    ConveyorError,
    PeerFailure,
    StageError,
)
from conveyor.schedules import Action, Kind, Schedule
from conveyor.schedules.clock import clock_order

__all__: list[str] = []



class Executor:
    """Runs columns of a schedule on the stages that live in this process.

    Args:
        stages: the local stages, by stage number (all of them in one process).
        schedule: the table whose columns it runs: the rank of each stage, and what
            each action sends and receives (its edges too).
        transport: moves activations and gradients between stages.
    """

    def __init__(self, stages: Mapping[int, Stage], schedule: Schedule,
                 transport: Transport, deadlines: Deadlines | None = None) -> None:
        self.stages = dict(stages)
        self.schedule = schedule
        self.stage_ranks = list(schedule.stage_ranks)
        self.transport = transport
        self.deadlines = deadlines if deadlines is not None else Deadlines(None)
        #: where each local rank stands in the current (or last) run.
        self.positions: dict[int, Position] = {}
        self.kinds: frozenset[Kind] = frozenset()  # what the current (or last) run runs
        self.runs = 0  # runs started, counted from 1: the step number of a report
        self.abandoned: str | None = None  # why runs are refused (a thread left behind)
        self.reports = True  # a failed run's error carries the report of the local ranks
        # Edges whose values carry no gradient (masks, ids): none may require grad.
        self._no_gradient = {(e.source, e.destination) for e in schedule.edges
                             if not e.gradient}
        self.recorder: Recorder | None = None  # set by conveyor.record()
        #: the rank that runs a stage on a micro-batch, where the table's stage ranks do
        #: not say it (replicated stages); None: they do
        self.route: Callable[[int, int], int] | None = None
        local = getattr(transport, "local", transport)  # under torchrun: between own stages
        if isinstance(local, LocalTransport):
            local.liveness = self.snapshots

    def snapshots(self) -> dict[int, dict[str, Any]]:
        """Where each local rank stands now, as plain data."""
        return {rank: position.snapshot() for rank, position in self.positions.items()}

    def report(self, notes: Mapping[int, str] = {}, absent: str = "no answer") -> str:
        """The hang report of the current (or last) run, from the local ranks' places
        (``absent``: what the others are said to be)."""
        return render_report(self.schedule, self.kinds, self.snapshots(), notes, absent)

    def run_committed(self, columns: Mapping[int, Sequence[Action]], state: StepState, *,
                      pool: Callable[[], None] | None = None) -> None:
        """Runs the columns like :meth:`run`, then commits the local stages' deferred
        batch-norm statistics (once ``pool`` has pooled them with other processes'),
        or discards them if any rank failed."""
        try:
            self.run(columns, state)
            if pool is not None:
                pool()
        except BaseException:
            for stage in self.stages.values():
                stage.end_step(commit=False)
            raise
        for stage in self.stages.values():
            stage.end_step(commit=True)

    def run(self, columns: Mapping[int, Sequence[Action]], state: StepState) -> None:
        """Runs ``columns[r]`` for every rank r given, each on its own thread.

        A single busy rank runs in the calling thread. With the ``conveyor`` logger at
        DEBUG, the run and each action are logged (see ``conveyor.engine.actionlog``).
        Each rank's place is kept in ``positions`` while it runs; a failed run's error
        carries the report of them (``where``).

        Raises:
            StageError: an action failed (or the typed error a stage raised).
            StepTimeout: a rank waited, or ran one action, longer than the timeout.
            ConveyorError: an earlier run left a stuck thread behind.
        """
        if self.abandoned is not None:
            raise ConveyorError(self.abandoned)
        self.runs += 1
        self.kinds = frozenset(a.kind for column in columns.values() for a in column)
        self.positions = {rank: Position(rank, column, self.runs)
                          for rank, column in columns.items()}
        started = time.monotonic()
        if not actionlog.enabled():  # asked once per run: the actions pay nothing
            self._run(columns, state, None)
        else:
            log = actionlog.ActionLog(self.transport, columns, state.inputs)
            self.transport = log.transport  # notes what each action receives and sends
            try:
                with log.phase():
                    self._run(columns, state, log)
            finally:
                self.transport = log.transport.inner
        self.deadlines.measured(time.monotonic() - started)  # a run that went through

    def _run(self, columns: Mapping[int, Sequence[Action]], state: StepState,
             log: actionlog.ActionLog | None) -> None:
        """:meth:`run`, logging each action to ``log`` where there is one."""
        self.transport.reset()
        context = _ThreadState.capture(state.grad_enabled)
        devices = {self.stage_ranks[s]: stage.device for s, stage in self.stages.items()}
        busy = [rank for rank, column in columns.items() if column]
        cpu_ranks = sum(1 for rank in busy if devices[rank].type == "cpu")
        cpu_threads = max(1, torch.get_num_threads() // max(1, cpu_ranks))
        if cpu_ranks > 1:
            tune_malloc()
        errors: list[BaseException] = []
        lock = threading.Lock()

        recorder = self.recorder

        def execute(rank: int, action: Action) -> None:
            if recorder is None:
                self._execute(action, state)
            else:
                recorder.measure(rank, action, lambda: self._execute(action, state))

        lanes = device_lanes(columns, devices, self.schedule)
        self._plan_offload(lanes, state)

        def work(lead: int) -> None:
            position = self.positions[lead]
            around = LaneWork(state, lead, lanes[lead])
            try:
                with context.applied(devices[lead], cpu_threads), contextlib.ExitStack() as rng:
                    for rank in {rank for rank, _ in lanes[lead]}:
                        rng.enter_context(self._preserved_rng(rank))
                    for at, (rank, action) in enumerate(lanes[lead]):
                        self.transport.poll()
                        around.before(at)
                        position = self.positions[rank]
                        position.begin(action)
                        if log is not None:
                            log.action(rank, action, lambda: execute(rank, action))
                        else:
                            execute(rank, action)
                        around.after(at)
                        position.end()
                    around.before(len(lanes[lead]))
            except Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                position.failed(elsewhere=isinstance(exc, PeerFailure))
                with lock:
                    errors.append(exc)
                self.transport.abort(exc)

        if len(lanes) == 1:
            work(next(iter(lanes)))  # one lane: run it here, without a thread
        else:
            watched = WatchedRanks(self.positions, self.deadlines, self.transport, errors, lock)
            self.abandoned = watched.run(list(lanes), work, self.runs)
        if errors:
            error = errors[0]
            if self.reports:
                attach_report(error, self.report(notes(self.positions, self.deadlines.within)))
            raise error
        self.transport.finish()

    def _plan_offload(self, lanes: Mapping[int, Sequence[tuple[int, Action]]],
                      state: StepState) -> None:
        """Which micro-batches of offloading stages wait on the host in this run."""
        offloading = {s for s, stage in self.stages.items() if stage.offloader is not None}
        if offloading and state.grad_enabled:
            state.offload = offload_plan(lanes, offloading, state.recompute)

    def _preserved_rng(self, rank: int) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        seen: set[torch.device] = set()
        for s, stage in self.stages.items():
            if self.stage_ranks[s] == rank and stage.device not in seen:
                seen.add(stage.device)
                stack.enter_context(stage.randomness.preserved())
        return stack

    def _execute(self, action: Action, state: StepState) -> None:
        try:
            self._act(action, state)
        except Aborted:
            raise
        except Exception as exc:
            if type(exc) is StageError and (exc.stage, exc.microbatch) == (
                    action.stage, action.microbatch):
                exc.action = str(action)  # a stage recomputing cannot tell B from I
            error = failure(
                exc,
                f"stage {action.stage} failed in {KIND_WORDS[action.kind]} of micro-batch "
                f"{action.microbatch} ({action})",
                stage=action.stage,
                microbatch=action.microbatch,
                action=str(action),
            )
            if error is exc:
                raise
            raise error from exc

    def _act(self, action: Action, state: StepState) -> None:
        """What ``action`` means for its stage."""
        if action.kind is Kind.FORWARD:
            self._forward(action, state)
        elif action.kind is Kind.BACKWARD:
            self._backward(action, state, split=False)
        elif action.kind is Kind.INPUT:
            self._backward(action, state, split=True)
        else:
            self.stages[action.stage].weight_one(action.microbatch, state)

    def _recv(self, kind: MessageKind, stage: int, microbatch: int, source: int) -> Any:
        position = self.positions[self.stage_ranks[stage]]
        rank = self.stage_ranks[source] if self.route is None else self.route(source, microbatch)
        position.awaiting(Awaited(kind, source, rank, stage, microbatch))
        if self.recorder is None:
            value = self.transport.recv(kind, stage, microbatch, source=source)
        else:
            with self.recorder.waiting():
                value = self.transport.recv(kind, stage, microbatch, source=source)
        position.arrived()
        return value

    def _send(self, kind: MessageKind, stage: int, microbatch: int, value: Any,
              source: int) -> None:
        if self.recorder is None:
            self.transport.send(kind, stage, microbatch, value, source=source)
            return
        with self.recorder.transferring():
            self.transport.send(kind, stage, microbatch, value, source=source)

    def _forward(self, action: Action, state: StepState) -> None:
        """Receives what the stage takes, has it run the micro-batch, sends what it made."""
        s, m = action.stage, action.microbatch
        received = {i: self._recv("activation", s, m, i) for i in self.schedule.forward_from(s)}
        messages = self.schedule.messages(action)
        sent = self.stages[s].forward_one(m, received, state,
                                          [message.destination for message in messages])
        for message in messages:
            value = sent[message.destination]
            if (s, message.destination) in self._no_gradient:
                check_no_gradient(value, s, message.destination)
            self._send("activation", message.destination, m, value, s)

    def _backward(self, action: Action, state: StepState, *, split: bool) -> None:
        """Receives the gradients of what the stage sent, has it back-propagate the
        micro-batch (``B``, or ``I`` when ``split``), sends its input's gradients back."""
        s, m = action.stage, action.microbatch
        came = {j: self._recv("gradient", s, m, j) for j in self.schedule.backward_from(s)}
        grads = self.stages[s].backward_one(m, came, state, split=split)
        for message in self.schedule.messages(action):  # to where the inputs came from
            self._send("gradient", message.destination, m, grads[message.destination], s)


@dataclass(frozen=True)
class _ThreadState:
    """Thread-local torch state of the caller that worker threads must share."""

    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def capture(cls, grad_enabled: bool) -> _ThreadState:
        autocast = tuple(
            (device_type, torch.get_autocast_dtype(device_type))
            for device_type in ("cuda", "cpu")
            if torch.is_autocast_enabled(device_type)
        )
        return cls(grad_enabled, autocast)

    @contextlib.contextmanager
    def applied(self, device: torch.device, cpu_threads: int) -> Iterator[None]:
        """Applies the state to this thread (a worker, or the caller), then restores it."""
        with contextlib.ExitStack() as stack:
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            elif device.type == "cpu":
                previous = torch.get_num_threads()
                torch.set_num_threads(cpu_threads)
                stack.callback(torch.set_num_threads, previous)
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield


#: Device types whose ranks in one process share one thread per device. A GPU runs
#: the kernels of every stage on it in one queue: threads would only contend for the
#: GIL and for the device's one autograd thread while launching them (measured on an
#: H100, 2 stages on one GPU in bf16: 1.8x the step time of 1). CPU stages compute
#: on the host itself, so each has a thread of its own.
SHARE_A_THREAD = frozenset({"cuda"})


def thread_devices(devices: Sequence[torch.device]) -> list[torch.device]:
    """The device of each thread that runs ranks on ``devices`` at once: a device of a
    type in :data:`SHARE_A_THREAD` counts once, every other rank's device once per rank
    (a device listed twice is used by two threads at once)."""
    return [d for i, d in enumerate(devices)
            if d.type not in SHARE_A_THREAD or d not in devices[:i]]


def device_lanes(columns: Mapping[int, Sequence[Action]], devices: Mapping[int, torch.device],
                 schedule: Schedule) -> dict[int, list[tuple[int, Action]]]:
    """The busy ranks grouped into lanes, one thread each: ranks on one device of a
    type in :data:`SHARE_A_THREAD` form one lane, every other rank a lane of its own.
    Keyed by each lane's first rank; a lane of several ranks interleaves their columns
    in the order of the table's clock (every action one tick, see
    ``conveyor.schedules.clock``), which runs each action after those it needs.
    """
    busy = [rank for rank, column in columns.items() if column]
    lead: dict[int, int] = {}
    for rank in busy:
        device = devices[rank]
        shares = [r for r in busy if devices[r] == device]
        lead[rank] = shares[0] if device.type in SHARE_A_THREAD else rank
    if len(set(lead.values())) == len(busy):  # a lane per rank: its column, in its order
        return {rank: [(rank, action) for action in columns[rank]] for rank in busy}
    lanes: dict[int, list[tuple[int, Action]]] = {lead[rank]: [] for rank in busy}
    for rank, action in clock_order(columns, schedule):
        lanes[lead[rank]].append((rank, action))
    return lanes
