"""Joining the job's process group, waited for at most a bound.

``dist.init_process_group`` under env:// or torchrun connects to the job's store
(``MASTER_ADDR:MASTER_PORT``; rank 0 hosts it under env://, torchrun's agent under
torchrun), exchanges addresses through it, and connects every pair of ranks. A store
port held by a program that accepts and never answers keeps a rank in there for as long
as it likes, whatever ``timeout=`` says (measured on torch 2.x: still waiting after 60 s
with ``timeout=5 s``). So the join runs on a thread of its own and the caller waits for
it at most ``seconds``; a failure (the port in use, the connection refused) or the
silence is one line that names the address, the rank and what did not answer::

    caller     join(20 s) ── waits ─────────── 20 s: RendezvousError, one line
    thread     init_process_group ── stuck in the store's socket (left; the process
                                     exits past it, see below)
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

from conveyor.errors import RendezvousError

__all__: list[str] = []

_stuck: list[threading.Thread] = []  # joins that never came back
#: Seconds (at most the join's own) a rank whose store answered gives a missing rank to
#: say why: processes start seconds apart on a loaded machine.
_LET_THE_CAUSE_SPEAK = 15.0


def address() -> str:
    """Where this process's rendezvous goes, as a person would look for it."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "env://"
    return (f"{where} ({launcher}, rank {os.environ.get('RANK', '?')} of "
            f"{os.environ.get('WORLD_SIZE', '?')})")


def join(backend: str, *, seconds: float, timeout: float) -> None:
    """``dist.init_process_group(backend)`` (env://), over within ``seconds``.

    Args:
        backend: "gloo" or "nccl".
        seconds: the most the join may take (the store's answer, every rank's arrival).
        timeout: the process group's own timeout for its collectives, in seconds.

    Raises:
        RendezvousError: the join failed or did not end in time; the process group
            does not exist.
    """
    failed: list[BaseException] = []

    def run() -> None:
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True, name="conveyor-rendezvous")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _stuck.append(thread)
        if not _store_answers(seconds=min(2.0, seconds)):
            raise RendezvousError(
                f"could not join the process group at {address()} within {seconds:g} s: the "
                "store there did not answer (a program that accepts and never replies holds "
                "the port?); check MASTER_ADDR and MASTER_PORT (a free port, the same for "
                "every rank)")
        # The store answers: another rank is missing. Its own error (a silent store, a
        # refusal) is the one to read: let it out first, as torchrun ends the others
        # when one rank exits. A rank that arrives meanwhile completes the join.
        deadline = time.monotonic() + min(seconds, _LET_THE_CAUSE_SPEAK)
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.1)
        if not thread.is_alive() and not failed:
            _stuck.remove(thread)
            return
        time.sleep(max(0.0, deadline - time.monotonic()))
        raise RendezvousError(
            f"could not join the process group at {address()} within {seconds:g} s: the "
            "store answered, but not every rank arrived; check that every rank was started "
            "(and the errors of the others)")
    if failed:
        raise RendezvousError(f"could not join the process group at {address()}: "
                              f"{_said(failed[0])}") from failed[0]


def _store_answers(*, seconds: float) -> bool:
    """Whether the job's store answers a client within ``seconds`` (a connection on a
    thread of its own: a silent listener would hold it past any timeout)."""
    answered: list[bool] = []

    def ask() -> None:
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=datetime.timedelta(seconds=seconds))
            store.check(["conveyor-probe"])
            answered.append(True)
        except Exception:  # noqa: BLE001 - no answer is the answer
            pass

    asking = threading.Thread(target=ask, daemon=True, name="conveyor-store-probe")
    asking.start()
    asking.join(seconds + 0.5)
    return bool(answered)


def _said(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "EADDRINUSE" in text or "address already in use" in text:
        return ("the store's port is in use by another program (EADDRINUSE); choose a free "
                "MASTER_PORT")
    if "ECONNREFUSED" in text or "refused" in text.lower():
        return "the connection to the store was refused (is rank 0 or torchrun's agent running?)"
    return f"{type(exc).__name__}: {text[:300]}"


@atexit.register
def _exit_past_a_stuck_join() -> None:
    """A join still inside the store's socket would hold the interpreter's exit: end the
    process now, with 1 (its error was printed)."""
    if any(thread.is_alive() for thread in _stuck):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
