"""Weights shared across stages, under GPipe as under Pipeline: a copy per stage whose
gradients are summed, and updates equal to the plain model's."""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

import conveyor
from tests.support.cases import case_batch, case_model
from tests.support.models import relative_error


def test_gpipe_trains_a_tied_language_model_as_the_plain_model() -> None:
    model, loss_fn = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=2)
    first, last = pipe.get_parameter("0.weight"), pipe.get_parameter("5.weight")
    assert first is not last  # one copy per stage
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    optimizer_ref = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        x, y = case_batch("lm", seed=step)
        optimizer.zero_grad()
        loss_fn(pipe(x), y).backward()
        assert first.grad is not None and last.grad is not None
        optimizer_ref.zero_grad()
        loss_fn(reference(x), y).backward()
        tied_grad = reference.get_parameter("0.weight").grad
        assert relative_error(first.grad, tied_grad) <= 1e-10
        assert torch.equal(first.grad, last.grad)
        optimizer.step()
        optimizer_ref.step()
    assert torch.equal(first, last)
    assert relative_error(first.detach(), reference[0].weight.detach()) <= 1e-10
    others = [n for n, _ in reference.named_parameters() if n != "0.weight"]
    assert others
    for name in others:
        assert relative_error(pipe.get_parameter(name), reference.get_parameter(name)) <= 1e-10


def test_gpipe_copies_a_module_used_by_two_stages() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3).double()
    model = nn.Sequential(OrderedDict(first=shared, act=nn.Tanh(), last=shared))
    reference = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [2, 1], devices=["cpu"] * 2, chunks=2)
    assert pipe.first is not pipe.last and pipe.first.weight is not pipe.last.weight
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for name in ("weight", "bias"):
        expected = reference.first.get_parameter(name).grad
        for layer in (pipe.first, pipe.last):
            assert relative_error(layer.get_parameter(name).grad, expected) <= 1e-10
