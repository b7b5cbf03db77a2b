"""Pipelines over processes (gloo on 127.0.0.1): equal to the plain model, and never hung.

Each scenario (tests/support/scenarios/pipeline.py) starts its processes once
(tests/support/launch.py) and the tests compare what they wrote with the plain model,
built here from the same functions (tests/support/cases.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conveyor.schedules import V_SHAPES
from tests.support.cases import (
    case_batch,
    case_model,
    cases,
    lm_loss,
    padded_batch,
    plain_gradients,
    plain_token_loss,
)
from tests.support.launch import Outcome, collect, launch
from tests.support.models import relative_error

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def equivalence(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp(f"equivalence{request.param}")
    outcome = launch("equivalence", request.param, out, timeout=240)
    assert outcome.returncodes == [0] * request.param, "\n".join(outcome.outputs)
    return request.param, out


def whole_head(grads: dict[str, torch.Tensor], model_name: str) -> dict[str, torch.Tensor]:
    """``grads`` with a vocabulary-parallel head's shards, one per rank, as the head's."""
    shards = sorted((k for k in grads if k.startswith("vocab_shards.weights.")),
                    key=lambda k: int(k.rsplit(".", 1)[1]))
    if not shards:
        return grads
    model, _ = case_model(model_name)
    head = f"{len(model) - 1}.weight"
    return {**{k: g for k, g in grads.items() if k not in shards},
            head: torch.cat([grads[k] for k in shards])}


def test_every_schedule_equals_the_plain_model(equivalence) -> None:  # type: ignore[no-untyped-def]
    world, out = equivalence
    for model_name, schedule, virtual in cases(world):
        losses, grads, results = collect(out, f"{model_name}-{schedule}-{virtual}-rank{{rank}}.pt",
                                         world)
        grads = whole_head(grads, model_name)
        expected_loss, expected = plain_gradients(model_name)
        label = f"{model_name} {schedule} V={virtual}"
        assert losses == [losses[0]] * world, label  # the loss reaches every rank
        assert abs(losses[0] - expected_loss) <= 1e-12 * abs(expected_loss), label
        assert sorted(grads) == sorted(expected), label  # both uses of a tied weight
        # eval_step: the rank of the last stage has the output (rank 0 in a V)
        outputs = [r["eval"] for r in results]
        holder = 0 if schedule in V_SHAPES else world - 1
        assert [o is None for o in outputs] == [r != holder for r in range(world)], label
        model, _ = case_model(model_name)
        with torch.no_grad():
            assert relative_error(outputs[holder], model(case_batch(model_name)[0])) <= 1e-12
        for name, grad in grads.items():
            assert relative_error(grad, expected[name]) <= 1e-10, f"{label}: {name}"
        if model_name == "lm":  # the next batch has a longer sequence: shapes travel
            expected_loss, expected = plain_gradients(model_name, length=11, seed=2)
            long_grads: dict[str, torch.Tensor] = {}
            for result in results:
                long_grads.update(result["grads_long"])  # type: ignore[arg-type]
                assert abs(float(result["loss_long"]) - expected_loss) <= 1e-10  # type: ignore[arg-type]
            assert sorted(long_grads) == sorted(expected), label
            for name, grad in long_grads.items():
                assert relative_error(grad, expected[name]) <= 1e-10, f"{label} long: {name}"


def test_pipeline_and_data_parallel_2x2_equals_the_global_batch(tmp_path: Path) -> None:
    outcome = launch("data_parallel", 4, tmp_path, timeout=240)
    assert outcome.returncodes == [0] * 4, "\n".join(outcome.outputs)
    losses, grads, results = collect(tmp_path, "rank{rank}.pt", 4)
    expected_loss, expected = plain_gradients("lm", batch=12)
    assert all(abs(loss - expected_loss) <= 1e-10 for loss in losses)
    assert sorted(grads) == sorted(expected)
    for result in results:  # both replicas of a stage hold the averaged gradients
        for name, grad in result["grads"].items():  # type: ignore[attr-defined]
            assert relative_error(grad, expected[name]) <= 1e-10, name
    # The token loss: its sum over both replicas divided by their total count (the
    # replicas' counts differ), its gradients added to the first step's.
    model, _ = case_model("lm")
    x, y = padded_batch(batch=12)
    token_expected = plain_token_loss(model(x), y)
    token_expected.backward()
    for result in results:
        assert abs(float(result["token_loss"]) - token_expected.item()) <= (  # type: ignore[arg-type]
            1e-10 * token_expected.item())
    accumulated: dict[str, torch.Tensor] = {}
    for result in results:
        accumulated.update(result["accumulated"])  # type: ignore[arg-type]
    assert sorted(accumulated) == sorted(expected)
    for name, p in model.named_parameters(remove_duplicate=False):
        assert relative_error(accumulated[name], expected[name] + p.grad) <= 1e-10, name


def test_a_script_that_ends_after_its_last_step_exits_0_pinned_to_a_core(
        tmp_path: Path) -> None:
    """Each rank on one core (a launcher's CPU binding): gloo's thread that frees the last
    step's all-reduce ran only once the interpreter was finalizing, and the rank aborted
    ("terminate called without an active exception", -6) in 3 of 4 such runs."""
    outcome = launch("ends_well", 2, tmp_path, env={"SCENARIO_PINNED": "1"}, timeout=120)
    assert outcome.returncodes == [0, 0], "\n".join(outcome.outputs)
    assert not any("terminate called" in output for output in outcome.outputs)


def test_layers_start_the_same_whatever_the_partition(tmp_path: Path) -> None:
    import conveyor
    from conveyor.graph.source import sequential
    from tests.support.cases import deep_mlp

    torch.manual_seed(5)
    with torch.device("meta"):
        meta_model = deep_mlp()
    one_stage = conveyor.Pipeline(meta_model, stages=1, devices=["cpu"], chunks=2,
                                  loss_fn=torch.nn.functional.mse_loss).state_dict()
    torch.manual_seed(5)
    reference = sequential(lambda i: deep_mlp()[i], 12).state_dict()
    for world in (2, 4):
        out = tmp_path / str(world)
        out.mkdir()
        outcome = launch("initialisation", world, out, timeout=240)
        assert outcome.returncodes == [0] * world, "\n".join(outcome.outputs)
        timed = []
        for rank in range(world):
            states = torch.load(out / f"rank{rank}.pt")
            assert states["meta"] and states["builder"]
            timed.append(states["timed"])
            for name, value in states["meta"].items():
                assert torch.equal(value, one_stage[name]), (world, name)
            for name, value in states["builder"].items():
                assert torch.equal(value, reference[name]), (world, name)
        # balance="time": rank 0's timings decide for every rank (a bounded exchange)
        assert all(balance == timed[0] for balance in timed) and sum(timed[0]) == 12


def test_clipping_by_the_global_norm_and_nan_check(tmp_path: Path) -> None:
    outcome = launch("clip_and_check", 2, tmp_path, timeout=240)
    model, loss_fn = case_model("lm")
    x, y = case_batch("lm")
    loss_fn(model(x), y).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    expected = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    _, grads, results = collect(tmp_path, "rank{rank}.pt", 2)
    for result in results:
        assert abs(float(result["norm"]) - float(expected_norm)) <= 1e-6 * float(expected_norm)
    assert sorted(grads) == sorted(expected)
    for name, grad in grads.items():
        assert relative_error(grad, expected[name]) <= 1e-10, name
    # Recording under torchrun: every rank gets every rank's actions.
    from conveyor.schedules.timeline import Timeline

    for result in results:
        timeline = Timeline.from_dict(result["timeline"])  # type: ignore[arg-type]
        assert {e.rank for e in timeline.events} == {0, 1}
        assert len(timeline.events) == 2 * 2 * 4  # F and B of 4 micro-batches on 2 ranks
        # That step ran over emulated links of 0.1 s: rank 1 waited for the first
        # activation, rank 0 for it and then the last gradient.
        assert float(result["slowed"]) >= 0.1
    assert float(results[0]["slowed"]) >= 0.2
    # float16: rank 0's gradients overflow, and both ranks drop the step (autocast
    # reached each rank's stage: their Linear layers computed in float16).
    for result in results:
        fp16 = result["fp16"]
        assert "torch.float16" in fp16["dtypes"], fp16
        assert fp16["found_inf"] and fp16["scale"] == 2.0**15 and all(fp16["grads"]), fp16
    # The NaN on micro-batch 1 stops both ranks, each naming the micro-batch.
    assert outcome.returncodes == [1, 1], "\n".join(outcome.outputs)
    for output in outcome.outputs:
        assert "the loss of micro-batch 1 is nan" in output
    # Called again with a good batch, the pipeline computes the plain model's gradients:
    # the failed step's messages are drained, not taken for the new step's.
    model, loss_fn = case_model("lm")
    loss_fn(model(x), y).backward()
    unclipped = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    after = {name: grad for rank in range(2)
             for name, grad in torch.load(tmp_path / f"after{rank}.pt").items()}
    assert sorted(after) == sorted(unclipped)
    for name, grad in after.items():
        assert relative_error(grad, unclipped[name]) <= 1e-10, name


def assert_every_rank_stops(outcome: Outcome, *, within: float, messages: list[str]) -> None:
    """Every rank exits non-zero in time, and rank r's output matches ``messages[r]``."""
    assert all(code not in (0, None) for code in outcome.returncodes), outcome.returncodes
    assert outcome.seconds < within, outcome.seconds
    assert 0 < len(messages) <= len(outcome.outputs)  # a killed rank may leave none
    for output, message in zip(outcome.outputs, messages):
        assert re.search(message, output), output[-2000:]


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_raising_stops_every_rank(tmp_path: Path, world: int) -> None:
    outcome = launch("fault_raise", world, tmp_path, timeout=120)
    failing = (rf"stage {world - 1}, layer {3 * world - 1} \(Fails\) failed on micro-batch 2 "
               rf"\({world - 1}F2\): ValueError: injected failure")
    assert_every_rank_stops(outcome, within=60,
                            messages=[f"rank {world - 1} failed"] * (world - 1) + [failing])
    # GPipe, 16 micro-batches: the ranks before the failing one never wait for it in
    # forward, yet each stops at its next action once the failure has reached it, not
    # after all 16 forwards. The news passes from rank to rank as each polls, one
    # forward of rank 0 per rank in between: rank r runs at most world - 1 - r forwards
    # after the failure (0F3 alone with 2 ranks), world - r here to allow one late poll.
    assert outcome.returncodes == [1] * world  # the error, not a crash on the way out
    assert "rank 0 stopped before its next action" in outcome.outputs[0]
    counts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert counts[0]["forwards"] <= 3 or counts[0]["waited"], counts  # 0F3 waited for it
    assert counts[-1]["forwards"] == 3, counts  # F0 F1, and F2 raised
    for rank, count in enumerate(counts[:-1]):
        assert count["after_failure"] <= world - rank, (rank, counts)


def test_a_pipeline_steps_again_after_a_failed_step_and_so_does_a_new_one(
        tmp_path: Path) -> None:
    # Before: when rank 0 failed first, the stale abort report of rank 1 made rank 0
    # wait for rank 1's next message before sending its own, and the next step of the
    # same pipeline timed out on both ranks (a deadlock, then a closed connection).
    outcome = launch("pipeline_after_failure", 2, tmp_path, timeout=240, launcher="env")
    assert outcome.returncodes == [0, 0], "\n".join(o[-2000:] for o in outcome.outputs)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for how in ("forward0", "forward", "backward", "loss", "tied"):
        for rank, result in enumerate(results):
            steps = result[how]
            assert isinstance(steps["0.0"], str) and "once" in steps["0.0"], (how, rank, steps)
            for later in ("0.1", "1.0", "1.1"):
                assert isinstance(steps[later], float), (how, rank, later, steps)
        # Every rank reports the step's one loss; a new pipeline starts over the same.
        assert results[0][how]["0.1"] == results[1][how]["0.1"] == results[0][how]["1.1"]


def test_mismatched_shapes_stop_every_rank_naming_the_stage(tmp_path: Path) -> None:
    outcome = launch("fault_shape", 2, tmp_path, timeout=120)
    failing = r"stage 1, layer 3 \(Linear\) failed on micro-batch 0 \(1F0\): RuntimeError: mat1"
    assert_every_rank_stops(outcome, within=60,  # the action once: in the stage's words
                            messages=[r"rank 1 failed \(StageError: " + failing, failing])


def test_a_crash_in_a_distributed_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    from conveyor.train import saving

    outcome = launch("checkpoint_crash", 2, tmp_path, timeout=240)
    assert outcome.returncodes == [0, 0], outcome.outputs
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["step"] == 1
        assert result["optimizer_steps"] and set(result["optimizer_steps"]) == {1.0}
        assert result["loaded"].keys() == result["saved"].keys()
        for name, value in result["saved"].items():
            assert torch.equal(result["loaded"][name], value), (rank, name)
    assert (tmp_path / "run" / "checkpoint" / "latest").read_text() == "step-00000001"
    model, _ = case_model("lm")
    model.load_state_dict(saving.load_weights(tmp_path / "run"))  # every weight, by name
    moments = saving.load_optimizer_state(tmp_path / "run")  # and its optimizer's, whole
    assert set(moments) == {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, parameter in model.named_parameters():
        assert float(moments[name]["step"]) == 1.0, name
        assert {key: value.shape for key, value in moments[name].items()
                if key != "step"} == {"exp_avg": parameter.shape,
                                      "exp_avg_sq": parameter.shape}, name


def test_ranks_started_with_different_pipelines_refuse_naming_each_value(tmp_path: Path) -> None:
    outcome = launch("mismatch", 2, tmp_path, timeout=120)
    assert outcome.returncodes == [0, 0], "\n".join(outcome.outputs)
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "balance is [3, 3] on rank 0 but [2, 4] on rank 1" in found["balance"]
        assert "chunks is 2 on rank 0 but 4 on rank 1" in found["chunks"]
        assert "schedule is 'gpipe' on rank 0 but '1f1b' on rank 1" in found["schedule"]
        assert ("the model differs: parameter 6 is 5.weight [3, 12] float64 on rank 0 but "
                "5.weight [12, 12] float64 on rank 1") in found["model"], found["model"]
        assert float(found["loss"]) > 0  # and a pipeline built alike runs after all that
