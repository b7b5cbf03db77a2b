"""Fixtures shared by several test modules (models, launchers and scenarios are in
tests/support)."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a torchrun rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
