"""conveyor.check finds where a pipeline stops matching the plain model: each cause it
knows, planted in a small model, is found in the layer where it was planted, with that
cause; correct models match, Hugging Face's too; the command's exit codes."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.cli import main
from conveyor.errors import BalanceError, ConveyorError
from tests.support import check_cases as cases
from tests.support.extras import require


def test_a_correct_model_matches_with_dropout_under_every_kind_of_schedule() -> None:
    inputs, targets = cases.batch()
    for schedule, balance in (("1f1b", [3, 3]), ("zero-bubble", [2, 2, 2])):
        model = cases.mlp(dropout=0.3)
        state = torch.get_rng_state()
        report = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss,
                                balance=balance, chunks=4, schedule=schedule)
        assert report.ok, str(report)
        assert report.findings == []
        assert "MATCH" in str(report) and "24 layer outputs" in str(report)
        assert torch.equal(torch.get_rng_state(), state)  # the user's random state is kept


def test_batch_norm_normalising_per_microbatch_is_found_in_its_layer() -> None:
    inputs, targets = cases.batch()
    model = cases.mlp(nn.BatchNorm1d(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss, balance=[3, 3],
                            chunks=4)
    first = report.findings[0]
    assert (first.kind, first.stage, first.layer, first.microbatch) == ("forward", 0, "2", 0)
    assert first.max_rel is not None and first.max_rel > 0.1
    assert "batch norm in training mode ('2')" in first.cause
    kinds = [f.kind for f in report.findings]
    assert kinds == ["forward", "loss", "gradient", "buffer"]
    assert "deferred_batch_norm=True" in report.findings[-1].cause
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # untouched
    deferred = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss, balance=[3, 3],
                              chunks=4, deferred_batch_norm=True)
    assert [f.kind for f in deferred.findings] == ["forward", "loss", "gradient"]
    # With dropout in the same layer the plain model must run it per micro-batch too (to
    # draw alike), where its batch norm would match: the batch norm is named all the same.
    random = conveyor.check(cases.mlp(nn.Sequential(nn.BatchNorm1d(8), nn.Dropout(0.2))),
                            inputs, targets, loss_fn=F.mse_loss, balance=[3, 3], chunks=4)
    assert [(f.kind, f.layer) for f in random.findings] == [("forward", "2")]
    assert "draws random numbers" in random.findings[0].cause
    assert "batch norm in training mode ('2.0')" in random.findings[0].cause


def test_a_layer_drawing_from_its_own_generator_matches_recomputed_or_not() -> None:
    inputs, targets = cases.batch()
    model = cases.mlp(nn.Sequential(nn.Identity(), cases.Noise()))
    # Its forwards draw rows in order, as the plain model does; a recomputation replays
    # the generator's state as the forward found it (issue 46), so it draws the same.
    for recompute in ("except_last", "always", "never"):
        report = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss, balance=[2, 4],
                                chunks=4, checkpoint=recompute)
        assert report.ok, str(report)


@pytest.mark.parametrize("through_data", [True, False])
def test_an_inplace_change_of_a_stage_input_is_found(through_data: bool) -> None:
    inputs, targets = cases.batch()
    model = nn.Sequential(cases.HalveInPlace(through_data), nn.Linear(4, 8), nn.Tanh(),
                          nn.Linear(8, 2))
    given = inputs.clone()
    report = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss, balance=[2, 2],
                            chunks=4)
    first = report.findings[0]
    # Through .data the recomputation silently starts from halved values; mul_ makes
    # torch's checkpoint refuse in backward. Either way the layer is named.
    assert first.kind == ("recomputation" if through_data else "error")
    assert (first.stage, first.layer) == (0, "0")
    assert "layer 0 (HalveInPlace) changes its input in place" in first.cause
    assert torch.equal(inputs, given)  # the check ran on copies of the batch


def test_a_layer_reading_state_outside_its_inputs_is_found() -> None:
    inputs, targets = cases.batch()
    report = conveyor.check(cases.mlp(cases.Counter()), inputs, targets, loss_fn=F.mse_loss,
                            balance=[2, 4], chunks=4)
    first = report.findings[0]
    # Micro-batch 0 is its first call in both runs; micro-batch 1 its second.
    assert (first.kind, first.stage, first.layer, first.microbatch) == ("forward", 1, "2", 1)
    assert "'2' gives different outputs for the same input" in first.cause
    assert "2.calls: 0 -> 2" in first.cause
    assert "it reads state outside its inputs and parameters" in first.cause


def test_a_buffer_mutated_in_forward_is_named() -> None:
    inputs, targets = cases.batch()
    report = conveyor.check(cases.mlp(cases.BufferCounter()), inputs, targets,
                            loss_fn=F.mse_loss, balance=[2, 4], chunks=4)
    first = report.findings[0]
    assert (first.kind, first.stage, first.layer, first.microbatch) == ("forward", 1, "2", 1)
    assert "2.count (buffer): 0.0 -> 2.0" in first.cause
    assert "it reads a buffer mutated in forward" in first.cause


class _WritesCount(nn.Module):
    def __init__(self, count: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("count", count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x


class _ReadsCount(_WritesCount):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.count


def test_a_buffer_shared_across_stages_is_named_as_such() -> None:
    inputs, targets = cases.batch()
    count = torch.zeros((), dtype=torch.float64)  # one object, held by a layer of each stage
    model = nn.Sequential(nn.Linear(inputs.shape[1], 4), _WritesCount(count),
                          _ReadsCount(count), nn.Linear(4, targets.shape[1])).double()
    report = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss, balance=[2, 2],
                            chunks=2)
    first = report.findings[0]
    assert (first.kind, first.stage) == ("forward", 1)
    assert first.cause.startswith("state shared across stages: one tensor object held as "
                                  "1.count (stage 0) and 2.count (stage 1)")


def test_a_tie_the_pipeline_cannot_see_is_found_and_a_visible_one_matches() -> None:
    inputs, targets = cases.batch(outputs=4)
    report = conveyor.check(cases.tied_by_a_list(), inputs, targets, loss_fn=F.mse_loss,
                            balance=[2, 2], chunks=4)
    first = report.findings[0]
    # The forward matches (each rank's copy holds equal values); the gradient of
    # layer 0's weight lacks the head's share, which went into stage 1's copy.
    assert (first.kind, first.stage, first.layer, first.name) == (
        "gradient", 0, "0", "0.weight")
    assert "layer 3 (TiedHead) on stage 1 uses '0.weight'" in first.cause
    assert "through 3.sources[0].weight" in first.cause and "tie_weights" in first.cause
    visible = conveyor.check(cases.tied_as_parameters(), inputs, targets, loss_fn=F.mse_loss,
                             balance=[2, 2], chunks=4)
    assert visible.ok, str(visible)


def test_a_tie_a_layer_function_does_not_declare_is_found() -> None:
    inputs, targets = cases.batch(outputs=4)
    layers = dict(enumerate(cases.tied_as_parameters()))  # one weight in layers 0 and 3
    undeclared = conveyor.check(layers.__getitem__, inputs, targets, layers=4,
                                loss_fn=F.mse_loss, balance=[2, 2], chunks=4)
    first = undeclared.findings[0]
    assert (first.kind, first.layer, first.count) == ("gradient", "0", 2)
    assert "pass tie_weights=[('0.weight', '3.weight')]" in first.cause
    declared = conveyor.check(layers.__getitem__, inputs, targets, layers=4,
                              loss_fn=F.mse_loss, balance=[2, 2], chunks=4,
                              tie_weights=[("0.weight", "3.weight")])
    assert declared.ok, str(declared)


def test_a_loss_averaged_per_microbatch_is_found_and_a_summed_pair_matches() -> None:
    model, ids, targets = cases.padded_tokens()
    report = conveyor.check(model, ids, targets, loss_fn=cases.mean_token_loss,
                            balance=[2, 1], chunks=4)
    assert [f.kind for f in report.findings] == ["loss", "gradient"]
    assert "(loss_sum, count)" in report.findings[0].cause
    assert report.findings[1].cause == "follows from the loss difference above"
    pair = conveyor.check(model, ids, targets, loss_fn=cases.summed_token_loss,
                          balance=[2, 1], chunks=4)
    assert pair.ok, str(pair)


def test_a_traced_model_names_the_submodule_and_matches_in_eval_mode() -> None:
    model = cases.Convolutions()
    inputs, targets = torch.randn(6, 2, 5, 5), torch.randn(6, 1, 5, 5)
    report = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss, split_at=["body"],
                            chunks=2)
    first = report.findings[0]
    assert (first.kind, first.stage, first.layer) == ("forward", 1, "body.norm")
    assert "the model's output (stage 1), micro-batch 0" in str(first)
    model.eval()  # batch norm by its running statistics (was: the stages ran in training)
    evaluated = conveyor.check(model, inputs, targets, loss_fn=F.mse_loss,
                               split_at=["body"], chunks=2)
    assert evaluated.ok, str(evaluated)


def test_a_hugging_face_model_with_dropout_matches() -> None:
    transformers = require("transformers")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere, in training
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (6, 5), generator=generator)
    targets = torch.randint(0, 50, (6, 5), generator=generator)

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())

    report = conveyor.check(model, {"input_ids": ids, "use_cache": False}, targets,
                            loss_fn=loss, split_at=["transformer.h.1"], chunks=3,
                            schedule="1f1b")
    assert report.ok, str(report)
    assert report.setup.startswith("2 stages, split at ['transformer.h.1'], 1f1b")


def test_under_torchrun_the_check_still_runs_every_stage_in_its_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; no process group exists
    monkeypatch.setenv("RANK", "1")
    inputs, targets = cases.batch()
    report = conveyor.check(cases.mlp(), inputs, targets, loss_fn=F.mse_loss, stages=2,
                            chunks=2)
    assert report.ok, str(report)
    assert not torch.distributed.is_initialized()


def test_options_that_do_not_fit_raise() -> None:
    inputs, targets = cases.batch()
    with pytest.raises(BalanceError, match="give stages="):
        conveyor.check(cases.mlp(), inputs, targets, loss_fn=F.mse_loss, chunks=2)
    with pytest.raises(ConveyorError, match="cannot be split into 20 micro-batches"):
        conveyor.check(cases.mlp(), inputs, targets, loss_fn=F.mse_loss, stages=2, chunks=20)


def test_the_command_exits_0_on_a_match_1_on_a_difference_2_on_bad_usage(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "tests.support.check_cases:matching",
                 "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "balance [3, 3]" in out and "MATCH" in out
    assert main(["check", "--model", "tests.support.check_cases:batch_norm",
                 "--stages", "2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["findings"][0]["layer"] == "2"
    for argv, message in (
            (["--model", "tests.support.check_cases"], "give package.module:function"),
            (["--model", "tests.nowhere:f"], "cannot import tests.nowhere"),
            (["--model", "tests.support.check_cases:returns_a_model",
              "--stages", "2"],
             "returned Sequential; return (model, inputs, targets"),
            (["--model", "tests.support.check_cases:batch_norm",
              "--balance", "2,x"],
             "--balance 2,x: give comma-separated values"),
            (["--model", "tests.support.check_cases:batch_norm",
              "--balance", "3,4"],
             "covers 7 layers but the model has 6")):
        assert main(["check", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("conveyor check: error: ") and message in err, err


def test_train_check_runs_before_training_and_is_not_saved(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.cli.main import build_parser
    from conveyor.checking.compare import Finding
    from conveyor.checking.report import CheckReport
    from conveyor.train import checkstep
    from conveyor.train.options import TrainConfig, from_arguments

    args = build_parser().parse_args(["train", "--check", "--out", str(tmp_path)])
    assert args.check and "check" not in dataclasses.asdict(from_arguments(args))
    config = TrainConfig(layers=1, width=16, hidden=32, heads=2, length=8, batch=4, chunks=2,
                         dropout=0.1, out=str(tmp_path))
    checkstep.check_first_step(config)
    assert "MATCH" in capsys.readouterr().out
    monkeypatch.setattr(checkstep, "check", lambda *a, **k: CheckReport(
        "planted", "nothing", [Finding("loss", "the step", cause="planted")]))
    with pytest.raises(ConveyorError, match="--check: the pipeline does not compute"):
        checkstep.check_first_step(config)
    assert not (tmp_path / "options.json").exists()


class EncoderDecoder(nn.Module):
    """An encoder whose state every decoder block reads and the model returns beside the
    logits (as T5 and BART return ``encoder_last_hidden_state``); its blocks are where
    ``stages=K`` cuts it."""

    def __init__(self, width: int = 8, blocks: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        e = torch.tanh(self.encoder(x))
        h = e
        for block in self.blocks:
            h = torch.tanh(block(h)) * e
        return {"logits": self.head(h), "encoder_last_hidden_state": e}


def logits_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"], y)


def encoder_decoder() -> dict[str, Any]:
    """What ``conveyor check --model tests.test_check:encoder_decoder`` checks."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    return {"model": EncoderDecoder(), "inputs": torch.randn(8, 8, generator=generator),
            "targets": torch.randint(0, 3, (8,), generator=generator),
            "loss_fn": logits_loss}


def encoder_decoder_sample() -> tuple[nn.Module, torch.Tensor]:
    """What ``conveyor plan --model tests.test_check:encoder_decoder_sample`` plans."""
    made = encoder_decoder()
    return made["model"], made["inputs"][:2]


def _counted_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reintroduces the defect fixed in the engine (tests/test_bugs.py): the loss reads
    the last stage's outputs themselves, so a split backward of a recomputed micro-batch
    starts from their total gradients, and what flows into the encoder's state through
    the decoder counts twice. (A loss recomputed with the stage reads no views: the
    loss is kept apart, as conveyor.VocabParallelCrossEntropy's.)"""
    import conveyor.engine.actions

    monkeypatch.setattr(conveyor.engine.actions, "_read_apart", lambda outputs: outputs)
    monkeypatch.setattr(conveyor.engine.actions, "recomputed_with_stage", lambda _: False)


def test_a_returned_value_counted_twice_by_split_backward_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made = encoder_decoder()
    options = dict(loss_fn=logits_loss, stages=2, chunks=4, recompute="always")
    exact = conveyor.check(made["model"], made["inputs"], made["targets"],
                           schedule="zero-bubble", **options)
    assert exact.ok, str(exact)
    assert exact.setup.startswith("2 stages, split at ['blocks.2'], zero-bubble")
    _counted_twice(monkeypatch)
    report = conveyor.check(made["model"], made["inputs"], made["targets"],
                            schedule="zero-bubble", **options)
    first = report.findings[0]
    assert (first.kind, first.stage, first.name) == ("gradient", 0, "encoder.weight"), report
    assert re.fullmatch(
        r"stage 0's output \['encoder_last_hidden_state'\] reaches the model's output "
        r"directly and its gradient was counted twice under split backward with "
        r"recomputation \(the gradients upstream of it are 1\.\d+x the plain model's\).*"
        r"Run with recompute='never' or schedule='1f1b'.*", first.cause), first.cause
    # The other causes keep their words: a full backward is exact, with the defect too.
    assert conveyor.check(made["model"], made["inputs"], made["targets"],
                          schedule="1f1b", **options).ok


def test_check_cuts_any_module_among_its_blocks_as_pipeline_does(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "tests.test_check:encoder_decoder", "--stages", "2",
                 "--sample", "2", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "2 stages, split at ['blocks.2'], 1f1b, 4 micro-batches" in out and "MATCH" in out
    assert main(["check", "--model", "tests.test_check:encoder_decoder", "--stages", "3",
                 "--balance", "time", "--recompute", "never", "--json"]) == 0
    setup = json.loads(capsys.readouterr().out)["setup"]
    assert re.match(r"3 stages, split at \['blocks\.\d', 'blocks\.\d'\], gpipe, 4 "
                    r"micro-batches, recompute 'never'", setup), setup
    assert main(["check", "--model", "tests.test_check:encoder_decoder", "--stages", "5"]) == 2
    assert "'blocks' holds 4 blocks, fewer than the 5 stages" in capsys.readouterr().err


def _llama(length: int) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """A tiny Llama (its RMSNorm and rotary table compute in float32 inside a float64
    model) and a batch of ``length`` tokens."""
    transformers = require("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=64))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (4, length), generator=generator)
    return model, {"input_ids": ids}, torch.randint(3, 64, (4, length), generator=generator)


def test_float32_inside_a_float64_model_is_judged_against_its_own_noise_floor() -> None:
    """At 12 tokens a (loss_sum, count) loss's count is 24 per micro-batch: the pipeline
    seeds backward with the sum and divides by 48 after, the plain model seeds 1/48; the
    gradients reaching the float32 RMSNorm round one float32 ulp apart (was: DIFFERS at
    1.1e-7 relative, blaming a custom backward)."""
    from conveyor.cli.checking import default_loss

    model, inputs, targets = _llama(12)
    report = conveyor.check(model, inputs, targets, loss_fn=default_loss, stages=2, chunks=2)
    assert report.ok, str(report)
    assert report.floor.elevated and 1e-9 < report.floor.relative < 1e-5
    assert "float32 inside the model" in str(report) and "LlamaRMSNorm" in str(report)
    assert report.rtol == pytest.approx(10 * report.floor.relative)
    plain = conveyor.check(cases.mlp(), *cases.batch(), loss_fn=F.mse_loss, balance=[3, 3],
                           chunks=4)
    assert not plain.floor.elevated and plain.rtol == 1e-7  # float64 throughout


def test_a_defect_is_still_found_above_the_noise_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the last micro-batch's gradient kept: found, though the floor is float32's."""
    from conveyor.cli.checking import default_loss
    from conveyor.engine.actions import StageActions

    original = StageActions.backward_one

    def last_only(self: StageActions, microbatch: int, *args: Any, **kwargs: Any) -> Any:
        for param in self.trainable_parameters():
            param.grad = None
        return original(self, microbatch, *args, **kwargs)

    monkeypatch.setattr(StageActions, "backward_one", last_only)
    model, inputs, targets = _llama(11)
    report = conveyor.check(model, inputs, targets, loss_fn=default_loss, stages=2, chunks=2)
    assert not report.ok and report.floor.elevated
    first = report.findings[0]
    assert first.kind == "gradient" and first.max_rel is not None and first.max_rel > 0.05
