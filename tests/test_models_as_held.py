"""Models as users hold them: a Hugging Face GPT-2 with its default forward arguments and
no sample, inputs by name in any order, a first micro-batch of one row, and a second
pipeline of the same model that reuses the first one's trace."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.graph import tracing
from conveyor.graph.firstcall import cuts_at_first_step
from tests.support.any_models import quiet_transformers
from tests.support.user_models import TiedLM


def scaled_error(got: torch.Tensor, expected: torch.Tensor, scale: float) -> float:
    return float((got - expected).abs().max()) / scale


def gradients_match(pipe: nn.Module, reference: nn.Module) -> None:
    expected = dict(reference.named_parameters(remove_duplicate=False))
    got = {name: p for name, p in pipe.named_parameters() if p.grad is not None}
    assert set(got) == set(expected)
    scale = max(float(p.grad.abs().max()) for p in expected.values() if p.grad is not None)
    for name, param in got.items():
        assert expected[name].grad is not None
        assert scaled_error(param.grad, expected[name].grad, scale) < 1e-10, name


def test_gpt2_with_default_kwargs_and_no_sample_trains_exactly(
        caplog: pytest.LogCaptureFixture) -> None:
    """use_cache defaults to True; the first micro-batch is the sample; the optimizer,
    built before the cut, holds the embedding but not the head's copy of it."""
    t = quiet_transformers()
    config = t.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = t.GPT2LMHeadModel(config).double()
    reference = copy.deepcopy(model)

    def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())

    with caplog.at_level(logging.INFO, logger="conveyor"):
        pipe = conveyor.Pipeline(model, stages=2, loss_fn=loss_fn, chunks=4)
        assert "cut at the first call" in repr(pipe)
        with pytest.raises(conveyor.ConveyorError, match=r"cuts the model at its first call "
                                                         r".*call step\(\) or eval_step\(\)"):
            pipe.balance  # noqa: B018
        assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()]
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        ids = torch.randint(0, 50, (7, 5), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            loss = pipe.step({"input_ids": ids}, ids)
            expected = loss_fn(reference(input_ids=ids), ids)
            expected.backward()
            assert abs(float(loss) - float(expected.detach())) < 1e-12
            gradients_match(pipe, reference)
            optimizer.step()
            expected_optimizer.step()
            optimizer.zero_grad()
            expected_optimizer.zero_grad()
    assert pipe.split_at == ["transformer.h.1"]
    head = pipe.state_dict()["lm_head.weight"]
    assert pipe.get_parameter("lm_head.weight") is not pipe.get_parameter("transformer.wte.weight")
    assert float((head - reference.lm_head.weight.detach()).abs().max()) < 1e-12  # followed
    said = caplog.text
    assert "with use_cache=False" in said and "on the first micro-batch" in said


class Named(nn.Module):
    """forward(ids, mask=None, scale=1.0): inputs by name, one of them optional."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
        x = self.embedding(ids) * scale
        if mask is not None:
            x = x * mask.unsqueeze(-1)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.sum(-1)


def test_inputs_by_name_in_any_order_and_a_one_row_first_microbatch() -> None:
    """The sample names (mask, ids), the step gives (ids, mask) of 4 rows in 4
    micro-batches: the trace must not fix the batch to one row, as the next step has 7."""
    torch.manual_seed(0)
    model = Named().double()
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=3, loss_fn=F.mse_loss, chunks=4)
    generator = torch.Generator().manual_seed(2)
    for rows in (4, 7):
        ids = torch.randint(0, 10, (rows, 3), generator=generator)
        mask = torch.rand(rows, 3, generator=generator, dtype=torch.float64)
        targets = torch.randn(rows, 3, generator=generator, dtype=torch.float64)
        batch = {"ids": ids, "mask": mask} if rows == 4 else {"mask": mask, "ids": ids}
        loss = pipe.step(batch, targets)
        expected = F.mse_loss(reference(ids, mask=mask), targets)
        expected.backward()
        assert abs(float(loss) - float(expected.detach())) < 1e-12
        gradients_match(pipe, reference)
        pipe.zero_grad()
        reference.zero_grad()
    with pytest.raises(conveyor.ModelError, match=r"traced Named on a sample with the inputs "
                                                  r"\['ids', 'mask'\], but this micro-batch "
                                                  r"lacks \['mask'\]"):
        pipe.step({"ids": ids}, targets)


def test_inference_as_the_first_call_cuts_on_its_first_microbatch() -> None:
    """Without sample=, eval_step (and pipe(x)) cut on their first call as step does."""
    torch.manual_seed(0)
    model = Named().double().eval()
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=2, loss_fn=F.mse_loss, chunks=2)
    ids = torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(3))
    assert "cut at the first call" in repr(pipe)
    assert torch.allclose(pipe({"ids": ids}), reference(ids), rtol=1e-12, atol=0)
    assert pipe.balance == [1, 1] and pipe.split_at is not None


def test_a_second_pipeline_of_the_same_model_reuses_its_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TiedLM's head shares the embedding: the first cut gives the head a copy, the
    second puts the weight back and finds the trace of the model as built."""
    exports: list[str] = []
    export = torch.export.export

    def counted(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        exports.append(type(model).__name__)
        return export(model, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    model, ids = TiedLM(), torch.randint(0, 10, (4, 3))
    first = conveyor.GPipe(model, stages=2, sample=ids, chunks=2)
    assert exports == ["TiedLM", "TiedLM"]  # training (the cut chosen, then cut) and eval
    assert model.head.weight is not model.embedding.weight  # stage 1's copy
    second = conveyor.GPipe(model, stages=2, sample=ids, chunks=2)
    assert exports == ["TiedLM", "TiedLM"]
    assert len(second.runtime.layout.ties) == len(first.runtime.layout.ties) == 1
    with torch.no_grad():
        model.blocks[0].weight.add_(1.0)  # a new version: traced again
    conveyor.GPipe(model, stages=2, sample=ids, chunks=2)
    assert exports == ["TiedLM"] * 4
    assert tracing._programs[model]  # kept per model, weakly


def test_without_sample_under_torchrun_or_on_meta_the_pipeline_says_to_pass_one() -> None:
    with pytest.raises(conveyor.BalanceError, match=r"under torchrun every rank cuts it.*"
                                                    r"pass sample="):
        cuts_at_first_step(TiedLM(), None, None, distributed=True)
    with torch.device("meta"):
        meta = TiedLM()
    with pytest.raises(conveyor.BalanceError, match=r"TiedLM is on the meta device.*pass "
                                                    r"sample="):
        conveyor.Pipeline(meta, stages=2, loss_fn=F.mse_loss, chunks=2)
    assert not cuts_at_first_step(nn.Sequential(nn.Linear(2, 2)), None, None,
                                  distributed=True)
