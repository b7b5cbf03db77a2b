"""Batch norm: per-micro-batch normalisation, and deferred running statistics."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.microbatch import split
from tests.support.models import assert_same_grads, paired, relative_error, weighted_loss


def bn_model() -> nn.Sequential:
    # No bias before a batch norm: its gradient is zero in theory, roundoff in practice.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
        nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8, bias=False), nn.BatchNorm1d(8),
        nn.Linear(8, 2),
    ).double()


def images(batch: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 6, 6, dtype=torch.float64, generator=generator) * 2 + 1


def assert_same_buffers(a: nn.Module, b: nn.Module) -> None:
    assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()]
    for (name, x), (_, y) in paired(a.named_buffers(), b.named_buffers()):
        if x.is_floating_point():
            assert relative_error(x, y) <= 1e-10, name
        else:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages", [1, 3])
def test_batch_norm_normalises_per_micro_batch(stages: int, checkpoint: str) -> None:
    model = bn_model()
    reference = copy.deepcopy(model)
    balance = {1: [10], 3: [3, 4, 3]}[stages]
    pipe = conveyor.GPipe(model, balance, devices=["cpu"] * stages, chunks=3,
                          checkpoint=checkpoint)
    x = images()
    weighted_loss(pipe(x)).backward()
    # The reference: the plain model over the same micro-batches, gradients accumulated.
    weighted_loss(torch.cat([reference(part) for part in split(x, 3)])).backward()

    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    # Recomputation must not update running statistics a second time.
    assert_same_buffers(pipe, reference)


def single_bn_model(kind: str, momentum: float | None) -> nn.Sequential:
    # One batch norm: a second one would see the first's per-micro-batch normalisation,
    # so its input, and its statistics, would differ from the whole-batch model's.
    torch.manual_seed(0)
    if kind == "2d":
        layers = [nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, bias=False),
                  nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Flatten(),
                  nn.Linear(4 * 4 * 4, 2)]
    else:
        layers = [nn.Flatten(), nn.Linear(3 * 6 * 6, 8), nn.Tanh(), nn.Linear(8, 8, bias=False),
                  nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(), nn.Linear(8, 2)]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_deferred_batch_norm_tracks_the_whole_mini_batch(checkpoint: str,
                                                         momentum: float | None,
                                                         kind: str) -> None:
    model = single_bn_model(kind, momentum)
    plain = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [3, 4], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint,
                          deferred_batch_norm=True)
    for step in range(3):
        x = images(seed=step)
        weighted_loss(pipe(x)).backward()
        plain(x)  # the plain model on the whole batch, in training mode
    assert_same_buffers(pipe, plain)
    assert int(pipe.get_buffer(f"{3 if kind == '2d' else 4}.num_batches_tracked")) == 3


def test_deferred_batch_norm_gradients_normalise_per_micro_batch() -> None:
    model = bn_model()
    reference = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [4, 6], devices=["cpu"] * 2, chunks=3,
                          deferred_batch_norm=True)
    x = images()
    weighted_loss(pipe(x)).backward()
    weighted_loss(torch.cat([reference(part) for part in split(x, 3)])).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


def test_deferred_batch_norm_keeps_state_dict_keys_and_eval_behaviour() -> None:
    model = bn_model()
    plain = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [10], devices=["cpu"], chunks=2, deferred_batch_norm=True)
    assert isinstance(pipe.get_submodule("1"), conveyor.DeferredBatchNorm)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    pipe.eval()
    plain.eval()
    x = images()
    with torch.no_grad():
        assert relative_error(pipe(x), plain(x)) <= 1e-12


def test_failed_step_discards_pooled_statistics() -> None:
    class FailOnce(nn.Module):
        fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if FailOnce.fail:
                raise RuntimeError("boom")
            return x

    model = nn.Sequential(nn.BatchNorm1d(3), FailOnce()).double()
    plain = nn.Sequential(nn.BatchNorm1d(3)).double()
    pipe = conveyor.GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    x = torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(conveyor.StageError):
        pipe(x * 5)
    FailOnce.fail = False
    pipe(x)
    plain(x)
    assert relative_error(pipe.get_buffer("0.running_mean"), plain[0].running_mean) <= 1e-12
