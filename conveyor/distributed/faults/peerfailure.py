"""The ``PeerFailure`` a rank raises when a peer fails, goes silent, or is gone.

Each carries a ``report`` (plain data) that the rank passes on to its own peers when it
stops, so that every rank names the same origin: the rank, what it was doing, and for a
silent peer how it went silent ("timeout": no answer in time; "closed": its connection
closed, the process died). A silent peer also breaks the transport: the reason returned
beside the failure is what a further step is refused with.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from conveyor.errors import NonFiniteLossError, PeerFailure

__all__: list[str] = []


def timed_out(exc: BaseException) -> bool:
    """Whether a wait's error says it ran out of time (not that the peer is gone)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def first_line(exc: BaseException) -> str:
    """``exc``'s first line; of gloo's, the words alone ("Connection closed by peer
    [127.0.0.1]:1727"), without its source location and advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if text.startswith("[") and "] " in text:  # "[.../gloo/.../pair.cc:553] Connection..."
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]


def reported(report: dict[str, Any], rank: int, stopped: str) -> PeerFailure:
    """The failure a peer reported, as rank ``rank`` raises it; ``stopped`` says where
    this rank stopped ("stopped waiting for ...", "stopped before its next action")."""
    failure = PeerFailure(f"{origin(report)}; rank {rank} {stopped}", stage=report["stage"],
                          microbatch=report["microbatch"], action=report["action"])
    failure.report = report
    return failure


def as_everywhere(error: BaseException) -> BaseException:
    """``error`` as this rank raises it: a peer's NonFiniteLossError (the step stopped
    before it reached the weights, a condition a training loop handles, not a fault)
    is raised as a NonFiniteLossError here too, naming the rank it came from."""
    report = getattr(error, "report", None) or {}
    prefix = "NonFiniteLossError: "
    if isinstance(error, PeerFailure) and str(report.get("error", "")).startswith(prefix):
        return NonFiniteLossError(f"{report['error'][len(prefix):]} (on rank "
                                  f"{report['rank']})")
    return error


def origin(report: dict[str, Any]) -> str:
    """The failure a rank reported, in words: "rank 1 failed in 1B0 (ValueError: ...)",
    or for a rank that went silent, "rank 1 went silent (no answer within 4 s)"."""
    if report.get("silent"):
        return f"rank {report['rank']} went silent ({report['error']})"
    action = report.get("action")
    doing = f" in {action}" if action and action != "?" and action not in report["error"] else ""
    return f"rank {report['rank']} failed{doing} ({report['error']})"


def wait_failed(exc: BaseException, rank: int, peer: int | None, what: str, seconds: float,
                step: int) -> tuple[PeerFailure, str]:
    """Rank ``rank``'s failure when its wait for ``what`` (from ``peer``; None: a send)
    ended in ``exc`` after ``seconds``, and why the transport refuses further steps.
    The message names the peer where it is known (a poll between receives waits for
    "a message", which does not)."""
    silent = "timeout" if timed_out(exc) else "closed"
    if silent == "timeout":
        reason = f"timed out after {seconds:g} s"
        if peer is not None and f"rank {peer}" not in what:
            what = f"{what} from rank {peer}"
    else:
        reason = f"lost its peer{'' if peer is None else f' rank {peer}'} ({first_line(exc)})"
    failure = PeerFailure(f"rank {rank} {reason} waiting for {what}; that rank may have "
                          "failed or be stuck", stage=-1, microbatch=-1, action="recv")
    if peer is not None:  # passed on to the other peers: who went silent, and how
        failure.report = _silent(peer, silent, f"no answer within {seconds:g} s"
                                 if silent == "timeout"
                                 else f"its connection closed: {first_line(exc)}")
    return failure, (f"step {step} lost a peer (rank {rank} {reason} waiting for {what}), so "
                     "this pipeline refuses further steps: restart the job (torchrun "
                     "--max-restarts restarts it)")


def collective_failed(exc: BaseException, rank: int, what: str, seconds: float,
                      members: list[int]) -> PeerFailure:
    """Rank ``rank``'s failure when its wait in the collective ``what`` over the
    global ranks ``members`` ended in ``exc`` after ``seconds`` (the rank that went
    silent is not known: ``report['rank']`` is None)."""
    silent = "timeout" if timed_out(exc) else "closed"
    reason = f"waited {seconds:g} s" if silent == "timeout" else f"lost a peer ({first_line(exc)})"
    failure = PeerFailure(f"rank {rank} {reason} in {what}: a rank of it failed, froze or "
                          "never came to it", stage=-1, microbatch=-1, action="collective")
    failure.report = {**_silent(None, silent, f"no answer in {what} within {seconds:g} s"
                                if silent == "timeout"
                                else f"a connection closed in {what}: {first_line(exc)}"),
                      "action": what, "members": members}
    return failure


def lost_peer(exc: BaseException, rank: int, peer: int, step: int, *,
              sending: bool = False) -> tuple[PeerFailure, str]:
    """Rank ``rank``'s failure when it cannot even post a receive from ``peer`` (at the
    start of ``step``) or a send to it (``sending``) because its connection closed, and
    why further steps are refused."""
    text = first_line(exc)
    doing = "as it sent to it" if sending else "before it could receive from it"
    failure = PeerFailure(f"rank {rank} lost its peer rank {peer} ({text}) {doing} in step "
                          f"{step}; that rank may have died", stage=-1, microbatch=-1,
                          action="send" if sending else "recv")
    failure.report = {**_silent(peer, "closed", f"its connection closed: {text}"), "step": step}
    return failure, (f"step {step} lost rank {peer} ({text}), so this pipeline refuses "
                     "further steps: restart the job")


def _silent(peer: int | None, how: str, error: str) -> dict[str, Any]:
    return {"rank": peer, "stage": -1, "microbatch": -1, "action": "?", "silent": how,
            "error": error}


_transports: weakref.WeakSet[Any] = weakref.WeakSet()
_hook: list[Any] = []  # the excepthook before ours


def tell_peers_on_uncaught(transport: Any) -> None:
    """Calls ``transport.abort_uncaught(error)`` when the script raises an error that
    nothing catches (between two steps: one raised in a step has told them already)."""
    _transports.add(transport)
    if sys.excepthook is not _tell_peers:
        _hook[:] = [sys.excepthook]
        sys.excepthook = _tell_peers


def _tell_peers(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    for transport in list(_transports):
        transport.abort_uncaught(error)
    _hook[0](kind, error, trace)
