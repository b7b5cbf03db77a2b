"""What a new user met in their second hour with conveyor, each now a test: a Hugging Face
model end to end with the library's token loss, an inference batch smaller than the
chunks, ``conveyor.check`` on a model's default arguments, targets that do not match the
inputs, and labels given where targets belong."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import conveyor
from tests.support.extras import require


def gpt2() -> nn.Module:
    transformers = require("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                     vocab_size=64, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


def ids(rows: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 10), generator=torch.Generator().manual_seed(seed))


def test_token_loss_takes_a_hugging_face_output_and_pads_exactly() -> None:
    model = gpt2()
    plain = copy.deepcopy(model)
    inputs, targets = ids(), ids(seed=1)
    targets[:3, 6:] = -100  # padding, unevenly over the micro-batches
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4,
                             loss_fn=conveyor.token_loss)  # the README's, as it stands
    loss = pipe.step({"input_ids": inputs}, targets)
    total, count = conveyor.token_loss(plain(input_ids=inputs, use_cache=False), targets)
    expected = total / count
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * float(expected)
    for (name, got), (_, want) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.allclose(got.grad, want.grad, rtol=1e-10, atol=1e-13), name


def test_token_loss_names_shapes_that_do_not_match() -> None:
    with pytest.raises(ValueError, match=r"the logits are \(2, 5, 7\), so the targets must "
                                         r"be \(2, 5\), got \(2, 4\)"):
        conveyor.token_loss(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))


def test_a_pipeline_without_a_sample_infers_a_batch_smaller_than_its_chunks() -> None:
    model = gpt2()
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4,
                             loss_fn=conveyor.token_loss).eval()
    with torch.no_grad():
        output = pipe({"input_ids": ids(rows=2)})  # before: MicroBatchError (2 < 4 chunks)
        expected = model(input_ids=ids(rows=2), use_cache=False).logits
    assert torch.allclose(output.logits, expected, rtol=1e-12, atol=1e-12)


def test_check_calls_the_plain_model_as_the_pipeline_does() -> None:
    # Before: the plain reference ran GPT-2 with use_cache=True and returned a cache,
    # which no pipeline returns: "output['cache'] ... differs between micro-batches".
    report = conveyor.check(gpt2(), {"input_ids": ids()}, ids(seed=1),
                            loss_fn=conveyor.token_loss, stages=2, chunks=4)
    assert report.ok, str(report)


def test_targets_with_fewer_rows_than_the_inputs_are_refused_up_front() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4,
                             loss_fn=nn.functional.mse_loss)
    with pytest.raises(conveyor.MicroBatchError, match=r"the targets have 6 rows but the "
                       r"inputs 8: dim 0 is the batch in both"):
        pipe.step(torch.randn(8, 4), torch.randn(6, 2))


def test_labels_given_with_the_inputs_get_the_advice_to_give_them_as_targets() -> None:
    pipe = conveyor.Pipeline(gpt2(), split_at=["transformer.h.1"], devices=["cpu"] * 2,
                             chunks=4, sample={"input_ids": ids(rows=2)},
                             loss_fn=conveyor.token_loss)
    with pytest.raises(conveyor.ModelError, match=r"this micro-batch gives labels, which the "
                       r"sample of GPT2LMHeadModel did not(.|\n)*give them to step\(\) as the "
                       r"targets"):
        pipe.step({"input_ids": ids(), "labels": ids()}, ids())


@pytest.mark.parametrize("schedule, balance, extra", [
    ("1f1b", [2, 6], {}), ("zb-v", [2, 2, 2, 2], {}),
    ("interleaved-1f1b", [2, 2, 2, 2], {"virtual_stages": 2})])
def test_a_balance_list_says_how_many_ranks(schedule: str, balance: list[int],
                                            extra: dict[str, int]) -> None:
    """``Pipeline(model, balance=[2, 6], ...)`` in one process was refused for want of
    ``stages=`` or ``devices=``, though the balance says 2 stages."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    pipe = conveyor.Pipeline(model, balance=balance, chunks=4, schedule=schedule,
                             loss_fn=nn.functional.mse_loss, **extra)
    assert pipe.schedule.num_ranks == 2 and pipe.balance == balance
    with pytest.raises(conveyor.BalanceError, match="not 2 per rank; give stages="):
        conveyor.Pipeline(model, balance=[3, 2, 3], chunks=4, schedule="zb-v",
                          loss_fn=nn.functional.mse_loss)
