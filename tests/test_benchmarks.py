"""The benchmark scripts' own logic, and that they start (not their timings)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture()
def pipeline1(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import pipeline1_gpu

    return pipeline1_gpu


@pytest.mark.parametrize("largest", [0, 1, 2, 3, 7, 8, 9, 100, 4096])
def test_search_finds_the_largest_fitting_size(pipeline1, largest: int) -> None:  # type: ignore[no-untyped-def]
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= largest

    assert pipeline1.largest_fitting(fits) == largest
    assert len(tried) <= 2 * 13  # doubling then bisection: logarithmic


def test_recomputed_loss_script_measures_both_ways() -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "recomputed_loss.py"),
                             "--smoke"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"\| kept apart \| \d+ \| \d+ \|", result.stdout), result.stdout
    assert "the loss kept apart holds" in result.stdout


def test_pipeline1_script_runs_a_step_of_each_kind() -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "pipeline1_gpu.py"), "--smoke"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "naive, Pipeline-1 and offload steps ran" in result.stdout


def test_any_model_script_compares_conveyor_with_torch_on_hugging_face_models(
        tmp_path: Path) -> None:
    out = tmp_path / "any_model.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "any_model.py"), "--quick",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    size = report["config"]["steps"]
    for name, model in report["models"].items():
        for library, found in model["libraries"].items():
            if library.startswith("torch") and "failed" in found:  # it cannot split Llama
                continue
            assert found["first_loss"] == pytest.approx(model["plain_loss"], rel=1e-5), library
            for rank in found["gradients"]:
                assert rank["untied_compared"] > 0
                assert rank["untied_max_relative_error"] < 1e-4, (name, library)
        assert "failed" not in model["libraries"]["conveyor"]
    gpt2 = report["models"]["gpt2"]["libraries"]
    # conveyor's copies of the tied embedding hold the whole gradient; torch's hold parts.
    assert max(e for g in gpt2["conveyor"]["gradients"]
               for e in g["tied_copies"].values()) < 1e-5
    assert min(e for g in gpt2["torch"]["gradients"] for e in g["tied_copies"].values()) > 0.1
    assert gpt2["torch"]["gradients"][0]["copies_added_over_ranks"] < 1e-5
    # Both send the same values; the gradient of the hidden state is all that goes back.
    ours, theirs = gpt2["conveyor"]["bytes_per_step"], gpt2["torch"]["bytes_per_step"]
    assert ours["payload"] == theirs["payload"]
    width = size["gpt2"]["n_embd"]
    assert ours["payload"]["gradient"] == size["batch"] * size["length"] * width * 4
    envelopes = sum(ours["wire"].values()) - sum(ours["payload"].values())
    assert 0 < envelopes <= 1024 * sum(ours["messages"].values())
    # Each rank holds its stage: the ranks' parameters add up to the whole model's and
    # the tied head's copy.
    memory = report["memory"]
    whole = memory["1"][0]["parameter_bytes"]
    gpt2_config = report["config"]["memory_model"]
    head = gpt2_config["vocab_size"] * gpt2_config["n_embd"] * 4
    assert sum(r["parameter_bytes"] for r in memory["2"]) == whole + head


def test_gpu_script_without_cuda_says_so_and_exits_zero(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert "no CUDA device here" in result.stdout
    assert not list(tmp_path.iterdir())


def test_gpu_script_runs_every_part_at_toy_sizes_and_writes_its_report(tmp_path: Path) -> None:
    """Each part's logic on the CPU: a part that fails is recorded as an error, so the
    report must hold no error and every part's figures."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu.py"), "--smoke",
                             "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "gpu-smoke.json").read_text())["results"]
    assert not [name for name, part in report.items() if "error" in part], report
    assert report["equivalence"]["cases"] == 4 and not report["equivalence"]["failures"]
    assert re.match(r"\d+ tests collected", report["tests"]["summary"]), report["tests"]
    overhead = report["overhead"]["over_accumulated"]
    pipelines = {"K=1, M=4", "K=2, M=8", "K=4, M=16"}
    assert set(overhead) == pipelines | {f"{p}, autograd's accumulation" for p in pipelines}
    assert set(report["schedules"]["predicted_ms"]) >= {"gpipe", "1f1b", "zero-bubble"}
    every = {"naive": 4, "pipeline_1": 4, "offload": 4}  # the smoke run's limit
    assert report["table1"]["largest_layers"] == every
    assert report["table1"]["long_context"]["largest_layers"] == every
    assert set(report["compiled"]["compiled_speed"]) == {"1f1b compiled",
                                                         "zero-bubble compiled"}
    markdown = (tmp_path / "gpu-smoke.md").read_text()
    assert "### overhead" in markdown and "x plain, same M" in markdown
    assert "### compiled" in markdown and "compiled against eager" in markdown
    assert "largest L at 32k tokens" in markdown
    assert (tmp_path / "gpu-smoke.png").stat().st_size > 1000


def test_gpu_runs_merge_part_by_part_each_with_its_commit(tmp_path: Path) -> None:
    def run(name: str, commit: str, gpu: str, parts: dict) -> str:  # type: ignore[type-arg]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"machine": {"gpu": gpu, "gpus": 1, "torch": "2.11",
                                                "commit": commit}, "results": parts}))
        return str(path)

    tests = {"command": "pytest", "summary": "14 passed", "failures": []}
    speedup = {"skipped": "1 GPU(s)"}
    earlier = run("earlier", "aaa", "H100", {"tests": {**tests, "summary": "12 passed"},
                                             "speedup": speedup})
    later = run("later", "bbb", "H100", {"tests": tests})
    script = [sys.executable, str(BENCHMARKS / "gpu_report.py")]
    done = subprocess.run([*script, earlier, later, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert merged["machine"]["commit"] == "bbb"
    assert merged["results"]["tests"]["summary"] == "14 passed"
    assert [part["commit"] for part in merged["results"].values()] == ["bbb", "aaa"]
    assert "commits bbb (tests), aaa (speedup)" in (tmp_path / "out" / "gpu.md").read_text()
    other = run("other", "ccc", "A100", {"tests": tests})
    refused = subprocess.run([*script, earlier, other, "--out", str(tmp_path / "no")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "not comparable" in refused.stderr


def test_host_overhead_script_times_both_pipelines_per_action(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "host_overhead.py"),
                             "--chunks", "4", "--rounds", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    ms = report["median_ms"]
    assert set(ms) == {"conveyor 1f1b", "conveyor zero-bubble", "torch Schedule1F1B",
                       "stage column"}
    # per action: a step over the 2M F and B actions of a rank, in microseconds
    for name, config in (("conveyor", "conveyor 1f1b"), ("torch", "torch Schedule1F1B")):
        assert report["per_action_us"][name] == pytest.approx(1e3 * ms[config] / 8)
    assert report["zb_over_1f1b"] == pytest.approx(
        ms["conveyor zero-bubble"] / ms["conveyor 1f1b"])
    assert "conveyor / torch" in report["table"]


def test_mesh_script_predicts_every_configuration_and_counts_boundary_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/mesh.py's logic without its runs: the profile scaled to the plain step,
    a prediction for each configuration (pieces across the boundary too), and each boundary's bytes summed over the ranks, both ways."""
    from conveyor.planner import LayerCost, ModelProfile, Shape

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _gloo
    import _host
    import mesh

    assert mesh.boundary_bytes([{"activation 0->1": 10, "gradient 1->0": 10},
                                {"activation 0->1": 5, "activation 1->2": 7}]) == \
        {"0|1": 25, "1|2": 7}
    layers = tuple(LayerCost(f"{i}", 1e-4, 2e-4, 1000, 4000.0, 100.0, 50.0)
                   for i in range(mesh.BLOCKS))
    profile = mesh.scaled(ModelProfile("blocks", layers, 50.0, "by hand"), 0.5)
    whole = mesh.BATCH * sum(x.forward + x.backward for x in profile.layers)
    assert whole == pytest.approx(0.5) and profile.source.endswith("times x3.26")
    def predict(*args: Any) -> float:
        return float(mesh.predict(*args).predicted_step_s)

    steps = {name: predict(profile, shape, schedule, options["chunks"], mesh.cluster(
                 mesh.LEVELS[shape.devices], [(1e-4, 1e8)] * len(mesh.LEVELS[shape.devices])))
             for name, (shape, schedule, options) in mesh.CONFIGS.items()}
    assert steps["no pipeline"] == pytest.approx(0.5)  # no link: the plain step
    # Half the batch each, plus the gradients' ring (4 x 8 x 1000 x 4 bytes at 1e8 B/s),
    # and the step's two agreements (the loss total, the gradients finite), a ring each.
    assert steps["DP=2 replicate"] == pytest.approx(0.25 + 2e-4 + 32000 / 1e8 + 2 * 2e-4)
    assert steps["DP=2 fsdp"] > steps["DP=2 replicate"]
    assert 0.25 < steps["PP=2"] < 0.5
    shape, schedule, options = mesh.TP_CONFIGS["PP=2 x TP=2, pieces"]
    one_link = mesh.cluster((4,), [(1e-4, 1e6)])
    whole, pieces = (mesh.sliced(sliced_from, predict, profile, shape, schedule,
                                 options["chunks"], one_link) for sliced_from in (1 << 20, 0))
    assert pieces != whole  # one link for both: the gather costs what the pieces save
    # Two "nodes" of two: TP=2 within one, on its link; the stages' boundary between them.
    near, far = (1e-4, 1e6), (2e-3, 1e6)
    shape, schedule, options = mesh.TP_CONFIGS["PP=2 x TP=2"]
    slow_boundary, slow_tp = (predict(profile, shape, schedule, options["chunks"],
                                           mesh.cluster((2, 2), links))
                              for links in ([near, far], [far, near]))
    assert slow_tp > slow_boundary  # 32 all-reduces a stage, against 8 messages a boundary
    # The levels fitted back from all-reduces over a pair and over the four, each level's
    # ring 2(n-1)(latency + bytes / n / bandwidth) on top of the one inside it.
    def ring(n: int, latency: float, bandwidth: float, count: int) -> float:
        return 2 * (n - 1) * (latency + 4 * count / n / bandwidth)

    small, large = 4096, 1 << 22
    pair = [ring(2, *near, count) for count in (small, large)]
    four = [p + ring(2, *far, count) for p, count in zip(pair, (small, large))]
    fitted = _gloo.fit_levels((2, 2), small, [pair[0], four[0]], large, [pair[1], four[1]])
    assert fitted == [pytest.approx(near), pytest.approx(far)]
    # The runtime's host costs: what a step of 4, of 8 micro-batches added to its plain
    # pair, 2 actions a micro-batch apart; the pairs are taken out of the times.
    times = {"runtime 4": [0.110, 0.111], "plain 4": [0.100, 0.100],
             "runtime 8": [0.212, 0.213], "plain 8": [0.200, 0.200], "PP=2": [1.0]}
    action, step = _host.runtime_costs(times)
    assert (action, step) == (pytest.approx(2.5e-4), pytest.approx(8.5e-3))
    assert list(times) == ["PP=2"]
    alone = mesh.cluster((1,), [(0.0, 1e12)], (action, step))
    assert predict(profile, Shape(1, 1, 1), "1f1b", 4, alone) == \
        pytest.approx(0.5 + 8 * action + step)


def test_verify_cost_script_times_both_steps() -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "verify_cost.py"), "--smoke"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"a verified step \d+ ms: \+-?\d+% per verified step", result.stdout)


def test_check_finite_script_times_both_ways() -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "check_finite.py"), "--smoke"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "check_finite costs" in result.stdout


def test_sharing_replays_a_pipeline_at_the_speeds_of_processes_sharing_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/_sharing.py: with no sharing the planner's own makespan; with two
    processes on one core, an action alone runs twice as fast as its duration (timed
    with both computing), and two at once as fast as it."""
    from conveyor.planner import LayerCost, ModelProfile
    from conveyor.schedules import build
    from conveyor.schedules.simulate import CostModel, simulate

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _sharing
    import mesh

    layers = tuple(LayerCost(f"{i}", 1e-4, 2e-4, 1000, 4000.0, 100.0, 50.0)
                   for i in range(mesh.BLOCKS))
    profile = ModelProfile("blocks", layers, 50.0, "by hand")
    for name in ("PP=4", "PP=2 x TP=2"):
        shape, schedule, options = mesh.TP_CONFIGS[name]
        candidate = mesh.predict(profile, shape, schedule, options["chunks"],
                                 mesh.cluster((2, 2), [(1e-4, 1e8)] * 2))
        assert candidate.timeline is not None
        unshared = dict.fromkeys(range(1, 5), 1.0)
        assert _sharing.shared_makespan(candidate.timeline, schedule, options["chunks"],
                                        unshared, shape.tp, candidate.p2p_s) == \
            pytest.approx(candidate.timeline.makespan)
    # One micro-batch on two stages: F, F, B, B, one at a time, each alone on the core.
    timeline = simulate(build("1f1b", 2, 1), CostModel((1.0, 1.0), (2.0, 2.0), (0.0, 0.0),
                                                       (0.0, 0.0), (0.0,))).timeline
    one_core = _sharing.taking_turns(1, 2)
    assert one_core == {1: 1.0, 2: 2.0}
    assert _sharing.taking_turns(2, 4) == {1: 1.0, 2: 1.0, 3: 1.5, 4: 2.0}
    assert _sharing.shared_makespan(timeline, "1f1b", 1, one_core, 1, 0.0) == \
        pytest.approx(6.0 / 2)
    # GPipe's two forwards on stage 0 first alone, then beside stage 1's first.
    timeline = simulate(build("gpipe", 2, 2), CostModel((1.0, 1.0), (1.0, 1.0), (0.0, 0.0),
                                                        (0.0, 0.0), (0.0,))).timeline
    # 0F0 alone (0.5), 0F1 with 1F0 (1), 1F1 alone (0.5), 1B1 alone (0.5), then 1B0
    # beside 0B1 (1), 0B0 alone (0.5).
    assert _sharing.shared_makespan(timeline, "gpipe", 2, one_core, 1, 0.0) == \
        pytest.approx(4.0)
