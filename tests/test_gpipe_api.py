"""The GPipe module as users see it: attributes, state dicts, inference, devices."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import conveyor
from tests.support.models import build, paired, relative_error, sample, transformer


def test_attributes() -> None:
    model, _ = build("mlp")
    pipe = conveyor.GPipe(model, [3, 2, 2], devices=["cpu"] * 3, chunks=4)
    assert pipe.balance == [3, 2, 2]
    assert pipe.devices == [torch.device("cpu")] * 3
    assert pipe.chunks == 4
    assert pipe.recompute == "except_last"
    assert [len(p) for p in pipe.partitions] == [3, 2, 2]
    assert pipe.partitions[1][0] is model[3]


def test_default_devices_without_cuda_are_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    pipe = conveyor.GPipe(build("mlp")[0], [4, 3])
    assert pipe.devices == [torch.device("cpu")] * 2


def test_state_dict_has_the_plain_model_keys_and_moves_both_ways() -> None:
    model, plain = build("transformer")
    pipe = conveyor.GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]

    torch.manual_seed(5)
    other = transformer()
    pipe.load_state_dict(other.state_dict())  # plain -> pipeline
    x = sample("transformer")
    pipe.eval()
    other.eval()
    with torch.no_grad():
        assert relative_error(pipe(x), other(x)) <= 1e-12

    regrouped = conveyor.GPipe(transformer(), [1, 4, 1], devices=["cpu"] * 3)
    regrouped.load_state_dict(pipe.state_dict())  # one partition -> another
    fresh = transformer()
    fresh.load_state_dict(regrouped.state_dict())  # pipeline -> plain
    fresh.eval()
    with torch.no_grad():
        assert relative_error(fresh(x), other(x)) <= 1e-12


def test_named_layers_keep_their_names() -> None:
    model = nn.Sequential(OrderedDict(embed=nn.Linear(3, 4), act=nn.Tanh(), head=nn.Linear(4, 2)))
    keys = list(model.state_dict())
    pipe = conveyor.GPipe(model, [2, 1], devices=["cpu"] * 2)
    assert list(pipe.state_dict()) == keys == ["embed.weight", "embed.bias", "head.weight",
                                               "head.bias"]


def test_layer_name_clashing_with_an_attribute_is_refused() -> None:
    model = nn.Sequential(OrderedDict(balance=nn.Linear(3, 3)))
    with pytest.raises(ValueError, match=r"layer name 'balance' clashes"):
        conveyor.GPipe(model, [1], devices=["cpu"])


class Square(nn.Module):
    """x * x, noting per call: batch size, whether autograd records, whether recomputing
    (a log, declared harmless to the pipeline's first look)."""

    conveyor_harmless = ("calls",)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.shape[0], torch.is_grad_enabled(), conveyor.is_recomputing()))
        return x * x


def test_inference_under_no_grad_is_pipelined_without_a_graph() -> None:
    model, plain = build("mlp", dropout=0.5)
    square = Square()
    model.append(square)
    plain.append(Square())
    pipe = conveyor.GPipe(model, [5, 4], devices=["cpu"] * 2, chunks=3, checkpoint="always")
    pipe.eval()
    plain.eval()
    x = sample("mlp")  # 10 samples: micro-batches of 4, 3 and 3
    with torch.no_grad():
        out = pipe(x)
        expected = plain(x)
    # One forward per micro-batch, on the stage's thread with autograd off: nothing
    # recorded, so nothing to recompute, although checkpoint="always".
    assert square.calls == [(4, False, False), (3, False, False), (3, False, False)]
    assert out.grad_fn is None and not out.requires_grad
    assert relative_error(out, expected) <= 1e-12
    assert all(p.grad is None for p in pipe.parameters())

    # The same call with autograd on records a graph, and backward recomputes each
    # micro-batch: what no_grad above left out.
    square.calls.clear()
    pipe(x).sum().backward()
    assert square.calls == [(4, True, False), (3, True, False), (3, True, False),
                            (3, True, True), (3, True, True), (4, True, True)]


def test_eval_with_grad_still_gives_plain_gradients() -> None:
    model, plain = build("cnn")
    pipe = conveyor.GPipe(model, [4, 4], devices=["cpu"] * 2, chunks=2).eval()
    plain.eval()
    x = sample("cnn")
    pipe(x).sum().backward()
    plain(x).sum().backward()
    for p, r in paired(pipe.parameters(), plain.parameters()):
        assert p.grad is not None and r.grad is not None
        assert relative_error(p.grad, r.grad) <= 1e-10


def test_integer_outputs_are_not_differentiable() -> None:
    class WithLabels(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            return x, x.argmax(dim=1)

    model = nn.Sequential(nn.Linear(4, 3), WithLabels())
    pipe = conveyor.GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)
    scores, labels = pipe(torch.randn(6, 4))
    assert scores.requires_grad and not labels.requires_grad
    assert labels.dtype == torch.int64 and labels.shape == (6,)
    scores.sum().backward()
    assert model[0].weight.grad is not None


def test_output_lives_on_the_last_stage_device() -> None:
    pipe = conveyor.GPipe(copy.deepcopy(build("mlp")[0]), [4, 3], devices=["cpu"] * 2)
    assert pipe(sample("mlp")).device == pipe.devices[-1]


def test_autograd_grad_returns_plain_gradients_and_leaves_grad_alone() -> None:
    model, plain = build("mlp")
    pipe = conveyor.GPipe(model, [4, 3], devices=["cpu"] * 2, chunks=3)
    x = sample("mlp")
    for p in pipe.parameters():
        p.grad = torch.ones_like(p)
    grads = torch.autograd.grad(pipe(x).pow(2).sum(), list(pipe.parameters()))
    expected = torch.autograd.grad(plain(x).pow(2).sum(), list(plain.parameters()))
    for p, g, e in paired(pipe.parameters(), grads, expected):
        assert relative_error(g, e) <= 1e-10
        assert torch.equal(p.grad, torch.ones_like(p))  # untouched


def test_backward_adds_to_existing_gradients() -> None:
    model, plain = build("mlp")
    pipe = conveyor.GPipe(model, [4, 3], devices=["cpu"] * 2, chunks=3)
    for _ in range(2):  # two backward passes accumulate, as in the plain model
        pipe(sample("mlp")).pow(2).sum().backward()
        plain(sample("mlp")).pow(2).sum().backward()
    for p, r in paired(pipe.parameters(), plain.parameters()):
        assert p.grad is not None and r.grad is not None
        assert relative_error(p.grad, r.grad) <= 1e-10
