"""Fused weight gradients: a linear layer's weight gradient added into ``.grad`` by its
own product inside a stage's ``B``, and plain ``nn.Linear`` everywhere else."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.backward import accumulation
from conveyor.engine.backward.accumulation import FusedLinear
from tests.support import any_models
from tests.support.models import assert_same_grads, build, relative_error, sample


@pytest.fixture(autouse=True)
def small_weights_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """This file's small models fuse as large ones do (test_only_large_weights_fuse_by_default
    holds the default)."""
    monkeypatch.setattr(accumulation, "FUSED_MIN_ELEMENTS", 0)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the fused additions into ``.grad`` (one per linear layer and micro-batch)."""
    calls: list[int] = []
    add = accumulation.add_into_grads

    def counted(*args: Any) -> None:
        calls.append(1)
        add(*args)
    monkeypatch.setattr(accumulation, "add_into_grads", counted)
    return calls


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = mse(model(x), y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_fused_gradients_equal_the_plain_models(schedule: str, recompute: str,
                                                fused_calls: list[int]) -> None:
    model, reference = build("mlp")  # 4 linear layers, float64
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    pipe = conveyor.Pipeline(model, chunks=4, stages=2, schedule=schedule,
                             virtual_stages=virtual, recompute=recompute, loss_fn=mse)
    x, y = sample("mlp", batch=10), torch.randn(10, 3, dtype=torch.float64)
    for _ in range(2):  # the second step adds into the first's gradients
        loss = pipe.step(x, y)
        expected = plain_step(reference, x, y)
    assert relative_error(loss, expected) <= 1e-12
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert len(fused_calls) == 2 * 4 * 4  # steps x linear layers x micro-batches
    assert all(type(m) is FusedLinear for m in pipe.modules() if isinstance(m, nn.Linear))


def test_the_gpipe_face_on_a_transformer(fused_calls: list[int]) -> None:
    model, reference = build("transformer")
    pipe = conveyor.GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=3)
    tokens = sample("transformer", batch=9)
    output = pipe(tokens)
    weights = torch.randn_like(output)
    (output * weights).sum().backward()
    (reference(tokens) * weights).sum().backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    # Each block's two feed-forward layers and the head, per micro-batch (attention
    # projects with its own weights, not through nn.Linear modules).
    assert len(fused_calls) == (3 * 2 + 1) * 3


def test_zero_bubble_keeps_the_weight_gradient_apart(fused_calls: list[int]) -> None:
    model, reference = build("mlp")
    pipe = conveyor.Pipeline(model, chunks=4, stages=2, schedule="zero-bubble", loss_fn=mse)
    x, y = sample("mlp", batch=8), torch.randn(8, 3, dtype=torch.float64)
    pipe.step(x, y)
    plain_step(reference, x, y)
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert not fused_calls
    assert not any(isinstance(m, FusedLinear) for m in pipe.modules())


def test_hooked_parameters_keep_autograds_accumulation(fused_calls: list[int]) -> None:
    model, reference = build("mlp")
    seen: list[torch.Size] = []
    model[0].weight.register_hook(lambda g: seen.append(g.shape))
    accumulated: list[int] = []
    model[2].bias.register_post_accumulate_grad_hook(lambda p: accumulated.append(1))
    pipe = conveyor.Pipeline(model, chunks=2, stages=2, loss_fn=mse)
    x, y = sample("mlp", batch=6), torch.randn(6, 3, dtype=torch.float64)
    pipe.step(x, y)
    plain_step(reference, x, y)
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert seen == [model[0].weight.shape] * 2 and accumulated == [1, 1]
    assert len(fused_calls) == 2 * 2  # the two linear layers without hooks


def test_switched_off_by_the_environment(fused_calls: list[int],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_FUSE_ACCUMULATION", "0")
    pipe = conveyor.Pipeline(build("mlp")[0], chunks=2, stages=2, loss_fn=mse)
    pipe.step(sample("mlp", batch=6), torch.randn(6, 3, dtype=torch.float64))
    assert not fused_calls
    assert not any(isinstance(m, FusedLinear) for m in pipe.modules())


def test_only_large_weights_fuse_by_default(monkeypatch: pytest.MonkeyPatch,
                                            fused_calls: list[int]) -> None:
    monkeypatch.setattr(accumulation, "FUSED_MIN_ELEMENTS", 1 << 16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 255)).double()
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, chunks=2, stages=2, loss_fn=mse)
    x, y = torch.randn(4, 256, dtype=torch.float64), torch.randn(4, 255, dtype=torch.float64)
    pipe.step(x, y)
    plain_step(reference, x, y)
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert [type(m) for m in pipe.modules() if isinstance(m, nn.Linear)] == [
        FusedLinear, nn.Linear]  # 256 x 256 = 2^16 elements fuse, 255 x 256 do not
    assert len(fused_calls) == 2  # the large layer's two micro-batches


def test_autocast_runs_autograds_linear(fused_calls: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    pipe = conveyor.Pipeline(model, chunks=2, stages=2, loss_fn=mse, precision="bf16")
    pipe.step(torch.randn(6, 8), torch.randn(6, 4))
    assert not fused_calls
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in pipe.parameters())


def test_outside_a_stage_it_is_nn_linear() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    pipe = conveyor.Pipeline(model, chunks=2, stages=2, loss_fn=mse)
    pipe.step(torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    pipe.zero_grad(set_to_none=True)
    layer = next(m for m in pipe.modules() if isinstance(m, nn.Linear))
    assert isinstance(layer, FusedLinear) and repr(layer).startswith("Linear(")
    x = torch.randn(3, 4, dtype=torch.float64)
    weight_grad, = torch.autograd.grad(layer(x).sum(), [layer.weight])  # no .grad touched
    assert layer.weight.grad is None
    torch.testing.assert_close(weight_grad, torch.ones(5, 3, dtype=torch.float64) @ x)
    copied = pickle.loads(pickle.dumps(layer))
    assert type(copied) is FusedLinear and torch.equal(copied.weight, layer.weight)
    assert set(copied.state_dict()) == {"weight", "bias"}


def test_inputs_of_any_rank_no_bias_and_outputs_modified_in_place(
        fused_calls: list[int]) -> None:
    """F.linear hands a 3-d input's product on as a view, which the ReLU after could not
    modify in place (generator seed 4.0, and 5 more of the CI sample, before the fix)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True),
                          nn.Linear(8, 3, bias=False)).double()
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, chunks=3, stages=2, balance=[2, 1], loss_fn=mse)
    x = torch.randn(6, 5, 6, dtype=torch.float64)  # (batch, tokens, features)
    y = torch.randn(6, 5, 3, dtype=torch.float64)
    pipe.step(x, y)
    plain_step(reference, x, y)
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert len(fused_calls) == 2 * 3


def test_a_traced_stage_fuses_its_calls_of_linear(fused_calls: list[int]) -> None:
    model, reference, split_at, inputs, targets = any_models.build("llama")
    stages = len(split_at) + 1
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=any_models.sample_of(inputs),
                             stages=stages, devices=["cpu"] * stages,
                             chunks=any_models.CHUNKS, schedule="1f1b",
                             loss_fn=any_models.loss_of("llama"))
    pipe.step(inputs, targets)
    any_models.plain_step("llama", reference, inputs, targets)
    any_models.assert_model_grads(pipe, reference)
    # 4 blocks of 7 projections and the head, for every micro-batch.
    assert len(fused_calls) == (4 * 7 + 1) * any_models.CHUNKS


def test_gpt2s_conv1d_layers_fuse_as_a_traced_stages_addmm(fused_calls: list[int]) -> None:
    model, reference, split_at, inputs, targets = any_models.build("gpt2")
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=any_models.sample_of(inputs),
                             stages=2, devices=["cpu"] * 2, chunks=any_models.CHUNKS,
                             loss_fn=any_models.loss_of("gpt2"))
    pipe.step(inputs, targets)
    any_models.plain_step("gpt2", reference, inputs, targets)
    any_models.assert_model_grads(pipe, reference)
    # 4 blocks of 4 Conv1D (attention in and out, feed-forward in and out) and the head.
    assert len(fused_calls) == (4 * 4 + 1) * any_models.CHUNKS


class CheckpointedMLP(nn.Module):
    """The model's own torch.utils.checkpoint around two linear layers (3-d inputs)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.utils.checkpoint.checkpoint(self.f, h, use_reentrant=False)


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_a_model_s_own_checkpoint_recomputes_fused_layers_as_it_ran_them(
        recompute: str, fused_calls: list[int]) -> None:
    # Found by the generator (seed 37): the checkpoint's recomputation, run in the
    # stage's backward outside its layers' forward, took autograd's linear and saved
    # other tensors than the fused forward had ("different metadata"). And a model
    # pipelined a second time kept its layers bound to the first pipeline.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), CheckpointedMLP(4), CheckpointedMLP(4),
                          nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    y = torch.randn(6, 3, 2, dtype=torch.float64)
    for attempt in range(2):  # the second pipeline of the same model
        model.zero_grad()
        reference.zero_grad()
        pipe = conveyor.Pipeline(model, chunks=3, balance=[2, 2], devices=["cpu"] * 2,
                                 schedule="gpipe", recompute=recompute, loss_fn=mse)
        loss = pipe.step(x, y)
        assert relative_error(loss, plain_step(reference, x, y)) <= 1e-12
        assert_same_grads(model.named_parameters(), reference.named_parameters())
    assert len(fused_calls) == 2 * 3 * 6  # both steps, 3 micro-batches, 6 linear layers
