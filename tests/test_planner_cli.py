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


@pytest.mark.timeout(300)
def test_train_runs_a_plan_with_uneven_replicas_under_torchrun(tmp_path: Path) -> None:
    """A plan whose first stage has two replicas: three processes, one pipeline, each
    step's loss that of the plan without replicas in one process (the same batches)."""
    import sys

    import torch

    from conveyor.train import saving
    from tests.support.launch import run_command

    saved = tmp_path / "plan.json"
    assert main(["plan", "--layers", "2", "--d-model", "16", "--d-ff", "32", "--heads", "2",
                 "--vocab", "256", "--length", "16", "--batch", "4", *CLUSTER,
                 "--no-replicas", "--save", str(saved)]) == 0
    data = json.loads(saved.read_text())  # recut: 2 stages, the first replicated
    stage = data["stages"][0]
    data.update(schedule="1f1b", chunks=4, stages=[{**stage, "layers": [0, 1], "devices": [0]},
                                                   {**stage, "layers": [2, 4], "devices": [2]}])
    saved.write_text(json.dumps(data))
    data["stages"][0]["devices"] = [0, 1]
    uneven = tmp_path / "uneven.json"
    uneven.write_text(json.dumps(data))
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "3", "-m", "conveyor", "train", *TINY,
                          "--steps", "3", "--sample-bytes", "0", "--plan", str(uneven),
                          "--out", str(tmp_path / "uneven")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 stages of [2, 1] replicas" in result.stdout
    assert main(["train", *TINY, "--steps", "3", "--sample-bytes", "0", "--plan", str(saved),
                 "--out", str(tmp_path / "one")]) == 0
    runs = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("uneven", "one")]
    assert [e["loss"] for e in runs[0]["history"]] == pytest.approx(
        [e["loss"] for e in runs[1]["history"]], rel=1e-5)
    # the checkpoint the three processes saved: every weight, as the one process's, to
    # float32's rounding of the replicas' sum (which AdamW's m / sqrt(v) turns into
    # differences of up to its learning rate on gradients that are rounding noise)
    weights = [saving.load_weights(tmp_path / name) for name in ("uneven", "one")]
    assert sorted(weights[0]) == sorted(weights[1])
    for name, value in weights[0].items():
        assert torch.linalg.vector_norm(value - weights[1][name]) <= \
            1e-2 * torch.linalg.vector_norm(weights[1][name]), name
