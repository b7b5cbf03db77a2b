"""Regressions: each test here failed before the fix named in its docstring."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor


class _EncoderDecoder(nn.Module):
    """An encoder whose output the decoder reads and the model returns beside its logits
    (as T5 and BART return ``encoder_last_hidden_state``), or a hidden state returned
    beside the head made from it (``output_hidden_states``)."""

    def __init__(self, returns: str, width: int = 8) -> None:
        super().__init__()
        self.returns = returns
        self.enc = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)
        self.dec = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        e = torch.tanh(self.enc(x))
        h = torch.tanh(self.dec(torch.tanh(self.mid(e)))) * e
        return {"logits": self.head(h), "extra": e if self.returns == "encoder" else h}


def _logits_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out["logits"], y)


@pytest.mark.parametrize("returns", ["encoder", "hidden"])
@pytest.mark.parametrize("recompute", ["always", "except_last"])
@pytest.mark.parametrize("schedule,split_at", [("zero-bubble", ["dec"]),
                                               ("zb-v", ["mid", "dec", "head"]),
                                               ("dualpipe-v", ["mid", "dec", "head"])])
def test_a_returned_value_made_earlier_keeps_split_backward_exact(
        returns: str, recompute: str, schedule: str, split_at: list[str]) -> None:
    """Split backward (I, then W) of a recomputed last stage with a loss: its starting
    gradients were the loss's total gradients of the outputs, so what flowed into one
    output through another (an encoder state returned beside the logits) counted twice
    (encoder gradients 89% off with except_last, doubled with always). Fixed: the loss
    reads a view of each output, and backward starts from the loss's gradient of those."""
    torch.manual_seed(0)
    model = _EncoderDecoder(returns).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    _logits_loss(model(x), y).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=x[:2], chunks=4,
                             schedule=schedule, loss_fn=_logits_loss,
                             devices=["cpu", "cpu"], recompute=recompute)
    pipe.step(x, y)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        error = ((p.grad - expected[name]).norm() / expected[name].norm()).item()
        assert error < 1e-10, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("command", ["train", "simulate", "trace", "plan", "check", "demo"])
def test_every_command_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``conveyor train --help`` crashed (TypeError: must be real number, not dict): an
    option's help said ">10% faster", and argparse formats help text with %. Fixed: the
    options' help is escaped."""
    from conveyor.cli.main import build_parser

    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args([command, "--help"])
    assert exit.value.code == 0
    assert f"usage: conveyor {command}" in capsys.readouterr().out
