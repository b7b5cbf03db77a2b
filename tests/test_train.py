"""``conveyor train``: resume bit for bit, checkpoints across partitions, atomic saves,
one-line errors for bad input, and the command end to end (threads and torchrun)."""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
import conveyor.train.saving
from conveyor.train import saving
from conveyor.cli import main
from conveyor.train.data import text_corpus
from conveyor.train.models import transformer_lm
from conveyor.pipeline import Pipeline
from conveyor.train.language import next_token_loss
from conveyor.schedules import build
from tests.support.launch import run_command
from tests.support.training import (
    TINY,
    checkpoint_state,
    latest_checkpoint,
    one_error_line,
    train,
)


def tiny_model() -> torch.nn.Sequential:
    """The model of a run on the TINY flags."""
    return transformer_lm(2, 16, 32, 2, max_length=16, tie=True)


def assert_same_tensors(a: Any, b: Any, where: str = "") -> None:
    """Equal nested structures, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# -- resuming -------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_an_interrupted_and_resumed_run_ends_bit_identical(tmp_path: Path, schedule: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    flags = ["--steps", "7", "--dropout", "0.1", "--schedule", schedule]
    assert train(tmp_path / "whole", *flags) == 0

    calls = 0
    real_step = Pipeline.step

    def step_then_ctrl_c(self: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 4:  # Ctrl-C in the middle of step 4: it finishes, saves, stops
            signal.raise_signal(signal.SIGINT)
        return real_step(self, inputs, targets)

    monkeypatch.setattr(Pipeline, "step", step_then_ctrl_c)
    assert train(tmp_path / "split", *flags) == 128 + signal.SIGINT
    monkeypatch.undo()
    assert "stopped by SIGINT after step 4" in capsys.readouterr().out
    assert checkpoint_state(tmp_path / "split")["extra"]["step"] == 4

    # The options come back from the run itself: only --out and --resume are given.
    assert main(["train", "--resume", "--out", str(tmp_path / "split")]) == 0
    whole, split = checkpoint_state(tmp_path / "whole"), checkpoint_state(tmp_path / "split")
    assert_same_tensors(whole["model"], split["model"], "model")
    assert_same_tensors(whole["optimizer"], split["optimizer"], "optimizer")
    assert_same_tensors(whole["extra"]["history"], split["extra"]["history"], "history")
    assert_same_tensors(whole["extra"]["rng"], split["extra"]["rng"], "rng")


def test_a_two_stage_checkpoint_loads_into_four_stages_and_the_plain_model(
        tmp_path: Path) -> None:
    assert train(tmp_path, "--steps", "3", "--stages", "2") == 0
    saved = checkpoint_state(tmp_path)

    torch.manual_seed(1)  # other initial weights: everything must come from the file
    four = Pipeline(tiny_model(), stages=4, chunks=2, loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(four.parameters())
    extra = saving.load(tmp_path, model=four, optimizer=optimizer)
    assert extra["step"] == 3 and saved["extra"]["config"]["stages"] == 2
    assert len(four.balance) == 4
    plain = tiny_model()
    plain.load_state_dict(conveyor.train.saving.load_weights(tmp_path))  # as the README says
    assert_same_tensors(dict(plain.state_dict()), saved["model"])

    # The optimizer's moments follow each parameter by name into its new stage.
    names = {id(p): n for n, p in four.named_parameters()}
    assert {names[id(p)] for p in optimizer.state} == set(saved["optimizer"])
    for parameter, state in optimizer.state.items():
        assert_same_tensors(state, saved["optimizer"][names[id(parameter)]])

    inputs, _ = text_corpus().batch(0, 4, 16, heldout=True)
    four.eval()
    plain.eval()
    with torch.no_grad():
        piped = four.eval_step(inputs)
        whole = torch.cat([plain(part) for part in inputs.chunk(2)])
    assert torch.equal(piped, whole)


def test_a_plain_model_checkpoint_resumes_both_copies_of_a_tied_weight(
        tmp_path: Path) -> None:
    """The plain model's embedding is its head; a pipeline holds a copy on each end,
    and each copy must resume with the optimizer moments of the one weight."""
    torch.manual_seed(0)
    plain = tiny_model()
    optimizer = torch.optim.AdamW(plain.parameters())
    inputs, targets = text_corpus().batch(0, 4, 16)
    next_token_loss(plain(inputs), targets).backward()
    optimizer.step()
    saving.save(tmp_path, model=plain, optimizer=optimizer, extra={"step": 1})

    pipe = Pipeline(tiny_model(), stages=2, chunks=2, loss_fn=next_token_loss)
    resumed = torch.optim.AdamW(pipe.parameters())
    saving.load(tmp_path, model=pipe, optimizer=resumed)
    parameters = dict(pipe.named_parameters())
    embedding, head = parameters["0.tokens.weight"], parameters["4.weight"]
    assert embedding is not head  # a copy per stage
    expected = optimizer.state[plain[0].tokens.weight]
    for copy in (embedding, head):
        assert torch.equal(copy, plain[0].tokens.weight)
        assert_same_tensors(resumed.state[copy], expected)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert train(tmp_path, "--steps", "3") == 0
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
              if p.is_file() and "checkpoint" in p.parts}
    model = Pipeline(tiny_model(), stages=2, chunks=2, loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(model.parameters())

    def crash_midway(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
        file.write(b"PK\x03\x04 half a zip archive")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(OSError, match="No space left"):
        saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": 4})
    monkeypatch.undo()

    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
            if p.is_file() and "checkpoint" in p.parts} == before
    assert saving.load(tmp_path, model=model, optimizer=optimizer)["step"] == 3


def test_verbose_prints_every_action_of_a_step_to_stderr(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--steps", "1", "--sample-bytes", "0"]
    assert train(tmp_path / "quiet", *flags) == 0
    assert "micro-batch" not in capsys.readouterr().err

    assert train(tmp_path / "loud", *flags, "--verbose") == 0
    err = capsys.readouterr().err
    for rank, column in enumerate(build("1f1b", 2, 2).columns):  # TINY's table
        for action in column:
            assert f"conveyor.engine.actionlog: rank {rank} {action} micro-batch " \
                   f"{action.microbatch}: " in err, (action, err)
    assert "run F+B on ranks 0, 1: 8 actions" in err
    # How to run is not what to train: --resume must not inherit it, nor old runs miss it.
    assert "verbose" not in json.loads((tmp_path / "loud" / "options.json").read_text())
    assert not logging.getLogger("conveyor").isEnabledFor(logging.DEBUG)  # the command's only


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--schedule", "pipedream"], "unknown schedule 'pipedream'; choose one of gpipe, 1f1b"),
    (["--chunks", "8"], "--chunks 8 is more than the batch of 4 sequences"),
    (["--stages", "6"], "--stages 6 x --virtual-stages 1 asks for more stages than the "
                        "model's 5 layers"),
    (["--checkpoint-mode", "sometimes"], "unknown --checkpoint-mode 'sometimes'"),
    (["--width", "15"], "--width 15 is not divisible by --heads 2"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--chunks", "3",
      "--batch", "6"], "interleaved"),
    (["--resume"], "--resume: there is no checkpoint in"),
    (["--data-parallel", "3"], "--batch 4 does not split evenly into --data-parallel 3"),
    (["--lr", "-1"], "--lr must be greater than 0, got -1.0"),  # was torch's traceback
    (["--timeout", "-5"], "--timeout must be at least 0, got -5.0"),
    (["--on-nonfinite", "ignore"], "unknown --on-nonfinite 'ignore'; choose stop or skip"),
    (["--length", "10000000"], "--length 10000000: one micro-batch's attention scores alone "
                               "take 1490116 GiB (2 sequences x 2 heads x 10000000^2 x 4 "
                               "bytes), more than half of this machine's"),  # was a hang
    (["--data-parallel", "2", "--chunks", "4"], "--chunks 4 is more than the batch of 2 "
                                                "sequences per replica"),
    (["--data-parallel", "2"], "--data-parallel 2 needs processes: launch 4 with torchrun"),
    (["--devices", "cpu,cpu,cpu"], "--devices names 3 devices for 2 stages"),
    (["--devices", "gpu"], "--devices: 'gpu' is not a device"),
])
def test_bad_options_give_one_line_and_write_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
        message: str) -> None:
    assert train(tmp_path / "run", *flags) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_bad_config_file_is_named(tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "options.json"
    config.write_text(json.dumps({"layers": 2, "stagez": 2}))
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    assert "has unknown options ['stagez']" in one_error_line(capsys)
    config.write_text(json.dumps({"layers": "two"}))
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    assert "option 'layers' must be a int, got 'two'" in one_error_line(capsys)
    config.write_text("{not json")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    assert "cannot read the config file" in one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.device_count() > 8, reason="needs a missing GPU")
def test_a_missing_gpu_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train(tmp_path / "run", "--devices", "cuda:8") == 2
    assert "--devices: there is no cuda:8 here" in one_error_line(capsys)


def test_a_config_file_sets_options_and_flags_win(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "options.json"
    config.write_text(json.dumps({"steps": 2, "lr": 1e-3, "schedule": "gpipe"}))
    assert train(tmp_path / "run", "--config", str(config), "--schedule", "zero-bubble") == 0
    options = json.loads((tmp_path / "run" / "options.json").read_text())
    assert (options["steps"], options["lr"], options["schedule"]) == (2, 1e-3, "zero-bubble")


@pytest.mark.parametrize("damage, flags, message", [
    ("none", [], "already holds a checkpoint; pass --resume"),
    ("none", ["--resume", "--width", "32"],
     "was written for another model: it was written with --width 16, this run has --width 32"),
    ("garbage", ["--resume"], "is damaged: state.pt changed since it was written"),
    ("truncated", ["--resume"], "is damaged: state.pt changed since it was written"),
])
def test_existing_checkpoints_are_never_overwritten_by_a_bad_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, flags: list[str],
        message: str) -> None:
    assert train(tmp_path, "--steps", "3") == 0
    path = latest_checkpoint(tmp_path) / "state.pt"
    if damage == "garbage":
        path.write_bytes(b"this is not a checkpoint")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    capsys.readouterr()
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    assert main(["train", *TINY, "--steps", "6", "--out", str(tmp_path), *flags]) == 2
    assert message in one_error_line(capsys)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


# -- the command end to end -------------------------------------------------------------


def untrained_bpb(config: dict[str, Any]) -> float:
    """Held-out bits per byte of a run's model before its first step, measured as the run
    measures it: the initial weights of the run's seed, the same held-out batches."""
    torch.manual_seed(config["seed"])
    model = transformer_lm(config["layers"], config["width"], config["hidden"],
                           config["heads"], vocab=256, max_length=config["length"],
                           dropout=config["dropout"], tie=True).eval()
    corpus = text_corpus()
    total = 0.0
    with torch.no_grad():
        for index in range(config["eval_batches"]):
            inputs, targets = corpus.batch(index, config["batch"], config["length"],
                                           seed=config["seed"], heldout=True)
            total += float(next_token_loss(model(inputs), targets))
    return total / config["eval_batches"] / math.log(2)


def check_run_directory(out: Path, steps: int) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and len(summary["history"]) == steps
    # A few steps learn: 0.14 bits better than the untrained model after 3 steps, 0.23
    # after 6 (and 8 bits would be a uniform guess).
    untrained = untrained_bpb(summary["config"])
    assert summary["heldout_bpb"] < untrained - 0.1, (summary["heldout_bpb"], untrained)
    assert summary["unigram_bpb"] == pytest.approx(text_corpus().unigram_bits())
    trace = json.loads((out / "step.trace.json").read_text())
    assert {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"} >= {"F", "B"}
    for picture in ("step.png", "curve.png"):
        assert (out / picture).read_bytes()[:4] == b"\x89PNG"
    plain = tiny_model()
    plain.load_state_dict(saving.load_weights(out))  # every key, every shape
    moments = saving.load_optimizer_state(out)  # the optimizer's, by the same names
    for name, parameter in plain.named_parameters(remove_duplicate=False):
        assert moments[name]["exp_avg"].shape == parameter.shape, name
        assert float(moments[name]["step"]) == steps, name
    return summary


@pytest.mark.timeout(300)
def test_the_command_runs_end_to_end_in_one_process(tmp_path: Path) -> None:
    result = run_command([sys.executable, "-m", "conveyor", "train", *TINY,
                          "--steps", "4", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "held-out" in result.stdout and "sample (pipelined inference" in result.stdout
    check_run_directory(tmp_path, 4)
    assert latest_checkpoint(tmp_path).name == "step-00000004"


@pytest.mark.timeout(400)
def test_the_command_runs_under_torchrun_and_resumes(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "conveyor", "train", *TINY,
                "--out", str(tmp_path)]
    result = run_command([*torchrun, "--steps", "4"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("training T(2, 32, 2)") == 1  # logs from one rank only
    first = check_run_directory(tmp_path, 4)
    assert first["config"]["stages"] == 2  # one stage per process
    assert (tmp_path / "checkpoint" / "latest").read_text() == "step-00000004"

    # The same numbers as threads in one process (same batches, same partition).
    threads = tmp_path / "threads"
    assert train(threads, "--steps", "4") == 0
    losses = [e["loss"] for e in json.loads((threads / "summary.json").read_text())["history"]]
    assert [e["loss"] for e in first["history"]] == pytest.approx(losses, rel=1e-5)

    result = run_command([*torchrun, "--steps", "6", "--resume"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming at step 4" in result.stdout
    check_run_directory(tmp_path, 6)
    assert (tmp_path / "checkpoint" / "latest").read_text() == "step-00000006"


@pytest.mark.timeout(300)
def test_data_parallel_pipelines_under_torchrun_match_one_pipeline(tmp_path: Path) -> None:
    """2 stages x 2 replicas, each on half the batch: the losses of 2 stages on the whole."""
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", "-m", "conveyor", "train", *TINY,
                          "--data-parallel", "2", "--chunks", "1", "--steps", "3",
                          "--sample-bytes", "0", "--out", str(tmp_path / "replicas"),
                          "--verbose"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 stages x 2 replicas" in result.stdout
    # --verbose: every process logs its own column, by its pipeline rank (0 or 1).
    logged = set(re.findall(r"process (\d) conveyor\.engine\.actionlog: rank (\d) \2F0 ",
                            result.stderr))
    assert len(logged) == 4 and {p for p, _ in logged} == {"0", "1", "2", "3"}, logged
    assert sorted(rank for _, rank in logged) == ["0", "0", "1", "1"]
    replicas = check_run_directory(tmp_path / "replicas", 3)
    assert train(tmp_path / "one", "--chunks", "2", "--steps", "3") == 0
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert [e["loss"] for e in replicas["history"]] == pytest.approx(
        [e["loss"] for e in one["history"]], rel=1e-5)


def test_a_run_exports_its_model_and_conveyor_export_writes_a_checkpoint_s(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--export DIR`` at the end of a run, and ``conveyor export CHECKPOINT DIR``: the
    trained weights by plain names, bit-exact; a folder that is not empty is refused
    with one line, nothing written."""
    from safetensors.torch import load_file

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    assert train(tmp_path / "run", "--steps", "2", "--export", str(tmp_path / "taken")) == 2
    assert "--export: cannot export into" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    assert train(tmp_path / "run", "--steps", "2", "--sample-bytes", "0",
                 "--export", str(tmp_path / "exported")) == 0
    saved = saving.load_weights(tmp_path / "run")
    exported: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "exported").glob("*.safetensors")):
        exported.update(load_file(file))
    tied = set(saved) - set(exported)  # the head shares the embedding's weight: once
    assert len(tied) == 1 and torch.equal(saved[tied.pop()], saved["0.tokens.weight"])
    for name, value in exported.items():
        assert torch.equal(value, saved[name]), name
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "cli")]) == 0
    cli = load_file(tmp_path / "cli" / "model.safetensors")
    assert set(exported) <= set(cli) <= set(saved)
    assert all(torch.equal(value, saved[name]) for name, value in cli.items())
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"conveyor export: error: cannot export into {tmp_path / 'taken'}: the "
                   "folder exists and is not empty (nothing was written); name a new or "
                   "empty folder"]
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["x"]
