"""Every command works from its help and from the documentation: each sub-command prints
its ``--help``, and every example of the command-line blocks of the README and the site's
pages (lines that start with ``conveyor `` or ``$ conveyor ``) runs in-process through
``conveyor.cli.main.main``, in the pages' order (tests/support/docs.py), in one empty
folder; a ``$`` example's output lines are compared with the page's (``...`` stands for
any text). Examples that would run for minutes get
small sizes added (``_SMALLER``), placeholders a real function (``_REAL``); what one
cannot run here is listed with why (``_NOT_RUN``), and what takes long runs only with
``CONVEYOR_README_SLOW=1`` (``_SLOW``, a visible skip): a new example fails until it runs."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor.cli.main import build_parser, main
from tests.support.docs import ROOT, blocks, pages
from tests.support.user_data import corpus_folder, llama_folder


# The first training run of the README, made small: width 128 stays, as a later
# example's output names the checkpoint's (256, 128) embedding.
_SMALLER = {"conveyor train": ["--steps", "1", "--layers", "1", "--length", "16",
                               "--batch", "8", "--chunks", "2", "--eval-every", "1",
                               "--eval-batches", "1", "--sample-bytes", "0"]}
# A plan of one's own model checks its best schedule (tested in test_plan_model.py).
_SMALLER["conveyor plan --model mypkg.models:build --stages 4 --memory 80GiB"] = [
    "--no-verify"]
_REAL = {"mypkg.models:build": "tests.support.user_models:ladder"}
# The user's model directory and corpus (made in the test's folder: _user_files).
_SMALLER["conveyor train --model path/to/llama --data corpus/ --length 512 --out runs/llama "
         "--export trained/"] = [
    "--steps", "1", "--batch", "8", "--chunks", "2", "--eval-every", "1", "--eval-batches",
    "1", "--sample-bytes", "0"]
# Run by `CONVEYOR_README_SLOW=1 pytest tests/test_readme_cli.py`, skipped (visibly) in CI.
_SLOW = {
    "conveyor plan --model tests.support.user_models:llama_on_meta --stages 2 --batch 32 "
    "--memory 1GiB": "traces a Llama at length 512 (10-30 s; length 16 in test_plan_model)",
    "conveyor plan --model transformer --layers 48 --d-model 2048 --d-ff 8192 --devices 8 "
    "--memory 16GiB --optimizer rmsprop": "searches the largest model that fits (8 s)",
    "conveyor plan --model examples.llama7b:model --length 4096 --batch 64 --nodes 2 "
    "--per-node 8 --memory 80GB --flops 4e14 --intra-bandwidth 300GB/s --inter-bandwidth "
    "200Gbps --intra-latency 5us --inter-latency 20us --save plan.json":
        "traces a 7B Llama on meta and plans it on 16 devices (20 s; a small Llama on a "
        "cluster in test_planner_cli)",
}
_NOT_RUN = {"conveyor train --resume": "needs another conveyor train training in "
                                       "runs/default at the same time (its lock)"}


def examples() -> list[tuple[str, list[str]]]:
    """The pages' command-line examples in order, each with the output lines that
    follow it in a ``$`` block (none for a block of commands alone)."""
    found: list[tuple[str, list[str]]] = []
    for block in [b.lines for page in pages() for b in blocks(page)
                  if b.language in ("", "bash", "console", "sh")]:
        prompt = "$ " if any(line.startswith("$ ") for line in block) else ""
        pending = ""
        for line in block:
            if pending or line.startswith(prompt + "conveyor "):
                pending += " " + line.strip().removesuffix("\\")
                if not line.rstrip().endswith("\\"):
                    command = re.sub(r"\s+#.*$", "", pending.strip().removeprefix("$ "))
                    found.append((" ".join(command.split()), []))
                    pending = ""
            elif prompt and found and not line.startswith("$ "):
                found[-1][1].append(line)
            elif prompt:
                found.append(("", []))  # another program's command: its output is not ours
    return [(command, output) for command, output in found if command]


def _matches(expected: list[str], got: str) -> None:
    lines = got.splitlines()
    for want in expected:
        pattern = ".*".join(re.escape(part) for part in want.strip().split("..."))
        assert any(re.fullmatch(pattern, line.strip()) for line in lines), (want, got)


def _record_run(path: Path) -> None:
    """``run.json``, a recorded step, for ``conveyor trace run.json``."""
    torch.manual_seed(0)
    pipe = conveyor.Pipeline(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), stages=2,
                             devices=["cpu"] * 2, chunks=2, loss_fn=nn.functional.mse_loss)
    with conveyor.record(pipe) as timeline:
        pipe.step(torch.randn(4, 8), torch.randn(4, 8))
    timeline.save(path)


def test_the_slow_readme_examples_are_run_by_hand() -> None:
    if os.environ.get("CONVEYOR_README_SLOW") != "1":
        pytest.skip("not run in CI: " + "; ".join(f"{c!r} {why}" for c, why in _SLOW.items())
                    + "; CONVEYOR_README_SLOW=1 runs them in test_the_readme_examples_run")


def test_the_readme_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # tests.*, examples.*
    (tmp_path / "notes.txt").write_text("not a folder")
    _record_run(tmp_path / "run.json")
    llama_folder(tmp_path / "path" / "to" / "llama", positions=512)
    corpus_folder(tmp_path / "corpus")
    capsys.readouterr()
    found = examples()
    commands = [command for command, _ in found]
    assert len(commands) >= 15 and set(_NOT_RUN) <= set(commands), commands
    slow = os.environ.get("CONVEYOR_README_SLOW") == "1"
    assert set(_SLOW) <= set(commands), commands
    ran: set[str] = set()
    for line, expected in found:
        if line in _NOT_RUN or (line in _SLOW and not slow) or (line in ran and not expected):
            continue  # (shown again on a later page without output: run once)
        ran.add(line)
        argv = [_REAL.get(word, word) for word in shlex.split(line)[1:]]
        argv += _SMALLER.get(line, [])
        code = main(argv)
        out = capsys.readouterr()
        if expected and expected[0].startswith(f"conveyor {argv[0]}: error:"):
            assert code == 2, (line, out)
        else:
            assert code == (1 if "DIFFERS" in expected else 0), (line, out)
        _matches(expected, out.out + out.err)


@pytest.mark.parametrize("command", ["train", "simulate", "trace", "plan", "check", "demo"])
def test_every_command_prints_its_help(command: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``conveyor train --help`` crashed (TypeError: must be real number, not dict): an
    option's help said ">10% faster", and argparse formats help text with %. Fixed: the
    options' help is escaped. Every sub-command the parser has is here."""
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == {"train", "simulate", "trace", "plan", "check", "demo", "export"}
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args([command, "--help"])
    assert exit.value.code == 0
    assert f"usage: conveyor {command}" in capsys.readouterr().out
