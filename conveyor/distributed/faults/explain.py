"""A failed step's error, explained under torchrun: where every rank of the pipeline stood.

When a step fails on a rank (its own error, a peer's report, a timeout), the rank
publishes its place and gathers the others' through the store
(:mod:`conveyor.distributed.faults.whereabouts`), then gives the error the report
(:mod:`conveyor.engine.watchdog.hangreport`) as ``where`` and as a note: every surviving rank
prints the same merged view. A peer that went silent (it timed out, or its connection
closed) also leaves the transport refusing further steps: the job must restart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.distributed.p2p import P2PTransport
from conveyor.distributed.topology import Topology
from conveyor.distributed.faults.peerfailure import origin
from conveyor.distributed.faults.store import outlive_peers_at_exit
from conveyor.distributed.faults.whereabouts import Whereabouts
from conveyor.engine.executor import Executor
from conveyor.engine.watchdog.hangreport import render_report
from conveyor.engine.watchdog.position import (
    COLLECTIVE,
    FAILED,
    RUNNING,
    STOPPED,
    WAITING,
    describe,
)
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
    if not isinstance(error, PeerFailure):  # this rank's own failure: say so first
        whereabouts.announce(transport.step, own_report(error, rank))
    position = executor.positions.get(transport.topology.table_rank)
    if position is not None and position.state == COLLECTIVE:  # it failed in one
        position.failed(elsewhere=isinstance(error, PeerFailure))
    report = getattr(error, "report", None) or {}
    silent = ({report["rank"]} if report.get("silent") and report.get("rank") is not None
              else set())
    if report.get("silent"):
        transport.broken = transport.broken or (
            f"step {executor.runs} lost a peer ({report['error']}), so this pipeline "
            "refuses further steps: restart the job")
    if report.get("silent") and isinstance(error, PeerFailure):
        _read_the_notice(error, whereabouts.notice(transport.step), rank)
        report = error.report or report
    if report.get("step", executor.runs) > executor.runs:  # before any action of the step
        attach_report(error, f"step {report['step']} did not start: rank {rank} lost rank "
                             f"{report['rank']} between steps ({report['error']})")
        return
    snapshots = whereabouts.gather(executor.runs, GATHER, silent)
    notes = _notes(snapshots, report, executor.deadlines.within,
                   unknown=whereabouts.store_trouble is not None)
    hosting = _store_host(whereabouts, transport)
    if whereabouts.store_trouble is not None and hosting is not None \
            and snapshots.get(hosting) is None:
        notes[hosting] = ("did not answer, nor did the job's store it hosts: " + (
            "the process died" if "is gone" in whereabouts.store_trouble
            else "frozen, or stuck outside Python"))
    if isinstance(error, PeerFailure):
        _name_the_store_host(error, hosting, whereabouts.store_trouble, rank)
        _name_the_silent(error, snapshots, hosting, whereabouts.store_trouble)
        _name_the_absent(error, snapshots, transport, rank)
        _follow_the_waits(error, snapshots, rank)
    replicas = transport.replicas  # replicated stages: a row per process
    table = executor.schedule if replicas is None else replicas.table(executor.schedule)
    attach_report(error, render_report(table, executor.kinds, snapshots, notes,
                                       place=mesh_place(transport.topology)))
    if hosting == rank:
        outlive_peers_at_exit(GATHER + 1.0)


def mesh_place(topology: Topology) -> str:
    """Which pipeline of a (pipeline, data, tensor) mesh ``topology``'s is, for a
    report's first line: ``; data replica 1, tensor rank 0: global ranks 2, 6`` ("" for
    the only pipeline)."""
    coordinates = [f"{what} {rank}" for what, rank, size in (
        ("data replica", topology.data_rank, topology.data_size),
        ("tensor rank", topology.tensor_rank, topology.tensor_size)) if size > 1]
    if not coordinates:
        return ""
    return (f"; {', '.join(coordinates)}: global ranks "
            f"{', '.join(map(str, topology.pipeline_ranks))}")


def own_report(error: BaseException, rank: int) -> dict[str, Any]:
    """``error``, raised by this rank, as the report its peers name it by."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return {"rank": rank, "error": text, "stage": getattr(error, "stage", -1),
            "microbatch": getattr(error, "microbatch", -1),
            "action": getattr(error, "action", "?")}


def _store_host(whereabouts: Whereabouts, transport: P2PTransport) -> int | None:
    """The pipeline rank whose process hosts the job's store, if one of this pipeline's."""
    host = whereabouts.store_host()
    ranks = [r for r in range(transport.topology.pipeline_size)
             if transport.topology.global_rank(r) == host]
    return ranks[0] if ranks else None


def _read_the_notice(error: PeerFailure, notice: dict[str, Any] | None, rank: int) -> None:
    """A rank that lost a peer (its connection closed, or it went silent) names the
    failure a rank announced in the step, if one did: its abort report may have been
    lost as its process exited, but the notice was posted first."""
    if notice is None or notice.get("silent") or notice.get("rank") in (None, rank):
        return
    _retitle(error, lambda first: f"{origin(notice)}; then {first}")
    error.report = notice
    error.stage, error.microbatch, error.action = (notice["stage"], notice["microbatch"],
                                                   notice["action"])


def _name_the_store_host(error: PeerFailure, hosting: int | None, trouble: str | None,
                         rank: int) -> None:
    """A rank that lost a peer while the store's host did not answer either (frozen or
    dead: the store cannot tell what the peer was doing) names the host, on which the
    peer most likely waited: the store is what the host cannot hide."""
    report = error.report
    if report is None or trouble is None or hosting is None or hosting == rank \
            or not report.get("silent") or report.get("rank") in (None, hosting):
        return
    waited, report["rank"] = report["rank"], hosting
    _retitle(error, lambda first: f"{first}: {trouble}, and rank {waited} most likely "
                                  "waited on it")


def _follow_the_waits(error: PeerFailure, snapshots: dict[int, Any], rank: int) -> None:
    """A rank that timed out waiting for a peer which was itself waiting (for a third,
    stuck or frozen) names the rank at the end of the chain, where the step stopped.
    So does one whose connection to a peer closed while that peer, alive (it answered),
    was waiting: on gloo the peer cut its own wait, which closes its connections."""
    report = error.report
    if report is None or report.get("rank") is None or not (
            report.get("silent") == "timeout"
            or report.get("silent") == "closed" and snapshots.get(report["rank"])):
        return
    chain, peer = [report["rank"]], report["rank"]
    while True:
        snapshot = snapshots.get(peer) or {}
        awaited = snapshot.get("awaited")
        if not awaited or snapshot["state"] not in (WAITING, STOPPED) \
                or awaited["source_rank"] in chain or awaited["source_rank"] == rank:
            break
        peer = awaited["source_rank"]
        chain.append(peer)
    if len(chain) == 1:
        return
    end, step = snapshots.get(peer), snapshots[chain[-2]].get("step")
    if end is None:
        how = "did not answer: frozen, dead, or stuck outside Python"
    elif step is not None and end.get("step", step) < step:  # it answered from the last
        how = f"finished its actions of step {end['step']} and has not begun step {step}"
    elif end["action"]:
        how = f"is in {end['action']}, {end['state']} for {end['seconds']:.1f} s"
    else:
        how = f"is {end['state']}"
    report["rank"], report["silent"] = peer, "timeout"  # the end went silent, it did not close
    waits = ", which waited for ".join(f"rank {r}" for r in chain)
    _retitle(error, lambda first: f"{first}: {waits}, which {how}")


def _name_the_silent(error: PeerFailure, snapshots: dict[int, Any], hosting: int | None,
                     trouble: str | None) -> None:
    """A failure that could not name the rank it lost (a collective's) names the one
    that did not answer the gather: the store's host first, if the store went silent."""
    report = error.report
    if report is None or report.get("rank") is not None:
        return
    silent = [r for r, snapshot in snapshots.items() if snapshot is None]
    if trouble is not None and hosting is not None:
        silent = [hosting] + [r for r in silent if r != hosting]
    if not silent:
        return
    report["rank"] = silent[0]
    how = ("the process died" if report.get("silent") == "closed"
           else "frozen, dead, or stuck outside Python")
    named = (trouble if trouble is not None and silent[0] == hosting
             else f"rank {silent[0]} did not answer ({how})")
    _retitle(error, lambda first: f"{first}: {named}")


def _name_the_absent(error: PeerFailure, snapshots: dict[int, Any], transport: P2PTransport,
                     rank: int) -> None:
    """A collective that timed out with every rank answering the gather names a rank
    of its group that is not in it (computing, or stuck in Python before joining)."""
    report = error.report
    if report is None or report.get("rank") is not None or "members" not in report:
        return
    topology = transport.topology
    what = report["action"]
    absent = [r for r in range(topology.pipeline_size)
              if topology.global_rank(r) in report["members"] and r != rank
              and snapshots.get(r) is not None and snapshots[r]["collective"] != what]
    if not absent:
        return
    report["rank"] = absent[0]
    _retitle(error, lambda first: f"{first}: rank {absent[0]} never came to it "
                                  f"({describe(snapshots[absent[0]])})")


def _retitle(error: PeerFailure, first: Callable[[str], str]) -> None:
    """Replaces the first line of ``error``'s message with ``first(that line)``."""
    line, _, rest = str(error).partition("\n")
    error.args = (first(line) + (f"\n{rest}" if rest else ""),)


def _notes(snapshots: dict[int, Any], report: dict[str, Any], limit: float, *,
           unknown: bool) -> dict[int, str]:
    """What a gathered report says beside each rank: who failed, who went silent
    (``unknown``: the store did not answer, so a rank's silence tells nothing)."""
    notes: dict[int, str] = {}
    for rank, snapshot in snapshots.items():
        if snapshot is None:
            closed = report.get("silent") == "closed" and report.get("rank") == rank
            notes[rank] = ("its connection closed: the process died" if closed
                           else "not known: the job's store did not answer" if unknown
                           else "did not answer: frozen, dead, or stuck outside Python")
        elif snapshot["state"] == FAILED:
            notes[rank] = "failed here"
        elif snapshot["state"] == STOPPED and report.get("silent") and snapshot["awaited"]:
            notes[rank] = "timed out" if report["silent"] == "timeout" else "stopped"
        elif snapshot["state"] == RUNNING and snapshot["seconds"] > limit:
            notes[rank] = "stuck"
    origin = report.get("rank")
    if origin in snapshots and snapshots[origin] is not None and not report.get("silent"):
        notes[origin] = "failed here"
    return notes
