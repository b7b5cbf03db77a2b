"""The contract: pipelined gradients equal the plain model's on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor
from tests.support.models import (
    assert_same_grads,
    build,
    even_balance,
    paired,
    relative_error,
    sample,
    weighted_loss,
)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_gradients_equal_plain_model(name: str, stages: int, chunks: int, checkpoint: str) -> None:
    model, reference = build(name)
    pipe = conveyor.GPipe(model, even_balance(model, stages), devices=["cpu"] * stages,
                          chunks=chunks, checkpoint=checkpoint)
    x = sample(name, batch=10)  # 10 samples: uneven micro-batches for 3 and 8 chunks
    output = pipe(x)
    weighted_loss(output).backward()
    expected = reference(x)
    weighted_loss(expected).backward()

    assert relative_error(output.detach(), expected.detach()) <= 1e-12
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_input_gradient_equals_plain_model(checkpoint: str) -> None:
    model, reference = build("mlp")
    pipe = conveyor.GPipe(model, [3, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)
    x = sample("mlp", batch=9).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    weighted_loss(pipe(x)).backward()
    weighted_loss(reference(x_ref)).backward()
    assert x.grad is not None and x_ref.grad is not None
    assert relative_error(x.grad, x_ref.grad) <= 1e-12


class Pair(nn.Module):
    """Takes (x, scale) or {"x": .., "scale": ..}; returns the same shape of structure."""

    def __init__(self, width: int, as_dict: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.as_dict = as_dict

    def forward(self, batch):  # type: ignore[no-untyped-def]
        x, scale = (batch["x"], batch["scale"]) if self.as_dict else batch
        y = torch.tanh(self.linear(x)) * scale
        return {"x": y, "scale": scale + 1} if self.as_dict else (y, scale + 1)


class Split(nn.Module):
    """Turns a tensor into a nested structure: a tuple holding a dict."""

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        return (x[:, :3], {"rest": x[:, 3:], "norm": x.norm(dim=1, keepdim=True)})


class Join(nn.Module):
    def forward(self, batch):  # type: ignore[no-untyped-def]
        head, extra = batch
        return torch.cat([head * extra["norm"], extra["rest"]], dim=1)


@pytest.mark.parametrize("as_dict", [False, True])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_nested_inputs_and_outputs(as_dict: bool, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Pair(5, as_dict), Pair(5, as_dict), Pair(5, as_dict)).double()
    reference = nn.Sequential(*[Pair(5, as_dict) for _ in range(3)]).double()
    reference.load_state_dict(model.state_dict())
    pipe = conveyor.GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)

    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(7, 1, dtype=torch.float64, requires_grad=True)
    x_ref, scale_ref = (t.detach().clone().requires_grad_() for t in (x, scale))
    batch = {"x": x, "scale": scale} if as_dict else (x, scale)
    batch_ref = {"x": x_ref, "scale": scale_ref} if as_dict else (x_ref, scale_ref)

    out, out_ref = pipe(batch), reference(batch_ref)
    y, s = (out["x"], out["scale"]) if as_dict else out
    y_ref, s_ref = (out_ref["x"], out_ref["scale"]) if as_dict else out_ref
    (weighted_loss(y) + s.sum()).backward()
    (weighted_loss(y_ref) + s_ref.sum()).backward()

    assert type(out) is type(out_ref)
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    for a, b in [(x, x_ref), (scale, scale_ref)]:
        assert a.grad is not None and b.grad is not None
        assert relative_error(a.grad, b.grad) <= 1e-12


def test_nested_structures_between_stages() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Split(), Join(), nn.Linear(6, 2)).double()
    reference = nn.Sequential(nn.Linear(4, 6), Split(), Join(), nn.Linear(6, 2)).double()
    reference.load_state_dict(model.state_dict())
    pipe = conveyor.GPipe(model, [2, 1, 1], devices=["cpu"] * 3, chunks=4)
    x = torch.randn(9, 4, dtype=torch.float64)
    weighted_loss(pipe(x)).backward()
    weighted_loss(reference(x)).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


def test_broadcast_scalar_input_gets_summed_gradient() -> None:
    class Scaled(nn.Module):
        def forward(self, batch):  # type: ignore[no-untyped-def]
            x, temperature = batch
            return x / temperature

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), nn.Linear(3, 3)).double()
    reference = nn.Sequential(Scaled(), nn.Linear(3, 3)).double()
    reference.load_state_dict(model.state_dict())
    pipe = conveyor.GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=3)
    x = torch.randn(6, 3, dtype=torch.float64)
    t = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    t_ref = t.detach().clone().requires_grad_()
    weighted_loss(pipe((x, t))).backward()
    weighted_loss(reference((x, t_ref))).backward()
    assert t.grad is not None and t_ref.grad is not None
    assert relative_error(t.grad, t_ref.grad) <= 1e-12


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_optimizer_step_equals_plain_step(checkpoint: str) -> None:
    model, reference = build("transformer")
    pipe = conveyor.GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)
    # SGD, not Adam: Adam divides by the gradient's own size, which turns the roundoff
    # of gradients that are exactly zero in theory (attention key biases) into steps.
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    optimizer_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = sample("transformer", batch=8, seed=step)
        for net, opt in [(pipe, optimizer), (reference, optimizer_ref)]:
            opt.zero_grad()
            weighted_loss(net(x)).backward()
            opt.step()
    for (name, p), r in paired(pipe.named_parameters(), reference.parameters()):
        assert relative_error(p.detach(), r.detach()) <= 1e-10, name


def test_frozen_and_unused_parameters_match_plain_model() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Unused(), nn.Linear(4, 2)).double()
    model[0].weight.requires_grad_(False)
    reference = nn.Sequential(nn.Linear(4, 4), Unused(), nn.Linear(4, 2)).double()
    reference.load_state_dict(model.state_dict())
    reference[0].weight.requires_grad_(False)
    pipe = conveyor.GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    weighted_loss(pipe(x)).backward()
    weighted_loss(reference(x)).backward()
    assert model[0].weight.grad is None and model[1].unused.weight.grad is None
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


def test_two_forwards_then_one_backward() -> None:
    model, reference = build("mlp")
    pipe = conveyor.GPipe(model, [4, 3], devices=["cpu"] * 2, chunks=2)
    a, b = sample("mlp", 6, seed=1), sample("mlp", 6, seed=2)
    (weighted_loss(pipe(a)) + weighted_loss(pipe(b)) * 2).backward()
    (weighted_loss(reference(a)) + weighted_loss(reference(b)) * 2).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


def test_float32_within_1e5() -> None:
    model, reference = build("transformer")
    model.float()
    reference.float()
    pipe = conveyor.GPipe(model, [3, 3], devices=["cpu"] * 2, chunks=4)
    x = sample("transformer", batch=8)
    weighted_loss(pipe(x)).backward()
    weighted_loss(reference(x)).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters(), rtol=1e-5)
