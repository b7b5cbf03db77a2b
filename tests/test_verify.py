"""``Pipeline(verify_every=N)``: the certificate of the user's own run passes on correct
runs (float64 and float32, dropout and batch norm, a traced model), leaves the training
state as it was, and stops a run whose gradient accumulation keeps only the last
micro-batch."""

from __future__ import annotations

import copy
import re
import logging
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.actions import StageActions
from conveyor.errors import ConfigError, VerificationError
from tests.support.cases import case_model, padded_batch, token_loss


def noisy_mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 16),
                         nn.BatchNorm1d(16), nn.Linear(16, 4)).to(dtype)


def batch(dtype: torch.dtype, rows: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(rows, 8, generator=generator, dtype=dtype),
            torch.randn(rows, 4, generator=generator, dtype=dtype))


def pipeline(model: nn.Module, **options: Any) -> conveyor.Pipeline:
    return conveyor.Pipeline(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=4,
                             loss_fn=nn.functional.mse_loss, **options)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_correct_run_is_verified_and_left_as_it_was(dtype: torch.dtype, schedule: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    model = noisy_mlp(dtype)
    plain = pipeline(copy.deepcopy(model), schedule=schedule)
    verified = pipeline(model, schedule=schedule, verify_every=2)
    x, y = batch(dtype)
    torch.manual_seed(5)
    losses = [float(plain.step(x, y)) for _ in range(4)]
    after = torch.get_rng_state()
    torch.manual_seed(5)
    with caplog.at_level(logging.INFO, logger="conveyor"):
        got = [float(verified.step(x, y)) for _ in range(4)]
    assert got == losses
    assert torch.equal(torch.get_rng_state(), after)  # the streams as without it
    assert [r.getMessage() for r in caplog.records if "verified at step" in r.getMessage()] \
        == [m for m in [r.getMessage() for r in caplog.records] if "verified" in m]
    assert verified.certificate is not None and verified.certificate.verified == 2
    assert any("verified at step 4" in r.getMessage() for r in caplog.records)
    for (name, a), (_, b) in zip(plain.named_parameters(), verified.named_parameters(),
                                 strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name
    for (name, a), (_, b) in zip(plain.named_buffers(), verified.named_buffers(),
                                 strict=True):
        assert torch.equal(a, b), name  # batch norm's statistics: one update per step


def test_a_tied_lm_with_padding_is_verified() -> None:
    model, _ = case_model("lm")  # its head is its embedding, on another stage
    x, y = padded_batch()
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=3,
                             schedule="1f1b", loss_fn=token_loss, verify_every=1)
    pipe.step(x, y)
    assert pipe.certificate is not None and pipe.certificate.verified == 1


class Tower(nn.Module):
    """Not an nn.Sequential: traced and cut at ``blocks.1``, one value skipping a stage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = first = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(torch.cat([h, first], dim=-1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_traced_model_is_verified(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, y = batch(dtype)
    pipe = conveyor.Pipeline(Tower().to(dtype), split_at=["blocks.1", "blocks.2"],
                             devices=["cpu"] * 3, chunks=4, schedule="zero-bubble",
                             loss_fn=nn.functional.mse_loss, verify_every=1)
    pipe.step(x, y)
    pipe.step(x, y)
    assert pipe.certificate is not None and pipe.certificate.verified == 2


def keep_only_the_last_microbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient accumulation that keeps only the micro-batch whose backward ran last:
    every backward starts by dropping what the stage's parameters held."""
    original = StageActions.backward_one

    def backward_one(self: StageActions, microbatch: int, *args: Any, **kwargs: Any) -> Any:
        for param in self.trainable_parameters():
            param.grad = None
        return original(self, microbatch, *args, **kwargs)

    monkeypatch.setattr(StageActions, "backward_one", backward_one)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_gradient_accumulation_keeping_the_last_microbatch_is_caught(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    keep_only_the_last_microbatch(monkeypatch)
    pipe = pipeline(noisy_mlp(dtype), verify_every=1)
    x, y = batch(dtype)
    with pytest.raises(VerificationError, match=r"step 1's gradient of '0\.weight' differs"
                       ) as caught:
        pipe.step(x, y)
    assert caught.value.step == 1 and caught.value.tensor == "0.weight"


def test_the_broken_accumulation_passes_unverified(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defect is silent without the certificate: the step's loss looks fine."""
    keep_only_the_last_microbatch(monkeypatch)
    pipe = pipeline(noisy_mlp(torch.float64))
    x, y = batch(torch.float64)
    assert torch.isfinite(pipe.step(x, y))


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_verify_every_is_a_number_of_steps(every: Any) -> None:
    with pytest.raises(ConfigError, match="verify_every"):
        pipeline(noisy_mlp(torch.float64), verify_every=every)


def test_conveyor_train_verifies_every_n_steps(tmp_path: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.training import train

    assert train(tmp_path / "run", "--steps", "4", "--verify-every", "2") == 0
    out = capsys.readouterr().out
    assert re.findall(r"verified at step \d+", out) == ["verified at step 2",
                                                       "verified at step 4"]


def test_conveyor_train_stops_on_a_step_that_does_not_verify(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.training import train

    keep_only_the_last_microbatch(monkeypatch)
    assert train(tmp_path / "run", "--steps", "2", "--verify-every", "1") == 1
    err = capsys.readouterr().err
    assert "conveyor train: error: verify_every: step 1's gradient of" in err
