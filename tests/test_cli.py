"""The conveyor command line: simulate, trace and plan (demo runs in make demo)."""

from __future__ import annotations

import json
import re
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
    assert "interleaved-1f1b: 2 ranks, 2 stages each, 4 micro-batches; step 13.5 units" in out
    assert (tmp_path / "g.png").stat().st_size > 1000
    trace = json.loads((tmp_path / "t.json").read_text())
    table = build("interleaved-1f1b", 2, 4, virtual_stages=2)
    assert sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X") == sorted(
        str(a) for column in table.columns for a in column)  # every action, once


def simulate_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["simulate", "--json", *args]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_interleaving_simulates_the_same_model_faster_than_1f1b(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Each of a rank's V stages holds 1/V of its layers, so it costs 1/V of a rank's work.
    plain = simulate_json(capsys, "--schedule", "1f1b", "--stages", "4", "--chunks", "8")
    interleaved = simulate_json(capsys, "--schedule", "interleaved-1f1b", "--stages", "4",
                                "--chunks", "8", "--virtual-stages", "2")
    assert plain["makespan"] == pytest.approx(33)  # 3 M + 3 (K - 1)
    assert interleaved["makespan"] == pytest.approx(28.5)  # 3 M + 3 (K - 1) / V
    assert interleaved["bubble"] == pytest.approx(3 / 19)  # (K - 1) / (V M + K - 1)
    assert plain["unit"] == interleaved["unit"] == "units"


def test_simulate_says_what_its_figures_are(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "interleaved-1f1b", "--stages", "4", "--chunks",
                 "8", "--virtual-stages", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("interleaved-1f1b: 4 ranks, 2 stages each, 8 micro-batches; "
                          "step 28.5 units, bubble 15.8% (textbook (K-1)/(VM+K-1) = 15.8%)")
    rank0 = next(line for line in out.splitlines() if line.startswith("rank 0"))
    assert rank0.split() == ["rank", "0", "0,", "4", "24", "units", "15.8%", "stage", "0:",
                             "8,", "stage", "4:", "4", "5.5", "micro-batches"]
    notes = " ".join(out.split())  # as one line, whatever the wrapping
    assert ("time: in units of one rank's forward of a micro-batch; per micro-batch one "
            "rank's layers take F=1, I=1, W=1 (a full backward B=I+W=2). Each of a rank's 2 "
            "stages does 1/2 of that.") in notes
    assert ("peak activations: the most activations a rank held at once, in micro-batches' "
            "worth of one rank's layers") in notes
    assert main(["simulate", "--stages", "2", "--chunks", "4",
                 "--activation-bytes", "3e6"]) == 0
    rank0 = next(line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("rank 0"))
    assert rank0.endswith("5.72 MiB")  # 2 micro-batches of 3 MB


@pytest.mark.parametrize(("argv", "message"), [
    (["--schedule", "bogus"], r"unknown schedule 'bogus'; choose one of 'gpipe', '1f1b'"),
    (["--stages", "0"], r"--stages must be at least 1, got 0"),
    (["--chunks", "-3"], r"--chunks must be at least 1, got -3"),
    (["--virtual-stages", "0"], r"--virtual-stages must be at least 1, got 0"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--chunks", "6"],
     r"interleaved 1F1B needs a multiple of 4 micro-batches \(one group per rank\); got 6"),
    (["--virtual-stages", "2"], r"schedule '1f1b' has one stage per rank"),
    (["--forward", "-1"], r"--forward must be a finite number of at least 0, got -1.0"),
    (["--backward", "nan"], r"--backward must be a finite number of at least 0, got nan"),
    (["--communication", "inf"], r"--communication must be a finite number of at least 0"),
    (["--activation-bytes", "-5"], r"--activation-bytes must be a finite number of at least 0"),
    (["--forward", "0", "--backward", "0", "--weight", "0"],
     r"--forward, --backward and --weight are all 0: there is nothing to simulate"),
    (["--costs", "missing.json"], r"cannot read the cost model missing.json: "),
    (["--costs", "four.json", "--forward", "2"],
     r"--costs gives every cost; leave out --forward"),
    (["--costs", "four.json", "--stages", "2"],
     r"the cost model must give 2 values per stage"),
    (["--plot", "no/such/dir/g.png"], r"cannot write no/such/dir/g.png: "),
])
def test_simulate_ends_bad_input_with_one_line_and_code_2(
        argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.schedules.simulate import CostModel

    monkeypatch.chdir(tmp_path)
    (tmp_path / "four.json").write_text(json.dumps(CostModel.uniform(4).to_dict()))
    assert main(["simulate", "--stages", "4", "--chunks", "8", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("conveyor simulate: error: "), err
    assert re.search(message, err), err


def test_a_cost_model_file_drives_simulate_in_its_own_unit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.schedules.simulate import CostModel

    path = tmp_path / "costs.json"
    path.write_text(json.dumps(CostModel.uniform(2, forward=0.01, backward=0.01,
                                                 weight=0.01, unit="s").to_dict()))
    result = simulate_json(capsys, "--stages", "2", "--chunks", "2", "--costs", str(path))
    assert result["unit"] == "s" and result["makespan"] == pytest.approx(0.09)
    assert main(["simulate", "--stages", "2", "--chunks", "2", "--costs", str(path)]) == 0
    assert "step 90 ms" in capsys.readouterr().out


def test_a_recorded_run_has_the_simulators_form_and_the_trace_command_reads_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.schedules.simulate import CostModel, simulate
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


@pytest.mark.parametrize(("content", "message"), [
    (None, r"cannot read run.json: No such file or directory"),
    ("{", r"run.json is not a timeline \(Timeline.save writes one\): JSONDecodeError"),
    ('{"events": []}', r"run.json is not a timeline .*KeyError\('num_ranks'\)"),
])
def test_trace_ends_an_unreadable_file_with_one_line_and_code_2(
        content: str | None, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / "run.json").write_text(content)
    assert main(["trace", "run.json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert re.match(r"conveyor trace: error: " + message, err), err


def test_trace_shows_a_simulated_timeline_in_its_own_unit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.schedules.simulate import CostModel, simulate

    simulate(build("1f1b", 2, 4), CostModel.uniform(2)).timeline.save(tmp_path / "u.json")
    assert main(["trace", str(tmp_path / "u.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "simulated 1f1b: 15.0 units, 16 actions, bubble 20.0%"
    assert lines[1].split() == ["compute", "units", "transfer", "units", "waiting", "units",
                                "between", "units", "imbalance", "units"]


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
    # --offload weighs each plan with its activations offloaded too, named so.
    assert main([*args, "--no-rematerialize", "--offload", "--top", "100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    offloaded = [p for p in result["options"] if p["offload"]]
    assert offloaded and len(offloaded) * 2 == len(result["options"])
    assert main([*args, "--no-rematerialize", "--offload", "--top", "100"]) == 0
    assert "1f1b + offload" in capsys.readouterr().out


def test_the_command_runs_and_simulate_needs_no_torch() -> None:
    code = ("import sys; from conveyor.cli import main; "
            "main(['simulate', '--stages', '2', '--chunks', '2']); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().endswith("no torch")


def test_options_are_matched_whole_and_a_command_s_own_usage_is_shown(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--data-par 2`` is not read as ``--data-parallel 2``; an unknown option of a
    command shows that command's usage, not the top-level one."""
    for argv, command in ((["train", "--data-par", "2"], "train"),
                          (["train", "--bogus"], "train"),
                          (["simulate", "--stag", "2", "--stages", "2", "--chunks", "4"],
                           "simulate")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"usage: conveyor {command} " in err, err
        assert f"conveyor {command}: error: unrecognized arguments: {argv[1]}" in err, err
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"conveyor {conveyor.__version__}"
