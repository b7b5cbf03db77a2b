"""conveyor.generate: a causal LM cut into 2 stages on threads decodes with a key/value
cache per stage, token for token as ``model.generate`` (transformers' GPT-2 and Llama
from tiny configs), greedily and by sampling with the same seed; clear refusals."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.distributed.topology import Topology
from conveyor.errors import ConveyorError
from tests.support.any_models import gpt2, llama
from tests.support.models import one_cpu_thread

MODELS: dict[str, Callable[[], tuple[nn.Module, list[str], Any, Any]]] = {
    "gpt2": gpt2, "llama": llama}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_cpu_thread():  # two stage threads and intra-op threads on a busy machine
        yield


@functools.cache
def pipelined(name: str) -> tuple[nn.Module, nn.Module, Any, Any]:
    """The model cut into 2 stages on threads, its plain copy and the prompts (built once
    for the module's tests: decoding changes neither)."""
    torch.manual_seed(0)
    model, split_at, inputs, _ = MODELS[name]()
    model.eval()
    reference = copy.deepcopy(model)
    sample = {"input_ids": inputs["input_ids"][:2], "use_cache": False}
    pipe = conveyor.Pipeline(model, split_at=split_at[:1], stages=2, sample=sample,
                             devices=["cpu"] * 2, chunks=2,
                             loss_fn=lambda out, y: F.cross_entropy(out.logits, y))
    return pipe, model, reference, inputs["input_ids"][:3, :5]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_decoding_gives_model_generate_s_tokens(name: str) -> None:
    pipe, model, reference, prompts = pipelined(name)
    for rows in (prompts[:1], prompts):  # one sequence, and a batch
        ours = conveyor.generate(pipe, model, rows, max_new_tokens=10)
        theirs = reference.generate(rows, max_new_tokens=10, do_sample=False)
        assert ours.shape == theirs.shape == (rows.shape[0], 15)
        assert torch.equal(ours, theirs)
    # Not the prompt echoed: the model's own continuation, cached per stage.
    assert len(set(ours[:, 5:].flatten().tolist())) > 1


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sampling_gives_model_generate_s_tokens_for_the_same_seed(name: str) -> None:
    pipe, model, reference, prompts = pipelined(name)
    options = {"do_sample": True, "temperature": 0.8, "top_k": 30, "top_p": 0.9}
    runs = []
    for seed in (7, 8):
        ours = conveyor.generate(pipe, model, prompts, max_new_tokens=10,
                                 generator=torch.Generator().manual_seed(seed), **options)
        torch.manual_seed(seed)
        theirs = reference.generate(prompts, max_new_tokens=10, **options)
        assert torch.equal(ours, theirs), seed
        runs.append(ours)
    assert not torch.equal(runs[0], runs[1])  # the seed decides


def test_an_end_token_pads_the_rest_of_its_sequence() -> None:
    pipe, model, _, prompts = pipelined("llama")
    ours = conveyor.generate(pipe, model, prompts, max_new_tokens=8, eos_token_id=[])
    ended = conveyor.generate(pipe, model, prompts, max_new_tokens=8,
                              eos_token_id=int(ours[0, 6]), pad_token_id=99)
    assert torch.equal(ended[0, :7], ours[0, :7]) and set(ended[0, 7:].tolist()) == {99}


def test_generate_refuses_what_it_cannot_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, model, _, prompts = pipelined("gpt2")
    with pytest.raises(ConveyorError, match=r"model is not the one the pipeline was built "
                                            r"from \('transformer.wte.weight' is not a "
                                            r"parameter of the pipeline\)"):
        conveyor.generate(pipe, gpt2()[0], prompts, max_new_tokens=2)
    with pytest.raises(ConveyorError, match=r"max_new_tokens must be a positive integer, "
                                            r"got 0"):
        conveyor.generate(pipe, model, prompts, max_new_tokens=0)
    sequence = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    layers = conveyor.GPipe(sequence, balance=[1, 1], devices=["cpu"] * 2)
    with pytest.raises(ConveyorError, match=r"this pipeline runs a sequence of layers: call "
                                            r"eval_step on the whole sequence"):
        conveyor.generate(layers, sequence, prompts, max_new_tokens=2)
    monkeypatch.setattr(Topology, "distributed", property(lambda self: True))
    with pytest.raises(ConveyorError, match=r"under torchrun this process holds only its own "
                                            r"stages; generate in one process"):
        conveyor.generate(pipe, model, prompts, max_new_tokens=2)
