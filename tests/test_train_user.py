"""``conveyor train --model --data``: the user's model (a Hugging Face directory, sharded,
with its tokenizer; or a function) on the user's files, resumed mid-epoch bit for bit,
exported to a directory ``from_pretrained`` reads, and its bad input refused in one line."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.cli import main
from conveyor.pipeline import Pipeline
from conveyor.train import saving
from conveyor.train.data import TextCorpus
from conveyor.train.user.corpus import read_corpus
from tests.support.extras import require
from tests.support.launch import run_command
from tests.support.training import checkpoint_state, one_error_line
from tests.support.user_data import corpus_folder, llama_folder, parquet_file

#: A short run of the user's model: no option that shapes the bundled Transformer.
FLAGS = ["--length", "32", "--batch", "8", "--chunks", "4", "--eval-every", "3",
         "--eval-batches", "1", "--save-every", "3", "--sample-bytes", "4", "--warmup", "1"]


def train(out: Path, model: Path | str, data: Path, *flags: str) -> int:
    return main(["train", "--model", str(model), "--data", str(data), *FLAGS,
                 "--out", str(out), *flags])


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the model directory, the corpus folder)."""
    require("transformers")
    root = tmp_path_factory.mktemp("user")
    return llama_folder(root / "llama"), corpus_folder(root / "corpus")


def test_windows_go_through_every_window_once_an_epoch_in_an_order_of_the_seed() -> None:
    corpus = TextCorpus(torch.arange(41, dtype=torch.int32), torch.arange(20, dtype=torch.int32),
                        vocab=64, unit="token")
    assert corpus.windows_per_epoch(4) == 10
    first, _ = corpus.windows(0, 10, 4, seed=1)
    assert sorted(first[:, 0].tolist()) == list(range(0, 40, 4))  # each window once
    assert first[:, 0].tolist() != list(range(0, 40, 4))  # shuffled
    both, targets = corpus.windows(0, 20, 4, seed=1)
    assert torch.equal(both[:10], first) and both[10:, 0].tolist() != first[:, 0].tolist()
    assert torch.equal(targets[:, :-1], both[:, 1:])
    # Read on from any position (a resume, or another batch size): the same windows.
    assert torch.equal(corpus.windows(7, 6, 4, seed=1)[0], both[7:13])
    assert not torch.equal(corpus.windows(0, 10, 4, seed=2)[0], first)


def test_a_folder_of_text_and_json_lines_is_read_and_split_by_document(user: Any) -> None:
    _, folder = user
    corpus = read_corpus(folder, length=32, show=False)
    assert corpus.unit == "byte" and corpus.train.dtype == torch.uint8
    text = corpus.decode(corpus.train.tolist()) + corpus.decode(corpus.heldout.tolist())
    assert text.count("document ") == 40 and "never read" not in text and "not,read" not in text
    held = corpus.decode(corpus.heldout.tolist())
    assert 0 < held.count("document ") < 20  # whole documents, about a tenth
    again = read_corpus(folder, length=32, show=False)
    assert again.identity() == corpus.identity() and torch.equal(again.heldout, corpus.heldout)


def test_parquet_columns_are_read_with_pyarrow(tmp_path: Path) -> None:
    require("pyarrow")
    path = parquet_file(tmp_path / "rows.parquet")
    corpus = read_corpus(path, text_field="body", length=16, show=False)
    assert (corpus.decode(corpus.train.tolist())
            + corpus.decode(corpus.heldout.tolist())).count("document ") == 40


@pytest.mark.timeout(400)  # three short runs: about 80 s on a quiet 2-core machine
def test_a_hugging_face_directory_trains_resumes_mid_epoch_and_exports(
        tmp_path: Path, user: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The model built on meta and filled from its shards, tokens from its tokenizer; a
    run stopped at step 3 of 5 (mid-epoch: 24 of about 125 windows) and resumed ends
    where the whole run ends, bit for bit; the export loads with ``from_pretrained``."""
    import transformers

    model, data = user
    assert train(tmp_path / "whole", model, data, "--steps", "5") == 0
    said = capsys.readouterr().out
    assert "training LlamaForCausalLM from" in said and "(its weights)" in said
    assert "bits/token" in said and "tokens of 24 documents" in said
    calls, real_step = 0, Pipeline.step

    def step_then_ctrl_c(self: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            signal.raise_signal(signal.SIGINT)
        return real_step(self, inputs, targets)

    monkeypatch.setattr(Pipeline, "step", step_then_ctrl_c)
    assert train(tmp_path / "split", model, data, "--steps", "5") == 128 + signal.SIGINT
    monkeypatch.undo()
    stopped = checkpoint_state(tmp_path / "split")["extra"]
    assert stopped["step"] == 3 and stopped["data"]["position"] == 24
    assert stopped["data"]["windows_per_epoch"] > 40  # mid-epoch, and still at the end
    assert main(["train", "--resume", "--out", str(tmp_path / "split"),
                 "--export", str(tmp_path / "exported")]) == 0
    whole, split = checkpoint_state(tmp_path / "whole"), checkpoint_state(tmp_path / "split")
    for part in ("model", "optimizer"):
        assert whole[part].keys() == split[part].keys()
        for name in whole[part]:
            assert _equal(whole[part][name], split[part][name]), (part, name)
    assert whole["extra"]["history"] == split["extra"]["history"]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    trained = saving.load_weights(tmp_path / "split")
    state = loaded.state_dict()
    assert set(trained) <= set(state)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert len(tokenizer) == 300


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def test_a_function_named_as_package_module_function_trains_on_bytes(
        tmp_path: Path, user: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _, data = user
    assert train(tmp_path / "run", "tests.support.user_models:small_byte_lm", data,
                 "--steps", "3") == 0
    said = capsys.readouterr().out
    assert "training tests.support.user_models:small_byte_lm" in said and "bits/byte" in said
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["unit"] == "byte" and "heldout_bpb" in summary


@pytest.mark.long  # two more runs of the Llama: make test-all
def test_a_config_without_weights_is_initialised_from_the_seed(tmp_path: Path,
                                                               user: Any) -> None:
    _, data = user
    bare = llama_folder(tmp_path / "bare", weights=False)
    assert train(tmp_path / "a", bare / "config.json", data, "--steps", "1") == 0
    assert train(tmp_path / "b", bare, data, "--steps", "1") == 0
    first, second = (saving.load_weights(tmp_path / run) for run in ("a", "b"))
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize(("change", "flags", "said"), [
    ("no files", [], "no readable file in the folder"),
    ("bad line", [], "line 2 is not JSON"),
    ("no field", ["--text-field", "body"], "has no text under 'body'"),
    ("wide tokenizer", [], "has 340 ids but the model predicts 300"),
    ("length", ["--length", "100"], "--length 100 is beyond the model's 64 positions"),
    ("shape", ["--layers", "3"], "--layers shapes the bundled Transformer"),
    ("missing", [], "no such folder or file"),
])
def test_bad_input_is_one_line_naming_the_file_or_option_and_nothing_is_written(
        tmp_path: Path, user: Any, capsys: pytest.CaptureFixture[str], change: str,
        flags: list[str], said: str) -> None:
    model, data = user
    if change == "no files":
        data = tmp_path / "empty"
        (data / "sub").mkdir(parents=True)
        (data / "sub" / "table.csv").write_text("a,b\n")
    elif change == "bad line":
        data = tmp_path / "lines.jsonl"
        data.write_text('{"text": "fine"}\n{"text": \n')
    elif change == "wide tokenizer":
        model = llama_folder(tmp_path / "wide", tokenizer_extra=40)
    elif change == "missing":
        model = tmp_path / "nowhere"
    out = tmp_path / "run"
    capsys.readouterr()  # what making the folders printed
    code = main(["train", "--model", str(model), "--data", str(data), *FLAGS,
                 "--steps", "1", "--out", str(out), *flags])
    assert code == 2
    assert said in one_error_line(capsys)
    assert not out.exists() or not any(out.iterdir())


def test_options_are_matched_whole_never_by_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--dat", "somewhere"])
    assert "unrecognized arguments: --dat" in capsys.readouterr().err


@pytest.mark.long  # a 4-process launch: make test-all
@pytest.mark.timeout(400)
def test_two_stages_by_two_replicas_under_torchrun_match_one_process(
        tmp_path: Path, user: Any) -> None:
    model, data = user
    flags = ["--model", str(model), "--data", str(data), *FLAGS, "--chunks", "2",
             "--steps", "3", "--sample-bytes", "0"]
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", "-m", "conveyor", "train", *flags,
                          "--data-parallel", "2", "--out", str(tmp_path / "replicas")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 stages x 2 replicas" in result.stdout
    assert main(["train", *flags, "--out", str(tmp_path / "one")]) == 0
    replicas, one = (json.loads((tmp_path / run / "summary.json").read_text())
                     for run in ("replicas", "one"))
    assert [e["loss"] for e in replicas["history"]] == pytest.approx(
        [e["loss"] for e in one["history"]], rel=1e-5)
