"""Every code block of the README and the documentation site runs, or says why not.

* ``python`` blocks run, page by page, in the page's order and in one namespace per page
  (a later block may use what an earlier one made), in an empty folder, on the CPU. A
  block whose first line is ``# torchrun --nproc-per-node N NAME.py`` is that script:
  it is written to NAME.py and launched so (``--standalone``: a free port), and every
  process must exit 0.
* Shell blocks: their ``conveyor ...`` commands run in tests/test_readme_cli.py; every
  other command must be one of ``SHELL`` below, each with where it runs instead or why
  it cannot run here, so a new kind of command fails until it is placed.
* ``json`` blocks parse; ``text`` blocks are output. No other language is allowed.
* The site builds with ``mkdocs build --strict`` (``make docs``; CI runs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.docs import ROOT, Block, blocks, pages

#: Commands of shell blocks that are not ``conveyor ...``: a pattern, and where it runs
#: or why it does not run here.
SHELL = {
    r"make (demo|train|test|test-all|docs|bench|faults|chaos|fuzz|zoo|typecheck)( .*)?":
        "the Makefile's targets: .ci/run runs make test and make docs",
    r"make test-torch( .*)?": "the suite on another torch: by hand before a release, as "
                              "its CUDA wheels are several GB",
    r"pip install .*": "installation: what make does on a fresh machine",
    r"git clone .*|cd conveyor": "getting the code",
    r"(PYTHONPATH=\. |\.venv/bin/)?python -m (tests\.[\w.]+|conveyor)( .*)?":
        "the generators' and the package's entry points, run by their own tests",
    r"(PYTHONPATH=\. )?python (examples|benchmarks)/\w+\.py( .*)?":
        "the examples (tests/test_examples.py) and benchmarks (make bench)",
    r"torchrun .*": "a launch: the scripts it names are this page's torchrun blocks, "
                    "and tests/test_torchrun*.py launch conveyor train so",
    r"(srun|sbatch) .*|#SBATCH .*|export \w+=.*": "SLURM: no cluster here",
    r"mkdocs (serve|build)( .*)?": "make docs",
}
LANGUAGES = {"python", "", "bash", "sh", "console", "json", "text"}
TORCHRUN = re.compile(r"# torchrun --nproc-per-node (\d+) (\w+\.py)")


def _python_pages() -> list[Path]:
    return [page for page in pages() if any(b.language == "python" for b in blocks(page))]


def test_every_block_is_of_a_known_language() -> None:
    odd = [f"{b.where} ({b.language})" for page in pages() for b in blocks(page)
           if b.language not in LANGUAGES]
    assert not odd, f"blocks in a language no test runs: {odd}"


def _commands(block: Block) -> list[str]:
    """A shell block's commands (a ``$`` block's: the prompted lines; continuation
    lines joined, comments dropped)."""
    prompted = any(line.startswith("$ ") for line in block.lines)
    commands, pending = [], ""
    for line in block.lines:
        if prompted and not line.startswith("$ ") and not pending:
            continue  # output
        text = line.removeprefix("$ ") if not pending else line
        if not pending and (not text.strip() or text.lstrip().startswith("#!")):
            continue
        if not pending and text.lstrip().startswith("#") and \
                not text.lstrip().startswith("#SBATCH"):
            continue
        pending += " " + text.strip().removesuffix("\\")
        if not text.rstrip().endswith("\\"):
            commands.append(re.sub(r"\s+#(?!SBATCH).*$", "", pending.strip()))
            pending = ""
    return commands


def test_every_shell_command_runs_somewhere() -> None:
    unknown = []
    for page in pages():
        for block in blocks(page):
            if block.language not in ("", "bash", "sh", "console"):
                continue
            for command in _commands(block):
                if command.startswith("conveyor ") or any(
                        re.fullmatch(pattern, command) for pattern in SHELL):
                    continue
                unknown.append(f"{block.where}: {command}")
    assert not unknown, "commands no test runs and SHELL does not explain:\n" + \
        "\n".join(unknown)


def test_json_blocks_parse() -> None:
    for page in pages():
        for block in blocks(page):
            if block.language == "json":
                json.loads(block.code)


@pytest.mark.timeout(300)  # a page's blocks together (the README's train two models)
@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks(page):
        if block.language != "python":
            continue
        launch = TORCHRUN.match(block.lines[0])
        if launch:
            _launch(block, int(launch.group(1)), launch.group(2), tmp_path)
            continue
        try:
            exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102
        except Exception as exc:
            raise AssertionError(f"the block at {block.where} fails: {exc!r}") from exc
    capsys.readouterr()


def _launch(block: Block, processes: int, script: str, folder: Path) -> None:
    (folder / script).write_text(block.code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={processes}", script], cwd=folder, env=env,
        capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, f"{block.where}: torchrun exited {result.returncode}\n" \
        f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None
                    and os.environ.get("CONVEYOR_REQUIRE_EXTRAS") != "1",
                    reason="mkdocs is not installed (the docs extra)")
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-6000:]
