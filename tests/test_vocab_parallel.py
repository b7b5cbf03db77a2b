"""``loss_fn=conveyor.VocabParallelCrossEntropy(head)``: the head and its cross-entropy
split by vocabulary over every rank, with the loss and gradients of the plain model in
float64, under every schedule, with recomputation and offload, on a traced Hugging Face
model; its state dict holds the head whole and inference returns the whole logits."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import ConveyorError
from conveyor.distributed.topology import Topology
from conveyor.runtime.vocabranks import refuse_across_processes
from conveyor.runtime.vocabulary import SHARDED
from tests.support.any_models import quiet_transformers, sample_of, tokens
from tests.support.cases import SCHEDULES, case_batch, case_model
from tests.support.models import relative_error

PAD = -100


def _untied_lm() -> tuple[nn.Sequential, str]:
    """The tied LM of the cases with a head of its own; the head's name."""
    model, _ = case_model("lm")
    head = model[-1]
    head.weight = nn.Parameter(head.weight.detach().clone())
    return model, str(len(model) - 1)


def _plain_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                       ignore_index=PAD)


def _check(pipe: conveyor.Pipeline, reference: nn.Module, head: str, loss: torch.Tensor,
           expected: torch.Tensor) -> None:
    """The loss, every stage's gradients and the shards' (the plain head's rows)."""
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    plain = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        if not name.startswith("vocab_shards."):
            assert relative_error(p.grad, plain[name].grad) <= 1e-10, name
    assert pipe.vocab_shards is not None
    for kind, sharded in SHARDED.items():
        shards = getattr(pipe.vocab_shards, sharded)
        if shards is not None:
            whole = torch.cat([shard.grad for shard in shards.values()])
            assert relative_error(whole, plain[f"{head}.{kind}"].grad) <= 1e-10, kind


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize(("schedule", "virtual", "ranks"), SCHEDULES)
def test_the_split_head_gives_the_plain_model_loss_and_gradients(
        schedule: str, virtual: int, ranks: int, checkpoint: str) -> None:
    model, head = _untied_lm()
    reference = copy.deepcopy(model)
    loss_fn = conveyor.VocabParallelCrossEntropy(head, ignore_index=PAD)
    pipe = conveyor.Pipeline(model, stages=ranks, devices=["cpu"] * ranks, chunks=6,
                             schedule=schedule, virtual_stages=virtual, checkpoint=checkpoint,
                             loss_fn=loss_fn)
    x, y = case_batch("lm", batch=12)
    y[:2, 2:] = PAD  # the first micro-batch is mostly padding: tokens weigh, not rows
    loss = pipe.step(x, y)
    expected = _plain_loss(reference(x), y)
    expected.backward()
    _check(pipe, reference, head, loss, expected)
    # Each rank's device holds one shard: V/K rows each.
    rows = [w.shape[0] for w in pipe.vocab_shards.weights.values()]
    assert len(rows) == ranks and max(rows) - min(rows) <= 1


def test_a_head_with_a_bias_and_offloaded_activations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 11)).double()
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, balance=[2, 2, 1], devices=["cpu"] * 3, chunks=4,
                             schedule="zero-bubble", recompute="never", offload="activations",
                             loss_fn=conveyor.VocabParallelCrossEntropy("4"))
    x = torch.randn(16, 6, dtype=torch.float64)
    y = torch.randint(0, 11, (16,))
    loss = pipe.step(x, y)
    expected = nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    _check(pipe, reference, "4", loss, expected)


def _gpt2(tied: bool) -> tuple[nn.Module, dict, torch.Tensor]:
    t = quiet_transformers()
    config = t.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          tie_word_embeddings=tied)
    torch.manual_seed(0)
    ids, targets = tokens()
    return t.GPT2LMHeadModel(config).double(), {"input_ids": ids, "use_cache": False}, targets


def test_a_traced_hugging_face_model_keeps_its_head_whole_in_its_state_dict() -> None:
    model, inputs, targets = _gpt2(tied=False)
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, split_at=["transformer.h.2"], sample=sample_of(inputs),
                             devices=["cpu"] * 2, chunks=5, schedule="1f1b",
                             loss_fn=conveyor.VocabParallelCrossEntropy("lm_head"))
    loss = pipe.step(inputs, targets)
    expected = _plain_loss(reference(**inputs).logits, targets)
    expected.backward()
    _check(pipe, reference, "lm_head", loss, expected)
    # The state dict is the plain model's: the head whole under its own name.
    state = pipe.state_dict()
    assert not any(key.startswith("vocab_shards") for key in state)
    reference.load_state_dict(state)  # strict: every key, and no other
    with torch.no_grad():
        pipe.vocab_shards.weights["0"].zero_()
    pipe.load_state_dict(reference.state_dict())
    assert torch.equal(torch.cat(list(pipe.vocab_shards.weights.values())), reference.lm_head.weight)
    # Inference: the whole head's logits.
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        logits = pipe(inputs).logits
        assert relative_error(logits, reference(**inputs).logits) <= 1e-12


def test_the_split_head_says_what_it_cannot_split() -> None:
    model, inputs, _ = _gpt2(tied=True)
    with pytest.raises(ConveyorError, match="tied to transformer.wte.weight"):
        conveyor.Pipeline(model, split_at=["transformer.h.2"], sample=sample_of(inputs),
                          devices=["cpu"] * 2, chunks=2,
                          loss_fn=conveyor.VocabParallelCrossEntropy("lm_head"))
    with pytest.raises(ConveyorError, match="no module 'head'"):
        conveyor.Pipeline(_untied_lm()[0], stages=2, devices=["cpu"] * 2, chunks=2,
                          loss_fn=conveyor.VocabParallelCrossEntropy("head"))
    with pytest.raises(ConveyorError, match="not an nn.Linear"):
        conveyor.Pipeline(_untied_lm()[0], stages=2, devices=["cpu"] * 2, chunks=2,
                          loss_fn=conveyor.VocabParallelCrossEntropy("4"))
    with pytest.raises(ConveyorError, match="outside one"):
        conveyor.VocabParallelCrossEntropy()(torch.zeros(2, 3), torch.zeros(2))


def test_across_processes_the_split_head_refuses_what_it_does_not_take() -> None:
    """Under torchrun (tested exact across 2 and 4 processes in tests/test_distributed.py,
    the equivalence scenario's "vlm" cases) a vocabulary-parallel head refuses FSDP,
    float16 loss scaling and re-balancing, naming each."""
    with pytest.raises(ConveyorError, match=r'sharding="fsdp", precision="fp16"'):
        refuse_across_processes(Topology(pipeline_size=2), sharding="fsdp", precision="fp16",
                                rebalance=None)
    refuse_across_processes(Topology(pipeline_size=2), sharding="replicate",
                            precision="bf16", rebalance=None)
