"""Optional extras (scikit-learn): a test skips without one, except under ``make test``."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

#: Set by ``make test``, which installs every extra: there a missing one is a failure.
REQUIRE_EXTRAS = "CONVEYOR_REQUIRE_EXTRAS"


def require(module: str) -> ModuleType:
    """Imports ``module`` for a test; without it the test skips, or fails when
    CONVEYOR_REQUIRE_EXTRAS=1 (a skip would hide a broken install)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        error = exc
    if os.environ.get(REQUIRE_EXTRAS) == "1":
        pytest.fail(f"{module} is not installed, but {REQUIRE_EXTRAS}=1 says every extra "
                    f"must be (make test installs them: pip install -e '.[dev,all]'): {error}",
                    pytrace=False)
    pytest.skip(f"needs {module}: pip install 'conveyor[all]'")
