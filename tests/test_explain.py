"""How a survivor names the rank that failed when what it saw itself names another:
a lost peer whose failure was announced in the store, a peer gone silent while the
store's host is silent too, a send to a peer that has exited, the store's host lost
while the ranks agree on their options. Pure functions of reports (and a stand-in
store); the launches that make these happen are tests/faults cases (env3, agents)."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.distributed.faults import agreement
from conveyor.distributed.faults.explain import (
    _follow_the_waits,
    _name_the_store_host,
    _notes,
    _read_the_notice,
)
from conveyor.distributed.faults.peerfailure import lost_peer, origin, reported, wait_failed
from conveyor.distributed.faults.store import StoreGone
from conveyor.errors import PeerFailure

TROUBLE = ("rank 0, whose process hosts the job's store, did not answer a call (check) "
           "within 3 s: frozen, overloaded or stuck")


def closed_by(peer: int, *, rank: int = 0, step: int = 3) -> PeerFailure:
    """What rank ``rank`` raises when ``peer``'s connection closed under its receive."""
    failure, _ = wait_failed(RuntimeError("[pair.cc:553] Connection closed by peer [x]:1"),
                             rank, peer, f"the activation of micro-batch 0 from rank {peer}",
                             4.0, step)
    return failure


def timed_out_on(peer: int, *, rank: int) -> PeerFailure:
    failure, _ = wait_failed(RuntimeError("Timed out waiting 4000ms for recv"), rank, peer,
                             f"the activation of micro-batch 0 from rank {peer}", 4.0, 3)
    return failure


def announced(rank: int) -> dict[str, Any]:
    return {"rank": rank, "error": "ValueError: planted failure in between", "stage": -1,
            "microbatch": -1, "action": "between steps"}


def test_a_lost_peer_names_the_failure_it_announced_before_leaving() -> None:
    # Rank 1 raised between steps; its abort report was lost as it exited, but its
    # notice was in the store: rank 0, which saw only a closed connection, names it.
    error = closed_by(1)
    _read_the_notice(error, announced(1), rank=0)
    first = str(error).splitlines()[0]
    assert first.startswith("rank 1 failed in between steps (ValueError: planted failure "
                            "in between); then rank 0 lost its peer")
    assert error.report == announced(1) and error.action == "between steps"


def test_a_notice_that_is_silent_or_this_ranks_own_changes_nothing() -> None:
    for notice in (None, {**announced(2), "silent": "closed"}, announced(0)):
        error = closed_by(1)
        before = str(error)
        _read_the_notice(error, notice, rank=0)
        assert str(error) == before and error.report is not None
        assert error.report["rank"] == 1


def waiting_for(source: int) -> dict[str, Any]:
    """A snapshot of a rank stopped in 1F0 after waiting for ``source``'s activation."""
    return {"state": "stopped", "action": "1F0", "seconds": 4.1, "awaited": {
        "kind": "activation", "source": "stage 0", "source_rank": source, "stage": 0,
        "microbatch": 0}}


def test_a_connection_closed_by_a_peer_that_cut_its_own_wait_names_where_it_waited() -> None:
    # gloo: rank 1's wait for rank 0 (stuck computing) was cut, which closed rank 1's
    # connections under rank 2's receive; rank 1 answered the gather, so it did not die.
    stuck = {"state": "running", "action": "0F0", "seconds": 4.5, "awaited": None}
    error = closed_by(1, rank=2)
    _follow_the_waits(error, {0: stuck, 1: waiting_for(0), 2: None}, rank=2)
    first = str(error).splitlines()[0]
    assert first.startswith("rank 2 lost its peer rank 1 (Connection closed by peer")
    assert first.endswith("rank 1, which waited for rank 0, which is in 0F0, running for 4.5 s")
    assert error.report is not None and error.report["rank"] == 0
    assert error.report["silent"] == "timeout"  # rank 0 is stuck, not gone


def test_a_chain_that_ends_at_a_rank_still_in_the_last_step_says_it_has_not_begun() -> None:
    # Rank 2 looped between steps: it answers with its place at the end of step 2.
    between = {"state": "collective", "action": None, "seconds": 4.9, "awaited": None,
               "step": 2, "collective": "the agreement that a step's gradients are finite"}
    error = timed_out_on(1, rank=0)
    _follow_the_waits(error, {0: None, 1: {**waiting_for(2), "step": 3}, 2: between}, rank=0)
    assert str(error).splitlines()[0].endswith(
        "rank 1, which waited for rank 2, which finished its actions of step 2 and has not "
        "begun step 3")


def test_a_connection_closed_by_a_peer_that_did_not_answer_names_that_peer() -> None:
    error = closed_by(1, rank=2)  # rank 1 died: its snapshot is not there
    before = str(error)
    _follow_the_waits(error, {0: None, 1: None, 2: None}, rank=2)
    assert str(error) == before and error.report is not None and error.report["rank"] == 1


def test_a_silent_store_host_is_named_over_the_neighbour_that_waited_on_it() -> None:
    # env:// with 3 ranks, rank 0 (the store's host) frozen: rank 2 times out on rank 1,
    # which waits on rank 0; the store cannot say so, but its silence names its host.
    error = timed_out_on(1, rank=2)
    _name_the_store_host(error, hosting=0, trouble=TROUBLE, rank=2)
    first = str(error).splitlines()[0]
    assert error.report is not None and error.report["rank"] == 0
    assert first.endswith(f"{TROUBLE}, and rank 1 most likely waited on it")


def test_the_store_host_is_not_named_without_trouble_or_by_itself() -> None:
    for hosting, trouble, rank in ((0, None, 2), (None, TROUBLE, 2), (2, TROUBLE, 2),
                                   (1, TROUBLE, 2)):
        error = timed_out_on(1, rank=rank)
        before = str(error)
        _name_the_store_host(error, hosting=hosting, trouble=trouble, rank=rank)
        assert str(error) == before  # (1, ...): the silent peer is the host already


def test_with_a_silent_store_a_rank_that_did_not_answer_is_not_called_frozen() -> None:
    snapshots: dict[int, Any] = {0: None, 1: None, 2: None}
    report = timed_out_on(1, rank=2).report
    assert report is not None
    unknown = _notes(snapshots, report, 4.0, unknown=True)
    assert unknown[1] == unknown[0] == "not known: the job's store did not answer"
    known = _notes(snapshots, report, 4.0, unknown=False)
    assert known[1].startswith("did not answer: frozen")


def test_a_wait_for_a_message_whose_peer_closed_names_that_peer() -> None:
    """Fault case "replicas, kill in forward, later phase, rank 1", run beside another
    case: rank 2 was moving rank 1's message on between receives (waiting for "a
    message") when rank 1's connection closed, and said only that it lost its peer."""
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8331")
    failure, broken = wait_failed(closed, 2, 1, "a message", 4.0, 3)
    assert str(failure).startswith("rank 2 lost its peer rank 1 (Connection closed by peer")
    assert failure.report is not None and failure.report["rank"] == 1
    late = RuntimeError("Timed out waiting 4000ms for recv operation to complete")
    assert "waiting for a message from rank 1;" in str(wait_failed(late, 2, 1, "a message",
                                                                    4.0, 3)[0])
    named = "the activation of micro-batch 0 from stage 0 (rank 1)"
    assert str(wait_failed(late, 2, 1, named, 4.0, 3)[0]).count("rank 1") == 1
    assert "lost its peer (" in str(wait_failed(closed, 2, None, "a send", 4.0, 3)[0])


def test_a_send_to_a_peer_that_exited_is_a_peer_failure_naming_it() -> None:
    failure, broken = lost_peer(RuntimeError("[pair.cc:589] Connection closed by peer [x]:2"),
                                1, 0, 3, sending=True)
    assert isinstance(failure, PeerFailure) and failure.action == "send"
    assert str(failure).startswith("rank 1 lost its peer rank 0 (Connection closed by peer "
                                   "[x]:2) as it sent to it in step 3")
    assert failure.report is not None and failure.report["rank"] == 0
    assert "refuses further steps" in broken


def test_a_passed_on_silence_reads_as_silence_not_as_a_failure() -> None:
    silent = timed_out_on(0, rank=1).report
    assert silent is not None
    assert origin(silent) == "rank 0 went silent (no answer within 4 s)"
    assert str(reported(silent, 2, "stopped waiting")).startswith("rank 0 went silent")
    assert origin(announced(1)) == ("rank 1 failed in between steps (ValueError: planted "
                                    "failure in between)")


def test_a_store_host_lost_while_the_ranks_agree_is_a_peer_failure_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by the second whole run of make faults (case 250): rank 0, the store's host
    # under env://, was killed in its first step while rank 1 still read the others'
    # options; rank 1 raised a ConfigError, as if the options had differed.
    class GoneStore:
        available = True

        def set(self, key: str, value: bytes) -> None:
            raise StoreGone("rank 0, whose process hosts the job's store, is gone (set: "
                            "Broken pipe): the process died")

        def close(self) -> None:
            pass

    monkeypatch.setattr(agreement, "BoundedStore", GoneStore)
    monkeypatch.setattr(agreement.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda: 3)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(PeerFailure, match="rank 1 could not compare .*rank 0, whose process "
                                          "hosts the job's store, is gone") as caught:
        agreement.agree({"chunks": 4})
    assert caught.value.report is not None and caught.value.report["rank"] == 0
