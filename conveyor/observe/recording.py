"""Recording what a pipeline does: every action's start and end, per rank.

::

    with conveyor.record(pipe) as timeline:
        pipe.step(inputs, targets)
    timeline.save_chrome_trace("step.json")          # open in Perfetto
    conveyor.plot_timelines([timeline], "step.png")

Off by default and free when off; see :mod:`conveyor.engine.recorder` for its cost.
The timeline carries the schedule's edges, so that pictures show their messages.
It counts the graphs torch.compile made in the process meanwhile
(``timeline.compiled_graphs``: a recompilation shows there). Under torchrun every rank
records its own actions; when the block ends, every rank gets
all the ranks' events, on clocks aligned by a barrier taken when recording began (both
bounded by the pipeline's opening deadline; the events cross as JSON).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from conveyor.distributed.faults import collective
from conveyor.engine.recorder import Recorder
from conveyor.schedules.timeline import Event, Timeline
from conveyor.torchprivate import compiled_graph_count

__all__ = ["record"]


@contextlib.contextmanager
def record(pipe: Any) -> Iterator[Timeline]:
    """Records every step of ``pipe`` (a GPipe or a Pipeline) run inside the block.

    Yields:
        A Timeline, filled when the block ends (under torchrun, with every rank's events).
    """
    executor = pipe.runtime.executor
    topology = getattr(pipe, "topology", None)
    group = topology.pipeline_group if topology is not None and topology.distributed else None
    device = (topology.device if topology is not None else None) or torch.device("cpu")
    if group is not None:  # the barrier
        collective.all_reduce(torch.zeros(1, device=device), group=group,
                              what="the barrier that starts a recording",
                              seconds=pipe.timeouts.opening)
    recorder = Recorder()
    schedule = executor.schedule
    replicas = topology.replicas if topology is not None else None
    row = None if topology is None or replicas is None else topology.pipeline_rank
    timeline = Timeline(num_ranks=len(set(executor.stage_ranks)) if replicas is None
                        else replicas.workers, source="measured",
                        name=schedule.name,
                        edges=[(e.source, e.destination, e.gradient) for e in schedule.edges])
    executor.recorder = recorder
    compiled_before = compiled_graph_count()
    failed = True
    try:
        yield timeline
        failed = False
    finally:
        timeline.compiled_graphs = compiled_graph_count() - compiled_before
        executor.recorder = None
        if pipe.runtime.executor.recorder is recorder:  # a re-balance gave the pipe a new executor
            pipe.runtime.executor.recorder = None
        # replicated stages: a row per process, numbered as simulate_replicas does
        events = [Event(r.rank if row is None else row,
                        r.action.stage, r.action.kind.value, r.action.microbatch,
                        r.start, r.end, wait=r.wait, transfer=r.transfer)
                  for r in recorder.records]
        if group is not None and not failed:  # after a failure a peer may be gone
            gathered = collective.exchange([dataclasses.asdict(e) for e in events], group=group,
                                           what="the gathering of the ranks' timelines",
                                           seconds=pipe.timeouts.opening, device=device)
            events = [Event(**e) for part in gathered for e in part]
        timeline.events = sorted(events, key=lambda e: (e.start, e.rank))
