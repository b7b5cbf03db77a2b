"""conveyor plan's mesh: PP x TP x DP x sharding, the verdict on pipelining, and the
planner's defects a new user found (flags beside a file, a plan with replicas in one
process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor.cli import main
from conveyor.errors import ConveyorError
from conveyor.planner import PipelinePlan, StageChoice

ROOT = Path(__file__).resolve().parent.parent
TWO_NODES = str(ROOT / "examples" / "two_nodes.toml")
SMALL = ["plan", "--model", "transformer", "--layers", "4", "--d-model", "256", "--d-ff",
         "1024", "--heads", "4", "--vocab", "1000", "--length", "64", "--batch", "8",
         "--no-replicas"]


# ------------------------------------------------------------------ the defects

def test_memory_beside_a_topology_file_overrides_it_and_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--topology", TWO_NODES, "--memory", "1GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["memory"] == 1e9  # not the file's 80 GB
    assert result["overrides"] == [f"--memory 1GB (1 GB per device) overrides the memory "
                                   f"of --topology {TWO_NODES}"]
    assert result["best"]["memory_cap"] == 1e9
    assert main([*SMALL, "--topology", TWO_NODES, "--memory", "1GB"]) == 0
    assert "--memory 1GB (1 GB per device) overrides" in capsys.readouterr().out
    # Without the flag: the file's memory, no note.
    assert main([*SMALL, "--topology", TWO_NODES, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["memory"] == 80e9 and result["overrides"] == []


def test_a_shape_flag_beside_a_topology_file_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--topology", TWO_NODES, "--per-node", "4",
                 "--inter-bandwidth", "10Gbps"]) == 2
    err = capsys.readouterr().err
    assert f"--per-node, --inter-bandwidth given beside --topology {TWO_NODES}" in err
    assert "edit the file, or drop --topology" in err


def _replicated_plan(replicas: int) -> PipelinePlan:
    stage = StageChoice((0, 0), tuple(range(replicas)), False, 1.0, 3.0, 0.0, 0.0, 1.0)
    last = StageChoice((1, 1), tuple(range(replicas, 2 * replicas)), False, 1.0, 3.0, 0.0,
                       0.0, 1.0)
    return PipelinePlan("toy", 8, "1f1b", 4, "sgd", (stage, last), 1.0, "", 1e9)


def test_a_plan_with_replicas_in_one_process_names_the_torchrun_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ConveyorError, match=r"the plan \(replicas per stage \[2, 2\]\) runs "
                       r"one process per device.*torchrun --nproc-per-node 4 your_script"):
        conveyor.Pipeline(model, plan=_replicated_plan(2), loss_fn=nn.functional.mse_loss)
    with pytest.raises(ConveyorError, match=r"data_parallel=3 runs one process per device.*"
                       r"launch 6 of them under torchrun"):
        conveyor.Pipeline(model, stages=2, chunks=3, data_parallel=3,
                          loss_fn=nn.functional.mse_loss)
    # A plan without replicas still runs in one process.
    pipe = conveyor.Pipeline(model, plan=_replicated_plan(1), loss_fn=nn.functional.mse_loss,
                             devices=["cpu", "cpu"])
    loss = pipe.step(torch.randn(8, 2), torch.randn(8, 2))
    assert torch.isfinite(torch.as_tensor(loss)).all()
