"""A stage's partition is one module: hooks on ``pipe.partitions[k]`` fire per micro-batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.support.models import build, relative_error, sample


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_hooks_on_a_partition_fire_once_per_micro_batch(checkpoint: str) -> None:
    model, plain = build("mlp")
    pipe = conveyor.GPipe(model, [3, 4], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    after: list[tuple[int, bool]] = []
    before: list[bool] = []

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        after.append((output.shape[0], conveyor.is_recomputing()))

    pipe.partitions[1].register_forward_hook(hook)
    pipe.partitions[1].register_forward_pre_hook(
        lambda module, args: before.append(conveyor.is_recomputing()))
    x = sample("mlp", batch=8)
    pipe(x).sum().backward()
    # Recomputation stops once it has rebuilt what backward needs, before the
    # partition's forward returns: forward hooks fire once per micro-batch, pre-hooks
    # also when a micro-batch is recomputed.
    assert after == [(2, False)] * 4
    assert before == [False] * 4 + [True] * (4 if checkpoint == "always" else 0)


def test_a_forward_hook_can_change_what_the_next_stage_gets() -> None:
    model, plain = build("mlp")
    pipe = conveyor.GPipe(model, [3, 4], devices=["cpu"] * 2, chunks=2, checkpoint="never")
    pipe.partitions[0].register_forward_hook(lambda module, args, output: output * 0)
    x = sample("mlp")
    expected = plain[3:](plain[:3](x) * 0)
    assert relative_error(pipe(x), expected) < 1e-12


def test_full_backward_hooks_on_a_partition_see_each_micro_batch_gradient() -> None:
    model, _ = build("mlp")
    pipe = conveyor.Pipeline(model, loss_fn=lambda out, y: (out - y).pow(2).mean(), chunks=2,
                             balance=[3, 4], devices=["cpu"] * 2, schedule="1f1b",
                             checkpoint="never")
    grads: list[torch.Size] = []
    pipe.runtime.stages[1].layers.register_full_backward_hook(
        lambda module, grad_in, grad_out: grads.append(grad_out[0].shape))
    x = sample("mlp")
    pipe.step(x, torch.zeros_like(model(x)))
    assert grads == [torch.Size([x.shape[0] // 2, *model(x).shape[1:]])] * 2
