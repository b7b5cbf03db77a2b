"""The torch versions conveyor claims are the ones it runs on: one floor, in
``conveyor/torchprivate.py``, ``pyproject.toml`` and the docs, and a clear refusal of an
older torch at import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conveyor.torchprivate import MINIMUM

ROOT = Path(__file__).resolve().parents[1]


def _import_under(version: str, untested: bool) -> subprocess.CompletedProcess[str]:
    code = ("import torch\n"
            f"torch.__version__ = torch.torch_version.TorchVersion({version!r})\n"
            "import conveyor\n"
            "conveyor.Pipeline\n")
    env = {**os.environ, "CONVEYOR_UNTESTED_TORCH": "1" if untested else ""}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=env)


def test_an_older_torch_is_refused_at_import_naming_the_floor() -> None:
    done = _import_under("2.10.0", untested=False)
    assert done.returncode != 0
    assert (f"ImportError: conveyor needs torch {MINIMUM} or newer, the oldest its tests "
            f"pass on; this is torch 2.10.0. Upgrade it: pip install 'torch>={MINIMUM}' (or "
            "set CONVEYOR_UNTESTED_TORCH=1 to run on this torch untested)") in done.stderr


def test_an_older_torch_runs_untested_when_asked_with_a_warning() -> None:
    done = _import_under("2.10.0", untested=True)
    assert done.returncode == 0, done.stderr
    assert f"conveyor runs on torch 2.10.0, older than {MINIMUM}" in done.stderr


def test_the_floor_is_the_same_in_the_package_and_its_docs() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'dependencies = ["torch>={MINIMUM}"]' in pyproject
    readme = (ROOT / "README.md").read_text()
    assert f"torch >= {MINIMUM}" in readme
    table = (ROOT / "docs" / "contributing.md").read_text()
    assert re.search(rf"^\| {re.escape(MINIMUM)}\.\d+ .*\| passes", table, re.MULTILINE), \
        "the floor's own row in the table of versions run says it passes"
