"""Any nn.Module, cut at named submodules: models nobody here wrote (Hugging Face GPT-2,
Llama, BERT, ResNet, built from small configurations) and a U-Net whose first skip goes
from stage 0 straight to stage 2, each as constructed, against the plain model in
float64. (Llama's rotary tables and mask go from stage 0 to stage 2 too, without
gradients.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.graph.tracedstage import as_call
from conveyor.errors import BalanceError, ModelError
from tests.support.any_models import (
    ANY_MODEL_CASES,
    CHUNKS,
    MODELS,
    assert_model_grads,
    build,
    llama,
    loss_of,
    output_of,
    plain_loss,
    plain_run,
    plain_step,
    sample_of,
)
from tests.support.launch import launch
from tests.support.models import relative_error
from tests.support.skip_models import long_skip

SCHEDULES = ["gpipe", "1f1b", "zero-bubble"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_splits_the_model_as_constructed(name: str, schedule: str) -> None:
    model, reference, split_at, inputs, targets = build(name)
    stages = len(split_at) + 1
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=sample_of(inputs),
                             stages=stages, devices=["cpu"] * stages, chunks=CHUNKS,
                             schedule=schedule, loss_fn=loss_of(name))
    loss = pipe.step(inputs, targets)
    expected = plain_step(name, reference, inputs, targets)
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item())
    assert_model_grads(pipe, reference)
    # The model's own names, and the plain model's state dict, running statistics too.
    assert list(pipe.state_dict()) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert relative_error(pipe.state_dict()[key].double(), value.double()) <= 1e-10, key


@pytest.mark.parametrize("name", list(MODELS))
def test_gpipe_splits_the_model_as_constructed(name: str) -> None:
    model, reference, split_at, inputs, targets = build(name)
    stages = len(split_at) + 1
    pipe = conveyor.GPipe(model, split_at=split_at, sample=sample_of(inputs),
                          devices=["cpu"] * stages, chunks=CHUNKS)
    args, kwargs = as_call(inputs)
    result = pipe(inputs)
    plain_loss(name, result, targets).backward()
    plain_run(name, reference, inputs, targets)[0].backward()
    assert_model_grads(pipe, reference)
    pipe.eval()
    reference.eval()
    with torch.no_grad():  # the eval-mode trace: batch norm by its running statistics
        expected = reference(*args, **kwargs)
        assert type(result) is type(expected)  # what the model returns
        assert relative_error(output_of(pipe(inputs)), output_of(expected)) <= 1e-12


def test_a_tied_embedding_becomes_a_copy_per_stage_kept_equal() -> None:
    model, reference, split_at, inputs, targets = build("gpt2")
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=sample_of(inputs), stages=2,
                             devices=["cpu"] * 2, chunks=CHUNKS, schedule="1f1b",
                             loss_fn=loss_of("gpt2"))
    first, last = pipe.get_parameter("transformer.wte.weight"), pipe.get_parameter("lm_head.weight")
    assert first is not last and torch.equal(first, last)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        pipe.step(inputs, targets)
        optimizer.step()
        plain_optimizer.zero_grad()
        plain_run("gpt2", reference, inputs, targets)[0].backward()
        plain_optimizer.step()
    assert torch.equal(first, last)
    assert relative_error(first.detach(), reference.lm_head.weight.detach()) <= 1e-10


def test_a_pipelined_state_dict_loads_into_the_plain_model_and_back() -> None:
    model, reference, split_at, inputs, _ = build("llama")
    pipe = conveyor.GPipe(model, split_at=split_at, sample=sample_of(inputs),
                          devices=["cpu"] * 3, chunks=CHUNKS)
    with torch.no_grad():
        for p in pipe.parameters():
            p.mul_(1.5)
    reference.load_state_dict(pipe.state_dict())
    pipe.load_state_dict(reference.state_dict())
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        assert relative_error(output_of(pipe(inputs)),
                              output_of(reference(**inputs))) <= 1e-12


def test_bad_split_points_say_what_to_do() -> None:
    model, _, _, inputs, _ = build("unet")
    sample = sample_of(inputs)
    with pytest.raises(ModelError, match=r"split_at names 'up3', which is not a submodule"):
        conveyor.GPipe(model, split_at=["up3"], sample=sample, devices=["cpu"] * 2)
    with pytest.raises(ModelError, match=r"never runs it after 'up1'; list split_at in the "
                                         r"order the model runs"):
        conveyor.GPipe(model, split_at=["up1", "up2"], sample=sample, devices=["cpu"] * 3)
    with pytest.raises(BalanceError, match=r"pass sample="):
        conveyor.GPipe(model, split_at=["up2"], devices=["cpu"] * 2)
    with pytest.raises(BalanceError, match=r"give balance= \(layers per stage\) for an "
                                           r"nn.Sequential, or split_at="):
        conveyor.GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), devices=["cpu"] * 2)
    with pytest.raises(BalanceError, match=r"split_at gives 2 stages but the schedule has 3"):
        conveyor.Pipeline(model, split_at=["up2"], sample=sample, stages=3,
                          devices=["cpu"] * 3, chunks=2, loss_fn=F.mse_loss)


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of two processes running every case of the any_model scenario."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("any_model")
    model, *_ = build("gpt2")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, out / "gpt2.safetensors")  # as Hugging Face saves it
    outcome = launch("any_model", 2, out, timeout=600)
    assert outcome.returncodes == [0, 0], "\n".join(outcome.outputs)
    return out


def assert_rank_grads(results: list[dict[str, Any]], reference: nn.Module) -> None:
    """Each rank's gradients are the plain model's under the same names, and the ranks
    hold every parameter of the plain model between them."""
    plain = dict(reference.named_parameters(remove_duplicate=False))
    scale = torch.stack([p.grad.norm() for p in reference.parameters()]).norm()
    held = set()
    for result in results:
        for name, grad in result["grads"].items():
            expected = plain[name].grad
            error = float((grad - expected).norm() / max(expected.norm(), 1e-6 * scale))
            assert error <= 1e-10, f"{name}: relative error {error:.3g}"
            held.add(id(plain[name]))
    assert held == {id(p) for p in reference.parameters()}


@pytest.mark.long  # one launch of every model under torchrun (~2 min): make test-all
@pytest.mark.timeout(600)  # the first one waits for the launch
@pytest.mark.parametrize("case", ANY_MODEL_CASES, ids=lambda case: f"{case[0]}-{case[1]}")
def test_under_torchrun_each_rank_holds_its_stage(torchrun: Path, case: tuple[Any, ...]) -> None:
    name, schedule, _, _ = case
    _, reference, _, inputs, targets = build(name)
    expected = plain_step(name, reference, inputs, targets)
    results = [torch.load(torchrun / f"{name}-{schedule}-rank{r}.pt") for r in range(2)]
    for result in results:
        assert abs(result["loss"].item() - expected.item()) <= 1e-10 * abs(expected.item())
    assert_rank_grads(results, reference)
    # Between them the ranks' state dicts have the plain model's keys, in its order.
    keys = list(reference.state_dict())
    held = [key for result in results for key in result["state"]]
    assert set(held) == set(keys)
    for result in results:
        assert result["state"] == [key for key in keys if key in result["state"]]


@pytest.mark.long  # the same launch of every model under torchrun: make test-all
@pytest.mark.timeout(600)  # the first one waits for the launch
def test_under_torchrun_a_meta_model_reads_its_rank_s_weights(torchrun: Path) -> None:
    _, reference, _, inputs, targets = build("gpt2")
    expected = plain_step("gpt2", reference, inputs, targets)
    results = [torch.load(torchrun / f"gpt2-meta-rank{r}.pt") for r in range(2)]
    assert abs(results[0]["loss"].item() - expected.item()) <= 1e-10 * abs(expected.item())
    assert_rank_grads(results, reference)
    plain = reference.state_dict()
    for result in results:
        for key, value in result["state"].items():
            assert torch.equal(value, plain[key]), key
    # Rank 0 holds the embedding and the first blocks only; the head is rank 1's copy.
    assert "transformer.h.3.mlp.c_fc.weight" not in results[0]["state"]
    assert "transformer.wte.weight" not in results[1]["state"]
    assert "lm_head.weight" in results[1]["state"]


@pytest.mark.long  # the same launch of every model under torchrun: make test-all
@pytest.mark.timeout(600)  # the first one waits for the launch
def test_under_torchrun_a_meta_model_starts_as_initialize_gives_it(torchrun: Path) -> None:
    model, *_ = llama()
    with torch.device("meta"):
        meta = type(model)(model.config)
    torch.manual_seed(5)
    expected = conveyor.initialize(meta).state_dict()
    found = {}
    for rank in range(2):
        found.update(torch.load(torchrun / f"llama-meta-rank{rank}.pt"))
    assert set(found) == set(expected)
    for key, value in expected.items():
        assert torch.equal(found[key], value), key
    assert found["model.layers.0.mlp.up_proj.weight"].std() > 0.01  # not left empty


@pytest.mark.long  # the same launch of every model under torchrun: make test-all
@pytest.mark.timeout(600)  # the first one waits for the launch
def test_under_torchrun_a_skip_of_a_layer_list_crosses_ranks(torchrun: Path) -> None:
    _, reference, inputs, targets = long_skip()
    expected = F.mse_loss(reference(inputs.detach()), targets)
    expected.backward()
    results = [torch.load(torchrun / f"skip-rank{r}.pt") for r in range(2)]
    assert abs(results[1]["loss"].item() - expected.item()) <= 1e-10 * expected.item()
    assert_rank_grads(results, reference)


class Branches(nn.Module):
    """Python control flow on a tensor's values: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if x.sum() > 0 else x


def test_a_model_that_cannot_be_traced_names_the_submodule() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Branches(), nn.Linear(4, 4))
    with pytest.raises(ModelError, match=r"tracing Sequential on the sample failed in 1 "
                                         r"\(Branches\): .*\nhint: data-dependent Python "
                                         r"control flow"):
        conveyor.GPipe(model, split_at=["2"], sample=torch.randn(2, 4), devices=["cpu"] * 2)
