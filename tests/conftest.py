"""Fixtures shared by several test modules (models, launchers and scenarios are in
tests/support)."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a torchrun rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


#: ``make test-all`` sets it: the long tests run too (``make test`` and CI leave them out).
WHOLE_SUITE = "CONVEYOR_WHOLE_SUITE"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leaves out the tests marked ``long`` unless CONVEYOR_WHOLE_SUITE=1: each repeats,
    at greater cost, what a test that runs in CI checks (another launcher, more seeds, a
    larger sample); ``make test-all`` runs them all."""
    if os.environ.get(WHOLE_SUITE) == "1":
        return
    long = [item for item in items if item.get_closest_marker("long")]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if not item.get_closest_marker("long")]
        config.stash[_LEFT_OUT] = len(long)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} long tests left out (marked long): "
                                    "make test-all runs them")
