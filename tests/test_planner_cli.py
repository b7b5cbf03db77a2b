"""conveyor plan with a cluster (PipeDream's planner) and conveyor train --plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.planner import PipelinePlan
from tests.support.extras import require
from tests.support.training import TINY

CLUSTER = ["--per-node", "2", "--memory", "1GB", "--intra-bandwidth", "1GB/s"]


def test_a_family_plans_on_two_nodes_with_memory_under_the_cap(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    topology = tmp_path / "two.toml"
    topology.write_text('memory = "2GB"\nflops = 1e14\n'
                        '[[levels]]\nsize = 4\nbandwidth = "100GB/s"\n'
                        '[[levels]]\nname = "network"\nsize = 2\nbandwidth = "100Gbps"\n')
    assert main(["plan", "--layers", "12", "--d-model", "512", "--d-ff", "2048", "--heads", "8",
                 "--length", "256", "--batch", "32", "--topology", str(topology),
                 "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    best = PipelinePlan.from_dict(found["best"])
    assert best.devices <= 8 and best.peak_memory <= 2e9
    assert sum(best.balance) == 15  # embedding, 12 blocks, norm, head
    assert found["cluster"]["levels"][1]["bandwidth"] == 12.5e9


def test_a_runnable_model_has_its_plan_checked_and_saved(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    saved = tmp_path / "plan.json"
    assert main(["plan", "--model", "tests.support.user_models:ladder", "--batch", "8",
                 *CLUSTER, "--no-replicas", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "exact: yes, checked (conveyor check, float64)" in out
    plan = PipelinePlan.load(saved)
    assert plan.split_at and "split_at" in plan.cut()


def test_bad_cluster_flags_name_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--per-node", "2", "--layers", "2"]) == 2
    assert "needs --memory, --intra-bandwidth" in capsys.readouterr().err
    assert main(["plan", "--nodes", "2", "--layers", "2", *CLUSTER]) == 2
    assert "--inter-bandwidth" in capsys.readouterr().err


def test_a_meta_llama_plans_with_its_head_weighed_as_a_layer(
        capsys: pytest.CaptureFixture[str]) -> None:
    require("transformers")
    assert main(["plan", "--model", "tests.support.user_models:llama_on_meta", "--length",
                 "16", "--batch", "8", *CLUSTER, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["best"]["split_at"][-1] == "lm_head"
    assert found["verified"] == {}  # on meta: nothing to run


def test_train_runs_a_saved_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "plan.json"
    assert main(["plan", "--layers", "2", "--d-model", "16", "--d-ff", "32", "--heads", "2",
                 "--vocab", "256", "--length", "16", "--batch", "4", *CLUSTER,
                 "--no-replicas", "--save", str(saved)]) == 0
    plan = PipelinePlan.load(saved)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "3", "--plan", str(saved), "--out", str(out)]) == 0
    config = json.loads((out / "summary.json").read_text())["config"]
    assert (config["stages"], config["chunks"], config["schedule"]) == \
        (len(plan.stages), plan.chunks, plan.schedule)
    assert main(["train", *TINY, "--layers", "3", "--plan", str(saved),
                 "--out", str(tmp_path / "other")]) == 2
    assert "this run's model has 6" in capsys.readouterr().err
