"""A failed step's error, explained under torchrun: where every rank of the pipeline stood.

When a step fails on a rank (its own error, a peer's report, a timeout), the rank
publishes its place and gathers the others' through the store
(:mod:`conveyor.distributed.whereabouts`), then gives the error the report
(:mod:`conveyor.engine.watchdog.hangreport`) as ``where`` and as a note: every surviving rank
prints the same merged view. A peer that went silent (it timed out, or its connection
closed) also leaves the transport refusing further steps: the job must restart.
"""

from __future__ import annotations

from typing import Any

from conveyor.distributed.p2p import P2PTransport
from conveyor.distributed.whereabouts import Whereabouts
from conveyor.engine.executor import Executor
from conveyor.engine.watchdog.hangreport import render_report
from conveyor.engine.watchdog.position import COLLECTIVE, FAILED, RUNNING, STOPPED
from conveyor.engine.watchdog.threads import attach_report
from conveyor.errors import PeerFailure

__all__: list[str] = []

GATHER = 3.0  # seconds a failed rank waits for the others' places


def explain(error: BaseException, executor: Executor, whereabouts: Whereabouts,
            transport: P2PTransport, rank: int) -> None:
    """Gives ``error``, raised by this rank's step, the report of every rank's place
    (once); a silent peer leaves ``transport`` broken."""
    if getattr(error, "where", None) is not None:
        return
    position = executor.positions.get(rank)
    if position is not None and position.state == COLLECTIVE:  # it failed in one
        position.failed(elsewhere=isinstance(error, PeerFailure))
    report = getattr(error, "report", None) or {}
    silent = ({report["rank"]} if report.get("silent") and report.get("rank") is not None
              else set())
    if report.get("silent"):
        transport.broken = transport.broken or (
            f"step {executor.runs} lost a peer ({report['error']}), so this pipeline "
            "refuses further steps: restart the job")
    if report.get("step", executor.runs) > executor.runs:  # before any action of the step
        attach_report(error, f"step {report['step']} did not start: rank {rank} lost rank "
                             f"{report['rank']} between steps ({report['error']})")
        return
    snapshots = whereabouts.gather(executor.runs, GATHER, silent)
    notes = _notes(snapshots, report, executor.deadlines.within)
    attach_report(error, render_report(executor.schedule, executor.kinds, snapshots, notes))


def _notes(snapshots: dict[int, Any], report: dict[str, Any], limit: float) -> dict[int, str]:
    """What a gathered report says beside each rank: who failed, who went silent."""
    notes: dict[int, str] = {}
    for rank, snapshot in snapshots.items():
        if snapshot is None:
            closed = report.get("silent") == "closed" and report.get("rank") == rank
            notes[rank] = ("its connection closed: the process died" if closed
                           else "did not answer: frozen, dead, or stuck outside Python")
        elif snapshot["state"] == FAILED:
            notes[rank] = "failed here"
        elif snapshot["state"] == STOPPED and report.get("silent") and snapshot["awaited"]:
            notes[rank] = "timed out"
        elif snapshot["state"] == RUNNING and snapshot["seconds"] > limit:
            notes[rank] = "stuck"
    origin = report.get("rank")
    if origin in snapshots and snapshots[origin] is not None and not report.get("silent"):
        notes[origin] = "failed here"
    return notes
