"""conveyor plan --model package.module:function, and conveyor.observe.plan.measure_split: the
user's own model cut as a pipeline cuts it, its per-stage memory from the traced stages."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

import conveyor
import conveyor.observe.plan
from conveyor.cli import main
from tests.support.extras import require
from tests.support.user_models import LadderUNet, TiedLM, llama_on_meta


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_a_model_on_meta_is_cut_where_pipeline_would_and_its_parameters_add_up(
        capsys: pytest.CaptureFixture[str]) -> None:
    require("transformers")
    model = llama_on_meta()
    assert next(model.parameters()).is_meta
    total = sum(p.numel() for p in model.parameters())
    args = ["plan", "--model", "tests.support.user_models:llama_on_meta",
            "--stages", "2", "--length", "16", "--batch", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tests.support.user_models:llama_on_meta (LlamaForCausalLM): "
                          f"{total:,} parameters, 16 bytes each with adam; 2 stages, split "
                          "at model.layers.2 (chosen by parameters)")
    rows = [line.split() for line in out.splitlines() if line.startswith("stage ")]
    assert [row[2] for row in rows] == ["(start)", "model.layers.2"]
    assert sum(int(row[3].replace(",", "")) for row in rows) == total  # no tie: each once
    assert "memory per device not given (--memory)" in out


def test_split_at_is_taken_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "tests.support.user_models:ladder",
                       "--split-at", "blocks.2,blocks.4", "--memory", "16GiB",
                       "--no-verify")
    assert result["split_at"] == ["blocks.2", "blocks.4"] and not result["chosen"]
    stages = result["stages"]
    assert [s["begins_at"] for s in stages] == ["(start)", "blocks.2", "blocks.4"]
    assert sum(s["parameters"] for s in stages) == result["parameters"] == sum(
        p.numel() for p in LadderUNet().parameters())
    assert all(s["activation_bytes"] > 0 for s in stages)
    assert result["best"]["fits"] and result["class"] == "LadderUNet"
    assert {p["schedule"] for p in result["options"]} == {"gpipe", "1f1b", "zero-bubble"}


def test_stage_figures_come_from_the_traced_stages() -> None:
    model = TiedLM()
    sample = torch.zeros(2, 3, dtype=torch.long)
    first, last = conveyor.observe.plan.measure_split(model, sample, stages=2)
    assert (first.name, last.name) == ("(start)", "blocks.1")  # [80 + 64 | 64 + 80]
    # The head's weight is the embedding's: each stage holds a copy, the model stays tied.
    assert (first.parameters, last.parameters) == (80 + 64, 64 + 80)
    assert model.head.weight is model.embedding.weight
    # Per sample of 3 tokens: in, the first stage's output (3 x 8 floats); out, the logits
    # (3 x 10); saved for backward, the inputs of the block and of the head.
    assert (last.input_bytes, last.output_bytes, last.activation_bytes) == (96, 120, 192)
    assert last.flops == 2 * 3 * (8 * 8 + 8 * 10)
    meta = conveyor.observe.plan.measure_split(TiedLM().to("meta"), sample.to("meta"), split_at=["blocks.1"])
    assert [f.activation_bytes for f in meta] == [first.activation_bytes, 192]


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "llama"],
     "--model llama: give transformer, convnet, or package.module:function"),
    (["--model", "tests.nowhere:build"],
     "cannot import tests.nowhere: No module named 'tests.nowhere'"),
    (["--model", "tests.support.user_models:missing"],
     "tests.support.user_models has no 'missing'"),
    (["--model", "tests.support.user_models:NOT_A_FUNCTION"],
     "NOT_A_FUNCTION is a int, not a function that returns the model"),
    (["--model", "tests.support.user_models:returns_a_number"],
     "returned a int; return an nn.Module, or (nn.Module, sample)"),
    ([], "give --stages K (cut where Pipeline would) or --split-at"),
    (["--split-at", "blocks.2", "--stages", "3"], "--split-at gives 2 stages but --stages is 3"),
    (["--stages", "7"], "'blocks' holds 6 blocks, fewer than the 7 stages asked of LadderUNet"),
])
def test_bad_options_end_with_one_line(argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "tests.support.user_models:ladder", *argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("conveyor plan: error: ") and message in err[-1], err


def test_a_family_still_needs_devices_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "transformer", "--memory", "1GiB"]) == 2
    assert capsys.readouterr().err.strip() == ("conveyor plan: error: --model transformer "
                                               "needs --devices")
    assert main(["plan", "--model", "convnet", "--devices", "2", "--memory", "1GiB",
                 "--split-at", "x"]) == 2
    assert re.search(r"--split-at is for your own model", capsys.readouterr().err)


def test_plan_recommends_only_a_schedule_checked_exact_on_the_model(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The encoder-decoder of tests/test_check.py, with the engine's fixed defect put
    back: zero-bubble (simulated fastest) counts its encoder's gradient twice, so the
    plan checks it, excludes it with the difference found, and recommends the next
    schedule only once a check found that one exact."""
    from tests.test_check import _counted_twice

    args = ["--model", "tests.test_check:encoder_decoder_sample", "--stages", "2",
            "--batch", "8"]
    result = plan_json(capsys, *args)
    assert result["best"]["schedule"] == "zero-bubble"  # exact with the fix
    assert list(result["verified"]) == ["zero-bubble"] and result["unverified"] is None
    assert result["verified"]["zero-bubble"]["exact"]
    _counted_twice(monkeypatch)
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "\nbest: zero-bubble" not in out
    assert re.search(r"best: (gpipe|1f1b), \d+ micro-batches;.*\nexact: yes, checked "
                     r"\(conveyor check, float64\): 2 micro-batches of the sample", out), out
    assert re.search(r"\nexcluded: zero-bubble, not exact on this model: gradient of "
                     r"'encoder.weight' \(stage 0\).*counted twice under split backward", out)
    options = out[out.index("schedules and micro-batches"):]
    assert "zero-bubble" not in options and re.search(r"\n(gpipe|1f1b) +\d+ +yes +yes", options)
    assert main(["plan", *args, "--no-verify", "--json"]) == 0
    unchecked = json.loads(capsys.readouterr().out)
    assert unchecked["best"]["schedule"] == "zero-bubble" and unchecked["verified"] == {}
    assert unchecked["unverified"].startswith("not verified (--no-verify)")


def test_a_model_on_meta_is_planned_but_said_unverified(
        capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "tests.support.user_models:tied_on_meta",
                       "--stages", "2", "--length", "4", "--batch", "4")
    assert result["verified"] == {}
    assert result["unverified"].startswith("not verified: the model is on the meta device")
