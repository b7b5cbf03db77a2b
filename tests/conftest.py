"""Fixtures shared by several test modules (models, launchers and scenarios are in
tests/support)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tests.support.tiers import is_listed, listed, whole_suite


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a torchrun rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leaves out the long tests (tests/support/tiers.py) unless CONVEYOR_WHOLE_SUITE=1
    (``make test-all``)."""
    if whole_suite():
        return
    patterns = listed()
    long = [item for item in items
            if item.get_closest_marker("long") or is_listed(item.nodeid, patterns)]
    if long:
        config.hook.pytest_deselected(items=long)
        chosen = set(map(id, long))
        items[:] = [item for item in items if id(item) not in chosen]
        config.stash[_LEFT_OUT] = len(long)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, a worker tells the controller how many it left out."""
    to_controller = getattr(session.config, "workeroutput", None)
    if to_controller is not None:
        to_controller["long_left_out"] = session.config.stash.get(_LEFT_OUT, 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist's controller hears from a worker (each collected the same tests)."""
    left_out = getattr(node, "workeroutput", {}).get("long_left_out")
    if left_out is not None:
        node.config.stash[_LEFT_OUT] = left_out


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} long tests left out (tests/long_tests.txt, "
                                    "marked long): make test-all runs them")
