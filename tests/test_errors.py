"""Bad input gets a clear error that names what is wrong; a failing stage never hangs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.support.any_models import quiet_transformers
from tests.support.models import mlp


def model8() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])


def test_balance_must_cover_every_layer() -> None:
    with pytest.raises(conveyor.BalanceError,
                       match=r"balance \[3, 4\] covers 7 layers but the model has 8"):
        conveyor.GPipe(model8(), [3, 4], devices=["cpu", "cpu"])


@pytest.mark.parametrize("entry", [0, -2])
def test_balance_entries_must_be_positive(entry: int) -> None:
    with pytest.raises(conveyor.BalanceError,
                       match=rf"stage 1 has {entry} layers; every stage needs a positive"):
        conveyor.GPipe(model8(), [8, entry], devices=["cpu", "cpu"])


def test_more_stages_than_layers() -> None:
    with pytest.raises(conveyor.BalanceError,
                       match=r"asks for 9 stages but the model has only 8 layers"):
        conveyor.GPipe(model8(), [1] * 9, devices=["cpu"] * 9)
    with pytest.raises(conveyor.BalanceError, match=r"cannot cut 8 layers into 9 stages"):
        conveyor.balance.balance_by_params(model8(), 9)


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="this machine has a cuda:7")
def test_a_cuda_device_that_is_not_here_is_named() -> None:
    """Not torch's 'Torch not compiled with CUDA enabled' assertion: the CLI's sentence."""
    for devices in (["cuda:0", "cuda:7"], ["cuda", "cuda"]):
        wanted = "cuda:7" if torch.cuda.is_available() else "cuda(:0)?"
        with pytest.raises(conveyor.BalanceError, match=rf"devices=: there is no {wanted} here \("):
            conveyor.Pipeline(model8(), balance=[4, 4], devices=devices, chunks=2,
                              loss_fn=torch.nn.functional.mse_loss)
        if torch.cuda.is_available():
            break


def test_devices_must_match_balance() -> None:
    with pytest.raises(conveyor.BalanceError,
                       match=r"devices lists 3 devices but balance has 2 stages"):
        conveyor.GPipe(model8(), [4, 4], devices=["cpu"] * 3)


def test_module_must_be_sequential() -> None:
    with pytest.raises(TypeError, match=r"pipelines an nn.Sequential, got Linear"):
        conveyor.GPipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -1, 2.5])
def test_chunks_must_be_a_positive_integer(chunks: object) -> None:
    with pytest.raises(conveyor.MicroBatchError, match=r"chunks must be a positive integer"):
        conveyor.GPipe(model8(), [8], devices=["cpu"], chunks=chunks)  # type: ignore[arg-type]


def test_unknown_checkpoint_mode() -> None:
    with pytest.raises(ValueError, match=r"checkpoint='sometimes' is not a recompute mode; "
                                         r"use one of 'always', 'except_last', 'never'"):
        conveyor.GPipe(model8(), [8], devices=["cpu"], checkpoint="sometimes")


def test_a_training_step_with_fewer_samples_than_chunks() -> None:
    """(Inference runs such a batch as fewer micro-batches: tests/test_microbatch.py.)"""
    pipe = conveyor.Pipeline(model8(), balance=[4, 4], devices=["cpu"] * 2, chunks=4,
                             loss_fn=nn.functional.mse_loss)
    with pytest.raises(conveyor.MicroBatchError,
                       match=r"a batch of 3 samples cannot be split into 4 micro-batches; "
                             r"use chunks <= 3"):
        pipe.step(torch.randn(3, 4), torch.randn(3, 4))


class Returns(nn.Module):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> object:
        return self.value


@pytest.mark.parametrize(
    ("value", "shown"),
    [("text", r"returned str on micro-batch 0"),
     (3, r"returned int on micro-batch 0"),
     ((torch.zeros(1), "x"), r"returned str \(at output\[1\]\) on micro-batch 0")],
)
def test_layer_returning_a_non_tensor(value: object, shown: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Returns(value), nn.Linear(4, 4))
    pipe = conveyor.GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(conveyor.LayerOutputError,
                       match=rf"stage 1, layer 2 \(Returns\) {shown}; a layer must return "
                             r"a tensor or a tuple/list/dict of tensors"):
        pipe(torch.randn(4, 4))


class FailsOn(nn.Module):
    """Raises on the micro-batch whose first value is the marker."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == 1234.0).any()):
            raise ValueError("bad sample")
        return x


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stages", [2, 4])
def test_layer_raising_mid_pipeline_names_stage_layer_and_micro_batch(stages: int) -> None:
    layers = [nn.Identity(), nn.Identity(), FailsOn(), nn.Identity()]
    pipe = conveyor.GPipe(nn.Sequential(*layers), [4 // stages] * stages,
                          devices=["cpu"] * stages, chunks=4)
    x = torch.zeros(8, 3)
    x[5, 0] = 1234.0  # micro-batch 2 (samples 4 and 5)
    stage = 2 * stages // 4
    with pytest.raises(conveyor.StageError,
                       match=rf"stage {stage}, layer 2 \(FailsOn\) failed on micro-batch 2 \({stage}F2\): "
                             r"ValueError: bad sample") as caught:
        pipe(x)
    assert (caught.value.stage, caught.value.microbatch, caught.value.layer) == (stage, 2, 2)
    assert isinstance(caught.value.__cause__, ValueError)
    # The pipeline is usable again after the failure.
    assert pipe(torch.zeros(8, 3)).shape == (8, 3)


class FailsWhileArmed(nn.Module):
    """Raises on every forward while ``armed`` (noting its thread, then setting
    ``raised``); the identity once disarmed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True
        self.raised = threading.Event()
        self.thread: threading.Thread | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.thread = threading.current_thread()
            self.raised.set()
            raise ValueError("injected failure")
        return x


class CountsForwards(nn.Module):
    """The identity, counting its forwards (recomputations aside). While ``gated``, the
    second forward first waits until ``failing`` has raised and its rank's thread has
    ended: by then that rank has aborted the step, so whatever stage 0 runs later ran
    after the abort. ``waited`` says the wait happened (an error here would be lost
    behind stage 1's)."""

    def __init__(self, failing: FailsWhileArmed) -> None:
        super().__init__()
        self.failing = [failing]  # in a list: not a submodule of this layer
        self.calls = 0
        self.gated = True
        self.waited = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not conveyor.is_recomputing():
            self.calls += 1
        failing = self.failing[0]
        if self.gated and self.calls == 2 and failing.raised.wait(10):
            assert failing.thread is not None
            failing.thread.join(10)
            self.waited = not failing.thread.is_alive()
        return x


def _run_gpipe(pipe: conveyor.GPipe, x: torch.Tensor) -> None:
    pipe(x).sum().backward()


def _run_gpipe_no_grad(pipe: conveyor.GPipe, x: torch.Tensor) -> None:
    with torch.no_grad():
        pipe(x)


def _run_step(pipe: conveyor.Pipeline, x: torch.Tensor) -> None:
    pipe.step(x, torch.zeros_like(x))


def _run_eval_step(pipe: conveyor.Pipeline, x: torch.Tensor) -> None:
    pipe.eval_step(x)


Build = Callable[[nn.Sequential], nn.Module]
RUNS: dict[str, tuple[Build, Callable[[Any, torch.Tensor], None]]] = {
    "GPipe": (lambda model: conveyor.GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=16),
              _run_gpipe),
    "GPipe no_grad": (lambda model: conveyor.GPipe(model, [2, 2], devices=["cpu"] * 2,
                                                   chunks=16), _run_gpipe_no_grad),
    "Pipeline step": (lambda model: conveyor.Pipeline(
        model, stages=2, devices=["cpu"] * 2, chunks=16, balance=[2, 2], schedule="gpipe",
        loss_fn=nn.functional.mse_loss), _run_step),
    "Pipeline eval_step": (lambda model: conveyor.Pipeline(
        model, stages=2, devices=["cpu"] * 2, chunks=16, balance=[2, 2], schedule="gpipe",
        loss_fn=nn.functional.mse_loss), _run_eval_step),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("face", list(RUNS))
def test_a_failing_stage_stops_the_others_before_their_next_action(face: str) -> None:
    # GPipe order: stage 0 runs 0F0 ... 0F15 without waiting for stage 1, so only an
    # abort checked before each action stops it. Stage 1 fails in 1F0, which needs 0F0
    # alone; 0F1, if the abort has not stopped stage 0 already, waits until rank 1 has
    # stopped; 0F2 must not start.
    failing = FailsWhileArmed()
    counter = CountsForwards(failing)
    model = nn.Sequential(nn.Linear(4, 4), counter, failing, nn.Linear(4, 4))
    build, run = RUNS[face]
    pipe = build(model)
    x = torch.randn(16, 4)
    with pytest.raises(conveyor.StageError,
                       match=r"stage 1, layer 2 \(FailsWhileArmed\) failed on micro-batch 0 \(1F0\): "
                             r"ValueError: injected failure") as caught:
        run(pipe, x)
    assert (caught.value.stage, caught.value.microbatch) == (1, 0)
    assert counter.calls in (1, 2), f"stage 0 ran {counter.calls} forwards, not 0F0 (0F1)"
    if counter.calls == 2:
        assert counter.waited, "stage 1 did not fail and stop within 10 s of 0F1"
    # The abort is cleared: the next call runs every micro-batch.
    failing.armed, counter.gated, counter.calls = False, False, 0
    run(pipe, x)
    assert counter.calls == 16


class BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise ArithmeticError("backward exploded")


class FailsInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BadBackward.apply(x)


@pytest.mark.timeout(30)
def test_failure_in_backward_names_stage_and_micro_batch() -> None:
    model = nn.Sequential(nn.Linear(3, 3), FailsInBackward(), nn.Linear(3, 3))
    pipe = conveyor.GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2, checkpoint="never")
    out = pipe(torch.randn(4, 3))
    with pytest.raises(conveyor.StageError,
                       match=r"stage 1 failed in backward of micro-batch 1 \(1B1\): "
                             r"ArithmeticError: backward exploded"):
        out.sum().backward()


@pytest.mark.timeout(30)
def test_failure_in_an_input_gradient_says_input_gradient() -> None:
    model = nn.Sequential(nn.Linear(3, 3), FailsInBackward(), nn.Linear(3, 3))
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2, balance=[1, 2],
                             schedule=conveyor.schedules.parse("0F0 0F1 0B0 0B1\n"
                                                               "1F0 1I0 1F1 1W0 1B1"),
                             loss_fn=nn.functional.mse_loss, checkpoint="never")
    with pytest.raises(conveyor.StageError,
                       match=r"stage 1 failed in input gradient of micro-batch 0 \(1I0\): "
                             r"ArithmeticError: backward exploded"):
        pipe.step(torch.randn(4, 3), torch.randn(4, 3))


class FailsWhenRecomputed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if conveyor.is_recomputing():
            raise ValueError("not again")
        return x


@pytest.mark.timeout(30)
def test_a_recomputation_failing_in_an_input_gradient_names_that_action() -> None:
    model = nn.Sequential(nn.Linear(3, 3), FailsWhenRecomputed(), nn.Linear(3, 3))
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2, balance=[1, 2],
                             schedule="zero-bubble", loss_fn=nn.functional.mse_loss,
                             checkpoint="always")
    with pytest.raises(conveyor.StageError,
                       match=r"stage 1, layer 1 \(FailsWhenRecomputed\) failed on micro-batch "
                             r"0 while recomputing for backward: ValueError: not again") as caught:
        pipe.step(torch.randn(4, 3), torch.randn(4, 3))
    assert caught.value.action == "1I0"


class FirstColumns(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :2]


def test_an_inplace_write_into_a_view_of_a_stage_s_input_explains_the_fix() -> None:
    # A layer may write into the stage's input itself (the stage copies it; see
    # test_side_effects); into a view of it, it cannot.
    model = nn.Sequential(nn.Linear(3, 3), FirstColumns(), nn.ReLU(inplace=True),
                          nn.Linear(2, 3))
    pipe = conveyor.GPipe(model, [1, 3], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(conveyor.StageError,
                       match=r"stage 1, layer 2 \(ReLU\) failed on micro-batch 0 \(1F0\)"
                             r"(.|\n)*layer 2 writes into a view of it; use inplace=False for "
                             r"it or move the stage boundary to it"):
        pipe(torch.randn(4, 3))


def test_backward_twice_is_refused() -> None:
    pipe = conveyor.GPipe(mlp(), [4, 3], devices=["cpu"] * 2, chunks=2)
    out = pipe(torch.randn(4, 6, dtype=torch.float64)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"retain_graph=True is not supported"):
        out.backward()


def test_moving_the_pipeline_is_refused_but_dtype_changes_work() -> None:
    pipe = conveyor.GPipe(model8(), [4, 4], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match=r"pipeline keeps each stage on its own device and "
                                        r"cannot be moved to cpu; pass devices="):
        pipe.to("cpu")
    with pytest.raises(TypeError, match=r"cannot be moved"):
        pipe.cpu()
    pipe.double()
    assert pipe(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64


class RunsOutOfMemory(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_keeps_its_type_and_gets_a_note() -> None:
    pipe = conveyor.GPipe(nn.Sequential(nn.Identity(), RunsOutOfMemory()), [1, 1],
                          devices=["cpu"] * 2, chunks=2)
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        pipe(torch.zeros(4, 2))
    assert "stage 1, layer 1 (RunsOutOfMemory) failed on micro-batch 0 (1F0)" in caught.value.__notes__


class SumRows(nn.Module):
    """Collapses the batch: a layer that is wrong inside a pipeline."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=0, keepdim=True)


@pytest.mark.parametrize("face", ["GPipe", "Pipeline"])
def test_a_layer_that_changes_the_batch_size_is_named(face: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), SumRows(), nn.Linear(4, 1))
    match = (r"stage 1, layer 2 \(SumRows\) returned 1 rows \(shape \[1, 4\]\) on "
             r"micro-batch 0, which has 2 rows; a layer must keep dim 0, the batch")
    with pytest.raises(conveyor.LayerOutputError, match=match):
        if face == "GPipe":
            conveyor.GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=2)(torch.randn(4, 4))
        else:
            conveyor.Pipeline(model, loss_fn=nn.MSELoss(), chunks=2, balance=[2, 2],
                              devices=["cpu"] * 2).step(torch.randn(4, 4), torch.randn(4, 1))


def test_values_that_are_not_batched_may_pass_through_a_layer() -> None:
    class WithScale(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, torch.tensor(2.0)

    class ApplyScale(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] * pair[1]

    model = nn.Sequential(nn.Linear(4, 4), WithScale(), ApplyScale())
    pipe = conveyor.GPipe(model, [2, 1], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), model(x))  # micro-batches round differently


# --------------------------------------------- tracing a model: the cause and the fix


class DynamicCache:
    """Like transformers' cache of past keys and values: torch.export cannot take it
    apart."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> Any:
        for block in self.blocks:
            x = block(x)
        return (x, DynamicCache(x)) if use_cache else x


def test_a_cache_in_the_output_says_use_cache_false_and_is_left_to_conveyor() -> None:
    x = torch.randn(4, 4)
    with pytest.raises(conveyor.ModelError,
                       match=r"hint: Cached returns a DynamicCache \(use_cache=True\): pass "
                             r"use_cache=False in the sample .* or leave use_cache out and "
                             r"conveyor passes use_cache=False"):
        conveyor.GPipe(Cached(), stages=2, sample={"x": x, "use_cache": True})
    model = Cached()
    pipe = conveyor.GPipe(model, stages=2, sample={"x": x[:2]}, chunks=2)
    torch.testing.assert_close(pipe({"x": x}), model(x, use_cache=False))


def test_a_forward_taking_kwargs_says_how_to_give_the_sample() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Cached()

        def forward(self, **inputs: Any) -> Any:
            return self.inner(**inputs)

    with pytest.raises(conveyor.ModelError,
                       match=r"Wrapper.forward takes the sample's \['use_cache', 'x'\] through "
                             r"\*\*inputs, whose sizes torch.export cannot leave free .* give "
                             r"forward named parameters"):
        conveyor.GPipe(Wrapper(), stages=2, sample={"x": torch.randn(2, 4), "use_cache": False})


def test_a_missing_model_input_is_named() -> None:
    t = quiet_transformers()
    config = t.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=20, n_positions=8)
    with pytest.raises(conveyor.ModelError,
                       match=r"failed in transformer \(GPT2Model\): ValueError: .*\nhint: the "
                             r"error names input_ids and inputs_embeds, which "
                             r"GPT2LMHeadModel.forward takes and the sample does not give \(it "
                             r"gives attention_mask\): add input_ids to the sample"):
        conveyor.GPipe(t.GPT2LMHeadModel(config), stages=2,
                       sample={"attention_mask": torch.ones(2, 3, dtype=torch.long)})
    with pytest.raises(conveyor.ModelError, match=r"the micro-batch does not fit Cached.forward"
                                                  r".*missing a required argument: 'x'"):
        conveyor.GPipe(Cached(), stages=2, sample={"use_cache": False})


def test_eager_experts_name_the_module_and_the_setting_that_traces(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """transformers' eager experts branch on which experts tokens chose; torch prints
    the partial graph, which goes to the log rather than the terminal."""
    t = quiet_transformers()
    config = t.MixtralConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                             num_local_experts=4, num_experts_per_tok=2,
                             experts_implementation="eager")
    model = t.MixtralForCausalLM(config)
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="conveyor"), pytest.raises(
            conveyor.ModelError,
            match=r"failed in model.layers.0.mlp.experts \(MixtralExperts\): .*\nhint: "
                  r"data-dependent Python control flow in MixtralExperts.forward: "
                  r"transformers' eager experts .* model.set_experts_implementation"
                  r"\('batched_mm'\)"):
        conveyor.Pipeline(model, stages=2, loss_fn=nn.MSELoss(), chunks=2,
                          sample={"input_ids": torch.randint(0, 50, (2, 5))})
    assert "def forward(" not in capfd.readouterr().err
    assert "torch.export's partial graph of MixtralForCausalLM:\n" in caplog.text
    assert "def forward(" in caplog.text


def test_a_failing_loss_fn_names_the_last_stage_and_its_action() -> None:
    def broken(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise ValueError("targets of the wrong shape")

    pipe = conveyor.Pipeline(model8(), balance=[4, 4], devices=["cpu"] * 2, chunks=2,
                             loss_fn=broken)
    with pytest.raises(conveyor.StageError,
                       match=r"loss_fn failed on micro-batch 0 \(stage 1, 1F0\): ValueError: "
                             r"targets of the wrong shape") as caught:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    assert (caught.value.stage, caught.value.action, caught.value.microbatch) == (1, "1F0", 0)


def test_a_loss_fn_failing_when_recomputed_says_so() -> None:
    """A recomputed micro-batch runs loss_fn again in its backward (with the stage)."""
    def broken(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if conveyor.is_recomputing():
            raise ValueError("no second call")
        return nn.functional.mse_loss(output, targets)

    pipe = conveyor.Pipeline(model8(), balance=[4, 4], devices=["cpu"] * 2, chunks=2,
                             loss_fn=broken, recompute="always", schedule="gpipe")
    with pytest.raises(conveyor.StageError,
                       match=r"loss_fn failed on micro-batch 1 \(stage 1, 1B1\) while "
                             r"recomputing it for backward: ValueError: no second call"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))


def test_gpipe_names_what_it_takes_when_given_something_else() -> None:
    with pytest.raises(conveyor.ModelError, match=r"GPipe runs an nn.Module .* got function"):
        conveyor.GPipe(lambda i: torch.nn.Linear(2, 2), chunks=2)  # type: ignore[arg-type]
