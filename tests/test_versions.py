"""The torch versions conveyor claims are the ones it runs on: one floor, in
``conveyor/torchprivate.py``, ``pyproject.toml`` and the docs, and a clear refusal of an
older torch at import."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conveyor.torchprivate import MINIMUM

ROOT = Path(__file__).resolve().parents[1]


def test_an_older_torch_is_refused_at_import_naming_the_floor() -> None:
    code = ("import torch\n"
            "torch.__version__ = torch.torch_version.TorchVersion('2.4.1')\n"
            "import conveyor\n"
            "conveyor.Pipeline\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode != 0
    assert (f"ImportError: conveyor needs torch {MINIMUM} or newer; this is torch 2.4.1. "
            f"Upgrade it: pip install 'torch>={MINIMUM}'") in done.stderr


def test_the_floor_is_the_same_in_the_package_and_its_docs() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'dependencies = ["torch>={MINIMUM}"]' in pyproject
    readme = (ROOT / "README.md").read_text()
    assert f"torch >= {MINIMUM}" in readme
    table = (ROOT / "docs" / "contributing.md").read_text()
    assert re.search(rf"\| {re.escape(MINIMUM)}\.\d+ \(CUDA build, on the CPU\) \|.*\| passes",
                     table), "the floor's own row in the table of versions run says it passes"
