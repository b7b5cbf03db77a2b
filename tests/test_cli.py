"""The conveyor command line: simulate, trace and plan (demo runs in make demo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor.cli import main
from conveyor.schedules import build


def test_simulate_prints_bubble_and_memory_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--chunks", "8",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bubble"] == pytest.approx(3 / 11)
    assert result["peak_inflight"] == [4, 3, 2, 1]


def test_simulate_draws_and_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "interleaved-1f1b", "--stages", "2", "--chunks", "4",
                 "--virtual-stages", "2", "--plot", str(tmp_path / "g.png"),
                 "--trace", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "interleaved-1f1b: 2 ranks x 2 stages, 4 micro-batches" in out
    assert (tmp_path / "g.png").stat().st_size > 1000
    trace = json.loads((tmp_path / "t.json").read_text())
    table = build("interleaved-1f1b", 2, 4, virtual_stages=2)
    assert sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X") == sorted(
        str(a) for column in table.columns for a in column)  # every action, once


def test_a_recorded_run_has_the_simulators_form_and_the_trace_command_reads_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.observe.simulate import CostModel, simulate
    from conveyor.schedules import dependencies

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4,
                             schedule="zero-bubble", loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with conveyor.record(pipe) as measured:
        pipe.step(x, y)
    table = pipe.schedule
    events = {e.label: e for e in measured.events}
    assert len(events) == len(measured.events) == sum(len(c) for c in table.columns)
    for rank, column in enumerate(table.columns):
        mine = sorted((e for e in measured.events if e.rank == rank), key=lambda e: e.start)
        assert [e.label for e in mine] == [str(a) for a in column]  # in table order
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))  # one at a time
        for action in column:
            event = events[str(action)]
            assert event.wait + event.transfer <= event.end - event.start, event
            # An action waits exactly when it needs another rank's result (stage 1's
            # forwards, stage 0's input-gradient backwards), and cannot end before
            # that result's action began.
            needs = [d for d in dependencies(action, table)
                     if table.stage_ranks[d.stage] != rank]
            assert (event.wait > 0) == bool(needs), event
            assert all(event.end > events[str(d)].start for d in needs), event
    costs = CostModel.from_timeline(measured, 2)  # a measured run feeds the simulator
    predicted = simulate(pipe.schedule, costs).timeline
    assert type(predicted) is type(measured)
    assert sorted(e.label for e in predicted.events) == sorted(e.label for e in measured.events)
    path = tmp_path / "run.json"
    measured.save(path)
    assert main(["trace", str(path), "--plot", str(tmp_path / "run.png")]) == 0
    assert "measured zero-bubble" in capsys.readouterr().out
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_recording_covers_both_phases_of_gpipe() -> None:
    pipe = conveyor.GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1],
                          devices=["cpu"] * 2, chunks=2)
    with conveyor.record(pipe) as timeline:
        pipe(torch.randn(4, 4)).sum().backward()
    assert sorted(e.label for e in timeline.events) == [
        "0B0", "0B1", "0F0", "0F1", "1B0", "1B1", "1F0", "1F1"]


def test_plan_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "transformer", "--layers", "8", "--d-model", "256", "--d-ff",
            "1024", "--heads", "4", "--vocab", "1000", "--length", "64", "--devices", "2",
            "--memory", "1GiB", "--optimizer", "rmsprop", "--batch", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "stage 1" in out and "deepest transformer" in out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["best"]["fits"] and result["largest_layers"] >= 8


def test_the_command_runs_and_simulate_needs_no_torch() -> None:
    code = ("import sys; from conveyor.cli import main; "
            "main(['simulate', '--stages', '2', '--chunks', '2']); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().endswith("no torch")
