"""conveyor.integrations.transformers: a Trainer script pipelined gives the plain
Trainer's losses, clipped norms and weights (float64, GPT-2 with a tied head, gradient
accumulation and clipping), evaluates alike, saves a model directory and resumes from
its checkpoint bit-exact; in one process (stages on threads) and under torchrun."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.support import hf_trainer as runs  # noqa: E402
from tests.support.launch import launch  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return runs.plain(tmp_path_factory.mktemp("plain"))


def _same_weights(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert got and set(got) <= set(expected)
    worst = max(float((expected[k] - v).abs().max()) for k, v in got.items())
    assert worst < 1e-11, worst


def _same_history(expected: list[tuple[float, float]], got: list[tuple[float, float]]) -> None:
    assert len(got) == len(expected) == runs.ARGS["max_steps"]
    assert [g[0] for g in got] == pytest.approx([e[0] for e in expected], rel=1e-6)
    # the pipeline's global norm is a float32 tensor; it clips by its float64 value
    assert [g[1] for g in got] == pytest.approx([e[1] for e in expected], rel=1e-6)
    assert max(e[1] for e in expected) > 2 * runs.ARGS["max_grad_norm"]  # clipping acts


@pytest.mark.timeout(300)  # three Trainer runs on GPT-2 (the reference in the fixture)
def test_the_pipelined_trainer_is_the_plain_one(reference: Any, tmp_path: Path) -> None:
    trainer = runs.pipelined(tmp_path / "run", save_strategy="steps", save_steps=2)
    _same_history(runs.history(reference), runs.history(trainer))
    _same_weights(reference.model.state_dict(), trainer.pipe.state_dict())
    assert trainer.evaluate()["eval_loss"] == pytest.approx(
        reference.evaluate()["eval_loss"], rel=1e-12)

    # save_model: a model directory from_pretrained loads, the pipeline's weights
    trainer.save_model()  # into the run's folder, beside its checkpoints
    loaded = runs.quiet().GPT2LMHeadModel.from_pretrained(tmp_path / "run",
                                                          dtype=torch.float64)
    for name, value in trainer.pipe.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    # resumed from its step-2 checkpoint, the run ends where the whole run ended
    resumed = runs.pipelined(tmp_path / "again", resume=str(tmp_path / "run" / "checkpoint-2"))
    for name, value in trainer.pipe.state_dict().items():
        assert torch.equal(resumed.pipe.state_dict()[name], value), name
    assert runs.history(resumed) == runs.history(trainer)  # the first two from the checkpoint


@pytest.mark.timeout(400)
def test_under_torchrun_two_stages_by_two_replicas(tmp_path: Path) -> None:
    """Four processes: each replica reads its own half of the data; together they are
    the plain Trainer with batches twice as large. The same launch saves the model (read
    back by from_pretrained) and resumes from a checkpoint bit-exact."""
    outcome = launch("", 4, tmp_path, launcher="torchrun", timeout=360,
                     module="tests.support.hf_trainer", args=[str(tmp_path), "2"])
    assert outcome.returncodes == [0], outcome.outputs[0][-6000:]
    reference = runs.plain(tmp_path / "plain", replicas=2)
    expected = reference.model.state_dict()
    held: dict[str, torch.Tensor] = {}
    for rank in range(4):
        weights = torch.load(tmp_path / f"weights{rank}.pt")
        _same_weights(expected, weights)
        held.update(weights)
        logged = json.loads((tmp_path / f"history{rank}.json").read_text())
        _same_history(runs.history(reference), [tuple(h) for h in logged["history"]])
        assert logged["eval_loss"] == pytest.approx(reference.evaluate()["eval_loss"],
                                                    rel=1e-12)
        assert logged["resumed_exactly"] is True
        assert logged["resumed_history"] == logged["history"]
    assert set(held) == set(expected)  # the two stages hold the whole model
    loaded = runs.quiet().GPT2LMHeadModel.from_pretrained(tmp_path / "run",
                                                          dtype=torch.float64)
    for name, value in held.items():
        assert torch.equal(loaded.state_dict()[name], value), name


@pytest.mark.parametrize("given, match", [
    ({"pipeline": {"stages": 2, "loss_fn": runs.loss64}}, "the trainer's loss is the model's"),
    ({"pipeline": {"stages": 2}, "label_smoothing_factor": 0.1}, "label_smoothing_factor")])
def test_what_the_pipeline_cannot_keep_is_refused(given: dict[str, Any], match: str,
                                                  tmp_path: Path) -> None:
    from conveyor import ConfigError
    from conveyor.integrations.transformers import PipelineTrainer

    smoothing = given.pop("label_smoothing_factor", 0.0)
    with pytest.raises(ConfigError, match=match):
        PipelineTrainer(model=runs.gpt2(), train_dataset=runs.tokens(8),
                        args=runs.arguments(tmp_path, label_smoothing_factor=smoothing),
                        **given)
