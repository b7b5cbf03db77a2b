"""conveyor plan --model package.module:function, and conveyor.observe.plan.measure_split: the
user's own model cut as a pipeline cuts it, its per-stage memory from the traced stages."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
import conveyor.observe.plan
from conveyor.cli import main
from conveyor.schedules import V_SHAPES
from conveyor.train.models import feed_forward_stack
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
            "--stages", "2", "--length", "16", "--batch", "8", "--top", "100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # ZB-V on 2 ranks is simulated fastest: the model cut in 4 stages, two per rank.
    assert out.startswith(f"tests.support.user_models:llama_on_meta (LlamaForCausalLM): "
                          f"{total:,} parameters, 16 bytes each with adam; 4 stages (two per "
                          "rank on 2 ranks, in a V), split at model.layers.1, model.layers.2, "
                          "model.layers.3 (chosen by parameters)")
    rows = [line.split() for line in out.splitlines() if line.startswith("stage ")]
    assert [row[2] for row in rows] == ["(start)", "model.layers.1", "model.layers.2",
                                        "model.layers.3"]
    assert sum(int(row[3].replace(",", "")) for row in rows) == total  # no tie: each once
    assert "memory per device not given (--memory)" in out
    # The schedules of one stage per rank on the cut in 2, the V shapes on the cut in 4;
    # V-Min refuses 2 ranks.
    table = out[out.index("schedules and micro-batches"):].splitlines()[3:]
    assert {line.split()[0] for line in table if line.strip()} == {
        "gpipe", "1f1b", "zero-bubble", "zb-v", "v-half"}


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
    assert result["v_shapes_unweighed"].endswith("give --stages K, not --split-at")


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


class Stack(nn.Module):
    """Eight equal feed-forward blocks, each of which saves more for backward than it
    holds in parameters and Adam's state on a sample of 64 positions."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = feed_forward_stack(8, 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(), torch.zeros(2, 64, 16)


def test_v_shapes_are_weighed_on_2k_stages_and_chosen_where_only_they_fit(
        capsys: pytest.CaptureFixture[str]) -> None:
    """With --stages K the V shapes are weighed on the model cut into 2K stages. Without
    recomputation V-Half holds about half of what 1F1B holds: under a cap between the
    two, a V shape is the best plan, checked exact on the model, with how to run it."""
    args = ["--model", "tests.test_plan_model:stack", "--stages", "4", "--batch", "32",
            "--no-rematerialize"]
    weighed = plan_json(capsys, *args, "--no-verify")
    need: dict[str, float] = {}  # per schedule, its smallest largest rank over M
    for option in weighed["options"]:
        need[option["schedule"]] = min(max(option["rank_bytes"]),
                                       need.get(option["schedule"], math.inf))
        assert len(option["balance"]) == (8 if option["schedule"] in V_SHAPES else 4)
    assert set(need) == {"gpipe", "1f1b", "zero-bubble", "zb-v", "v-half", "v-min"}
    assert need["v-min"] < need["v-half"] < 0.7 * need["1f1b"]
    cap = (need["v-half"] + need["1f1b"]) / 2
    assert all(need[s] > cap for s in ("gpipe", "1f1b", "zero-bubble", "zb-v"))

    result = plan_json(capsys, *args, "--memory", str(cap))
    assert result["best"]["schedule"] == "v-half" and result["best"]["fits"]
    assert result["best"]["balance"] == [1] * 8
    assert result["split_at"] == [f"blocks.{i}" for i in range(1, 8)]
    assert result["pipeline"] == {"stages": 4, "split_at": result["split_at"],
                                  "schedule": "v-half", "chunks": result["best"]["chunks"],
                                  "recompute": "never"}
    assert result["verified"]["v-half"]["exact"]
    assert result["v_shapes_unweighed"] is None
    assert main(["plan", *args, "--memory", str(cap)]) == 0
    out = capsys.readouterr().out
    assert "; 8 stages (two per rank on 4 ranks, in a V), split at blocks.1, " in out
    assert re.search(r"\nbest: v-half, \d+ micro-batches; .* per device: fits\nrun: "
                     r"conveyor\.Pipeline\(model, stages=4, split_at=\['blocks\.1', .*"
                     r"'blocks\.7'\], schedule='v-half', chunks=\d+, recompute='never', "
                     r"\.\.\.\)\nexact: yes, checked", out), out
    assert len(re.findall(r"\nstage \d ", out)) == 8


def test_v_shapes_are_not_weighed_where_the_model_has_too_few_blocks_for_2k_stages(
        capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "tests.support.user_models:ladder", "--stages", "4",
                       "--batch", "8", "--no-verify")
    assert {p["schedule"] for p in result["options"]} == {"gpipe", "1f1b", "zero-bubble"}
    why = ("cutting the model in 8 stages: 'blocks' holds 6 blocks, fewer than the 8 "
           "stages asked of LadderUNet; use at most 6 stages")
    assert result["v_shapes_unweighed"].startswith(why)
    assert main(["plan", "--model", "tests.support.user_models:ladder", "--stages", "4",
                 "--batch", "8", "--no-verify"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"not weighed: zb-v, v-half, v-min (two stages per rank): {why}")
