"""``Pipeline.step(microbatches=[...])``: micro-batches the caller made, each its own
shape (its own sequence length), against the plain model run on the same micro-batches
in float64, under every schedule."""

from __future__ import annotations

import copy
import operator

import pytest

import conveyor
from conveyor.errors import ConveyorError, MicroBatchError
from tests.support.any_models import gpt2, llama, loss_of
from tests.support.cases import (
    SCHEDULES,
    case_model,
    lengths_batch,
    lm_loss,
    packed,
    plain_token_loss,
    token_loss,
)
from tests.support.extras import require
from tests.support.models import relative_error



@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
@pytest.mark.parametrize(("schedule", "virtual", "ranks"), SCHEDULES)
def test_micro_batches_of_their_own_lengths_equal_the_plain_model(
        schedule: str, virtual: int, ranks: int, checkpoint: str) -> None:
    model, _ = case_model("lm")  # tied embedding and head
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=ranks, devices=["cpu"] * ranks, chunks=4,
                             schedule=schedule, virtual_stages=virtual,
                             checkpoint=checkpoint, loss_fn=lm_loss)
    pairs = lengths_batch()
    loss = pipe.step(microbatches=pairs)
    rows = sum(len(x) for x, _ in pairs)  # a scalar loss: each its rows' share
    expected = sum(lm_loss(reference(x), y) * len(x) / rows for x, y in pairs)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    plain = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        assert relative_error(p.grad, plain[name].grad) <= 1e-10, name
    # A token loss over all micro-batches, and fewer micro-batches than the table's M.
    pipe.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    pipe.loss_fn = token_loss
    padded = lengths_batch(seed=4, pad=True)[:3]
    loss = pipe.step(microbatches=padded)
    counts = sum(int((y != -100).sum()) for _, y in padded)
    expected = sum(plain_token_loss(reference(x), y) * int((y != -100).sum()) / counts
                   for x, y in padded)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    for name, p in pipe.named_parameters():
        assert relative_error(p.grad, plain[name].grad) <= 1e-10, f"token: {name}"


def test_given_micro_batches_say_what_is_wrong() -> None:
    model, _ = case_model("lm")
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2, loss_fn=lm_loss)
    pairs = lengths_batch()
    with pytest.raises(MicroBatchError, match=r"4 micro-batches given, but the pipeline's "
                                              r"table runs at most chunks=2; make the "
                                              r"pipeline with chunks=4"):
        pipe.step(microbatches=pairs)
    with pytest.raises(MicroBatchError, match=r"a non-empty list of \(inputs, targets\)"):
        pipe.step(microbatches=[pairs[0][0]])
    with pytest.raises(MicroBatchError, match=r"micro-batch 1: the targets have 2 rows but "
                                              r"the inputs 1"):
        pipe.step(microbatches=[pairs[0], (pairs[1][0], pairs[2][1])])
    with pytest.raises(ConveyorError, match=r"a batch \(inputs, targets\) or microbatches=, "
                                            r"not both"):
        pipe.step(*pairs[0], microbatches=pairs[:1])
    assert all(p.grad is None for p in pipe.parameters())  # nothing ran


@pytest.mark.parametrize(("family", "schedule"), [("gpt2", "1f1b"), ("gpt2", "zero-bubble"),
                                                  ("llama", "1f1b")])
def test_packed_sequences_through_a_traced_hugging_face_lm_are_exact_and_trace_once(
        family: str, schedule: str) -> None:
    """GPT-2 and Llama from tiny configs, traced and cut at blocks: micro-batches of
    packed documents of three lengths, then of two more, against the plain model on
    each; the stages are traced once (on the first micro-batch), not per length. The
    plain model back-propagates the summed token loss and divides its gradients by the
    count after, as the pipeline does (Llama's RMSNorm computes in float32 even in a
    float64 model: dividing first differs at float32's precision, 1e-7)."""
    require("transformers")
    model, split_at, _, _ = {"gpt2": gpt2, "llama": llama}[family]()
    model = model.double()
    reference = copy.deepcopy(model)
    loss_fn = loss_of(family)
    pipe = conveyor.Pipeline(model, split_at=split_at, chunks=3, schedule=schedule,
                             loss_fn=loss_fn, devices=["cpu"] * (len(split_at) + 1))
    plain = dict(reference.named_parameters(remove_duplicate=False))
    traced = []
    for seed, docs in ((1, ((3, 4), (5, 2, 6), (2,))), (2, ((9,), (1, 1, 4)))):
        pipe.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        pairs = packed(docs, seed)
        loss = pipe.step(microbatches=pairs)
        tokens = sum(y.numel() for _, y in pairs)
        total = sum(loss_fn(reference(**x), y)[0] for x, y in pairs)
        total.backward()
        for param in reference.parameters():
            param.grad /= tokens
        expected = total / tokens
        assert abs(loss.item() - expected.item()) <= 1e-12 * expected.item()
        for name, p in pipe.named_parameters():
            assert relative_error(p.grad, plain[name].grad) <= 1e-10, f"{seed}: {name}"
        traced.append([graph for stage in pipe.runtime.stages.values()
                       for graph in stage.layers[0].graphs()])
    assert len(traced[0]) == len(traced[1]) and all(map(operator.is_, *traced))  # traced once
