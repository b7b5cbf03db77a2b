"""Tests that need an optional extra skip without it, but fail under ``make test``."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.extras import REQUIRE_EXTRAS, require


def test_an_installed_extra_is_imported() -> None:
    assert require("json") is json


def test_a_missing_extra_skips_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_EXTRAS, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"needs conveyor_no_such_extra: pip "
                                                    r"install 'conveyor\[all\]'"):
        require("conveyor_no_such_extra")


def test_a_missing_extra_fails_the_test_when_extras_are_required(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_EXTRAS, "1")
    with pytest.raises(pytest.fail.Exception, match=r"conveyor_no_such_extra is not "
                                                    r"installed, but CONVEYOR_REQUIRE_EXTRAS=1"):
        require("conveyor_no_such_extra")


def test_make_test_requires_the_extras() -> None:
    from pathlib import Path

    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    assert "PYTEST := $(BIN)/python -m pytest" in makefile
    assert re.search(rf"^test: .*\n\t{REQUIRE_EXTRAS}=1 \$\(PYTEST\)", makefile, re.M), \
        "make test runs the suite without requiring the extras"
