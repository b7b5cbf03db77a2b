"""Regressions: each test here failed before the fix named in its docstring."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.support.extras import require
from tests.support.cases import KeptApart


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


@pytest.mark.parametrize("kept_apart", [False, True])
@pytest.mark.parametrize("returns", ["encoder", "hidden"])
@pytest.mark.parametrize("recompute", ["always", "except_last"])
@pytest.mark.parametrize("schedule,split_at", [("zero-bubble", ["dec"]),
                                               ("zb-v", ["mid", "dec", "head"]),
                                               ("dualpipe-v", ["mid", "dec", "head"])])
def test_a_returned_value_made_earlier_keeps_split_backward_exact(
        returns: str, recompute: str, schedule: str, split_at: list[str],
        kept_apart: bool) -> None:
    """Split backward (I, then W) of a recomputed last stage with a loss: its starting
    gradients were the loss's total gradients of the outputs, so what flowed into one
    output through another (an encoder state returned beside the logits) counted twice
    (encoder gradients 89% off with except_last, doubled with always). Fixed: the loss
    reads a view of each output, and backward starts from the loss's gradient of those.
    A loss recomputed with the stage (the default since) is computed again on the
    rebuilt outputs; ``kept_apart``: one that is not, on views as before."""
    torch.manual_seed(0)
    model = _EncoderDecoder(returns).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    _logits_loss(model(x), y).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=x[:2], chunks=4,
                             schedule=schedule, devices=["cpu", "cpu"], recompute=recompute,
                             loss_fn=KeptApart(_logits_loss) if kept_apart else _logits_loss)
    pipe.step(x, y)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        error = ((p.grad - expected[name]).norm() / expected[name].norm()).item()
        assert error < 1e-10, f"{name}: relative error {error:.3g}"


def test_t5_split_at_its_decoder_trains_exactly_under_zero_bubble() -> None:
    """The same defect on a model nobody here wrote: T5 (from a tiny config) returns its
    encoder's last hidden state beside the logits; split at its decoder, zero-bubble with
    recomputation got the encoder's gradients 95% off. Fixed with the test above."""
    transformers = require("transformers")
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).double().train()
    batch = {"input_ids": torch.randint(3, 32, (4, 6)),
             "decoder_input_ids": torch.randint(3, 32, (4, 6))}
    labels = torch.randint(3, 32, (4, 6))

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits = out["logits"]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    loss_fn(model(**batch), labels).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()
                if p.grad is not None}
    model.zero_grad(set_to_none=True)
    pipe = conveyor.Pipeline(model, split_at=["decoder"], chunks=2, schedule="zero-bubble",
                             sample={k: v[:2] for k, v in batch.items()}, loss_fn=loss_fn,
                             devices=["cpu", "cpu"], recompute="always")
    pipe.step(batch, labels)
    grads = dict(model.named_parameters())
    for part in ("encoder", "decoder"):
        names = [n for n in expected if part in n]
        got = torch.cat([grads[n].grad.flatten() for n in names])
        want = torch.cat([expected[n].flatten() for n in names])
        assert ((got - want).norm() / want.norm()).item() < 1e-10, part


class _SharedTable(nn.Module):
    """A position table that every block reads directly, under its one name (no module
    of its own to tie through), and a batch norm the user froze in a model that trains."""

    def __init__(self, width: int = 6, blocks: int = 3) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, width))
        self.norm = nn.BatchNorm1d(4)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        for block in self.blocks:
            h = torch.tanh(block(h + self.table))
        return self.head(h).mean(1)


def _shared_table_pair() -> tuple[_SharedTable, _SharedTable]:
    torch.manual_seed(0)
    model = _SharedTable().double().train()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
    model.norm.eval()  # frozen, as fine-tuning keeps it
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_a_parameter_read_by_every_stage_under_one_name_is_tied(schedule: str) -> None:
    """Found by the generator (seed 34 and others): a parameter read by more stages than
    it has names raised "not every stage's copy can have a name of its own". Each further
    copy now has the name ``<name>@stage<k>``, kept out of state dicts."""
    model, plain = _shared_table_pair()
    x, y = torch.randn(8, 4, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    pipe = conveyor.Pipeline(model, split_at=["blocks.1", "blocks.2"], sample=x[:2],
                             chunks=4, schedule=schedule, devices=["cpu"] * 3,
                             recompute="always", loss_fn=nn.functional.cross_entropy)
    loss = pipe.step(x, y)
    expected = nn.functional.cross_entropy(plain(x), y)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item()
    copies = {name: p for name, p in pipe.named_parameters() if name.startswith("table")}
    assert "table@stage1" in copies
    for name, param in copies.items():
        assert torch.allclose(param.grad, plain.table.grad, rtol=1e-10, atol=0), name
    assert list(pipe.state_dict()) == list(plain.state_dict())
    # An optimizer step keeps the copies equal; the state dict loads back into them.
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    assert torch.equal(copies["table@stage1"], copies["table"])
    pipe.load_state_dict(plain.state_dict())
    assert torch.equal(copies["table@stage1"], plain.table)
    # A second pipeline of the same model is cut as the model was built: one table.
    again = conveyor.Pipeline(model, split_at=["blocks.1", "blocks.2"], sample=x[:2],
                              chunks=4, devices=["cpu"] * 3, loss_fn=nn.functional.cross_entropy)
    assert [n for n, _ in again.named_parameters() if n.startswith("table")] == sorted(copies)
    assert list(again.state_dict()) == list(plain.state_dict())


@pytest.mark.parametrize("cut", [{"split_at": ["blocks.1"], "stages": 2}, {"stages": 2}])
def test_a_frozen_batch_norm_stays_frozen_in_a_traced_model_that_trains(
        cut: dict[str, Any]) -> None:
    """Found by the generator (seeds 6 and 52): tracing, and auto split's trace, called
    model.train() on every module, so a batch norm the user had frozen normalised with
    batch statistics in the pipeline (and stayed unfrozen in the user's model)."""
    model, plain = _shared_table_pair()
    x, y = torch.randn(8, 4, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    pipe = conveyor.Pipeline(model, sample=x[:2], chunks=4, loss_fn=nn.functional.cross_entropy,
                             **cut)
    assert model.training and not model.norm.training
    pipe.step(x, y)
    nn.functional.cross_entropy(plain(x), y).backward()
    assert torch.allclose(model.blocks[0].weight.grad, plain.blocks[0].weight.grad,
                          rtol=1e-10, atol=1e-14)
    assert torch.equal(pipe.state_dict()["norm.running_mean"], plain.norm.running_mean)
