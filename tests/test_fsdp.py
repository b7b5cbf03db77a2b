"""FSDP2 under the pipeline: 2 stages x 2 shards equal the plain model on the global
batch (float64, gloo on 127.0.0.1), and a checkpoint resumes at another data-parallel
size. One launch of 4 processes checks most things (tests/support/scenarios/fsdp.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.cases import case_batch, case_model, padded_batch, plain_token_loss
from tests.support.launch import launch
from tests.support.models import relative_error
from tests.support.scenarios.fsdp import BATCH, CLIP, LR

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp")
    outcome = launch("fsdp", 4, out, timeout=400)
    assert outcome.returncodes == [0] * 4, "\n".join(outcome.outputs)
    return out, [torch.load(out / f"rank{r}.pt") for r in range(4)]


def _merged(results: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result[key])
    return merged


def _plain_step(name: str) -> tuple[torch.nn.Module, float]:
    model, loss_fn = case_model(name)
    x, y = case_batch(name, batch=BATCH)
    loss = loss_fn(model(x), y)
    loss.backward()
    return model, loss.item()


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  label: str, tolerance: float = 1e-10) -> None:
    assert sorted(got) == sorted(expected), label  # both copies of a tied weight too
    for name, tensor in expected.items():
        assert relative_error(got[name], tensor) <= tolerance, f"{label}: {name}"


def test_every_replica_holds_half_of_its_stage(sharded) -> None:  # type: ignore[no-untyped-def]
    _, results = sharded
    assert [r["fraction"] for r in results] == [0.5] * 4


#: The schedules of the shared launch: W's gradients of a split backward (zero-bubble,
#: zb-v) accumulate in the gathered parameters and are reduce-scattered as B's are.
SHARDED_SCHEDULES = ["gpipe", "interleaved-1f1b", "zero-bubble", "zb-v"]


@pytest.mark.parametrize("schedule", SHARDED_SCHEDULES)
def test_sharded_schedules_equal_the_plain_model(sharded, schedule: str) -> None:  # type: ignore[no-untyped-def]
    _, results = sharded
    model, loss = _plain_step("mlp")
    for result in results:
        assert abs(float(result[f"{schedule}-loss"]) - loss) <= 1e-12 * loss
    expected = {n: p.grad for n, p in model.named_parameters()}
    _assert_close(_merged(results, f"{schedule}-grads"), expected, schedule)
    x, _ = case_batch("mlp", batch=BATCH)
    with torch.no_grad():  # eval_step: the last stage's ranks hold their replica's output
        for rank, result in enumerate(results):
            output = result[f"{schedule}-eval"]
            last = rank < 2 if schedule == "zb-v" else rank >= 2  # a V ends on rank 0
            assert (output is not None) == last, rank
            if output is not None:
                assert relative_error(output, model(x[rank % 2::2])) <= 1e-12
            assert result[f"{schedule}-gathered"] == 0, rank  # sharded again after it


def test_gradients_are_reduce_scattered_once_per_step(sharded) -> None:  # type: ignore[no-untyped-def]
    _, results = sharded
    for result in results:  # 2 micro-batches, one reduce-scatter per layer all the same
        for schedule in SHARDED_SCHEDULES:
            counted = result[f"{schedule}-collectives"]
            assert counted["units"] >= 2
            assert counted["reduce_scatter_single"] == counted["units"], schedule
        # 1F1B-like schedules keep the parameters gathered from the first forward on;
        # GPipe frees them after each forward and gathers again (each micro-batch).
        for schedule in SHARDED_SCHEDULES[1:]:
            kept = result[f"{schedule}-collectives"]
            assert kept["all_gather_single"] == kept["units"], schedule
        gpipe = result["gpipe-collectives"]
        assert gpipe["all_gather_single"] >= 3 * gpipe["units"]


def test_tied_lm_token_loss_clipping_and_adamw_equal_the_plain_model(sharded) -> None:  # type: ignore[no-untyped-def]
    _, results = sharded
    model, loss = _plain_step("lm")
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(abs(float(r["loss"]) - loss) <= 1e-12 * loss for r in results)
    _assert_close(_merged(results, "grads"), {n: p.grad for n, p in params.items()}, "1f1b")
    x, y = padded_batch(batch=BATCH)  # replica 1's share holds more padding
    token = plain_token_loss(model(x), y)
    token.backward()  # added to the first batch's gradients
    assert all(abs(float(r["token_loss"]) - token.item()) <= 1e-10 * token.item()
               for r in results)
    _assert_close(_merged(results, "accumulated"), {n: p.grad for n, p in params.items()},
                  "accumulated")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    assert float(norm) > 10 * CLIP  # the clip bites
    assert all(abs(float(r["norm"]) - float(norm)) <= 1e-6 * float(norm) for r in results)
    _assert_close(_merged(results, "clipped"), {n: p.grad for n, p in params.items()},
                  "clipped")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.step()
    # Adam's first step divides each gradient by its size plus 1e-8: an element near
    # zero turns the roundoff of a sum over micro-batches into up to 3e-7 of the
    # weights (torch 2.14.1). Its moments, the gradients themselves, are held to 1e-10.
    _assert_close(_merged(results, "stepped"), {n: p.detach() for n, p in params.items()},
                  "AdamW", tolerance=1e-6)
    moments = {n: optimizer.state[p]["exp_avg"] for n, p in params.items()}
    _assert_close(_merged(results, "moments"), moments, "exp_avg")


def test_a_nan_loss_raises_on_every_rank_and_leaves_the_shards_clean(sharded) -> None:  # type: ignore[no-untyped-def]
    _, results = sharded
    for rank, result in enumerate(results):
        assert "loss of micro-batch 1 is nan" in result["nan"], rank
        assert set(result["after_nan"].values()) == {("DTensor", True)}, rank
        assert result["unsharded_grads"] == 0, rank
        assert "is tied or shared with another module" in result["traced"], rank


def test_a_gradient_nan_in_one_replica_s_shard_is_refused_on_every_rank(sharded) -> None:  # type: ignore[no-untyped-def]
    """Each rank checks its own shard (no collective per gradient); the flags reach
    every rank, and the rank that found it names the parameter."""
    _, results = sharded
    errors = [result["nan_gradient"] for result in results]
    assert all(e.startswith("NonFiniteGradientError: the gradients of stage 0")
               for e in errors), errors
    assert sum("stage 0 (0.weight)" in e for e in errors) == 1, errors


def test_fp16_loss_scaling_reads_each_shard_and_drops_an_overflow_everywhere(sharded) -> None:  # type: ignore[no-untyped-def]
    """float16 on FSDP: each rank unscales its shards and the ranks agree on an overflow
    that only one shard holds."""
    _, results = sharded
    for rank, result in enumerate(results):
        found = result["fp16_overflow"]
        assert found["kept"] == {"found_inf": False, "scale": 2.0**16}, rank
        assert found["found_inf"] and found["scale"] == 2.0**15, rank
        assert found["grads_none"], rank  # the dropped step's gradients: not kept


def test_a_traced_llama_shards_each_module_its_graph_reads(sharded) -> None:  # type: ignore[no-untyped-def]
    """split_at, zero-bubble, 2 stages x 2 FSDP replicas: the plain model's gradients."""
    _, results = sharded
    for rank, result in enumerate(results):
        worst, count, _ = result["traced-llama"]
        assert count >= 10 and worst <= 1e-10, (rank, worst)


def test_save_pretrained_gathers_each_stage_s_shards_and_writes_the_tie_once(
        sharded) -> None:  # type: ignore[no-untyped-def]
    """2 stages x 2 replicas under FSDP: the model directory holds the stepped weights,
    whole, by plain names, one file per stage; the tied head is written once."""
    import json

    from safetensors.torch import load_file

    out, results = sharded
    stepped = _merged(results, "stepped")
    index = json.loads((out / "exported" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    exported: dict[str, torch.Tensor] = {}
    for file in files:
        exported.update(load_file(out / "exported" / file))
    assert sorted(exported) == sorted(index["weight_map"])
    assert len(set(stepped) - set(exported)) == 1  # the tie: once
    for name, value in exported.items():
        assert torch.equal(value, stepped[name]), name


def test_a_sharded_checkpoint_resumes_on_one_replica(sharded) -> None:  # type: ignore[no-untyped-def]
    out, results = sharded
    outcome = launch("fsdp_resume", 2, out, timeout=240)
    assert outcome.returncodes == [0] * 2, "\n".join(outcome.outputs)
    saved_params = _merged(results, "stepped")
    saved_moments = _merged(results, "moments")
    resumed = [torch.load(out / f"resume-rank{r}.pt") for r in range(2)]
    for sharding in ("fsdp", "replicate"):
        assert [r[sharding]["step"] for r in resumed] == [1, 1]
        params = {k: v for r in resumed for k, v in r[sharding]["params"].items()}
        moments = {k: v for r in resumed for k, v in r[sharding]["moments"].items()}
        assert sorted(params) == sorted(saved_params)
        for name, value in saved_params.items():
            assert torch.equal(params[name], value), f"{sharding}: {name}"
            assert torch.equal(moments[name], saved_moments[name]), f"{sharding}: {name}"


def test_what_fsdp_cannot_run_is_refused_with_the_way_out() -> None:
    import conveyor
    from conveyor.errors import ConveyorError

    model, loss_fn = case_model("mlp")
    common: dict[str, Any] = {"stages": 2, "chunks": 2, "loss_fn": loss_fn}
    with pytest.raises(ConveyorError, match=r"sharding='zero3' .* use 'replicate'"):
        conveyor.Pipeline(model, sharding="zero3", **common)
    with pytest.raises(ConveyorError, match="launch with torchrun"):
        conveyor.Pipeline(model, sharding="fsdp", **common)


@pytest.mark.timeout(400)
def test_conveyor_train_shard_matches_threads_and_resumes_on_one_replica(
        tmp_path: Path) -> None:
    """``conveyor train --shard``: 2 stages x 2 shards, then resumed by 2 stages x 1;
    the losses of one process (threads, whole copies), trained and resumed the same way."""
    import json
    import sys

    from tests.support.launch import run_command
    from tests.support.training import TINY, train

    def losses(out: Path) -> list[float]:
        summary = json.loads((out / "summary.json").read_text())
        return [entry["loss"] for entry in summary["history"]]

    def torchrun(processes: int, *flags: str) -> str:
        result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", str(processes), "-m", "conveyor", "train",
                              *TINY, "--out", str(tmp_path / "sharded"), *flags])
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    shown = torchrun(4, "--data-parallel", "2", "--shard", "--steps", "3")
    assert "2 stages x 2 shards (FSDP)" in shown
    assert train(tmp_path / "threads", "--steps", "3") == 0
    assert losses(tmp_path / "sharded") == pytest.approx(losses(tmp_path / "threads"),
                                                         rel=1e-5)
    shown = torchrun(2, "--data-parallel", "1", "--steps", "4", "--resume")
    assert "resuming at step 3" in shown
    assert train(tmp_path / "threads", "--steps", "4", "--resume") == 0
    resumed = losses(tmp_path / "sharded")
    assert len(resumed) == 4
    assert resumed == pytest.approx(losses(tmp_path / "threads"), rel=1e-5)


def test_shard_in_one_process_says_to_launch_processes(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.cli import main
    from tests.support.training import TINY

    assert main(["train", *TINY, "--out", str(tmp_path / "run"), "--shard"]) == 2
    assert "--shard shards each stage over its data-parallel processes: launch 2 with " \
           "torchrun" in capsys.readouterr().err
    assert main(["train", *TINY, "--out", str(tmp_path / "run"), "--shard",
                 "--schedule", "zero-bubble"]) == 2  # split backwards shard too
    assert "launch 2 with torchrun" in capsys.readouterr().err
