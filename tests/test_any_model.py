"""Any nn.Module, cut at named submodules: models nobody here wrote (Hugging Face GPT-2,
Llama, BERT, ResNet, built from small configurations) and a U-Net whose first skip goes
from stage 0 straight to stage 2, each as constructed, against the plain model in
float64. (Llama's rotary tables and mask go from stage 0 to stage 2 too, without
gradients.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.graph.tracedstage import as_call
from conveyor.engine.microbatch import split
from conveyor.errors import BalanceError, ModelError
from tests.crossing import UNet
from tests.extras import require
from tests.models import relative_error
from tests.multiprocess import launch
from tests.scenarios import ANY_MODEL_CASES, PAD

CHUNKS = 4
SCHEDULES = ["gpipe", "1f1b", "zero-bubble"]


def quiet_transformers() -> Any:
    transformers = require("transformers")
    transformers.utils.logging.set_verbosity_error()
    return transformers


def unet() -> tuple[nn.Module, list[str], Any, Any]:
    generator = torch.Generator().manual_seed(1)
    return (UNet(), ["up2", "up1"], torch.randn(10, 2, 8, 8, generator=generator),
            torch.randn(10, 2, 8, 8, generator=generator))


def tokens(vocab: int = 100, length: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (10, length), generator=generator),
            torch.randint(0, vocab, (10, length), generator=generator))


def gpt2() -> tuple[nn.Module, list[str], Any, Any]:
    t = quiet_transformers()
    config = t.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
                          bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0)
    ids, targets = tokens()
    return (t.GPT2LMHeadModel(config), ["transformer.h.2"],
            {"input_ids": ids, "use_cache": False}, targets)


def llama() -> tuple[nn.Module, list[str], Any, Any]:
    t = quiet_transformers()
    config = t.LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    ids, targets = tokens()
    return (t.LlamaForCausalLM(config), ["model.layers.1", "model.layers.3"],
            {"input_ids": ids, "use_cache": False}, targets)


def bert() -> tuple[nn.Module, list[str], Any, Any]:
    t = quiet_transformers()
    config = t.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=32,
                          max_position_embeddings=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    ids, targets = tokens(vocab=50)
    mask = torch.ones_like(ids)
    for row in range(10):  # padding of every length, so micro-batches count differently
        mask[row, max(2, 9 - row):] = 0
    targets = targets.masked_fill(mask == 0, PAD)
    return (t.BertForMaskedLM(config), ["bert.encoder.layer.1"],
            {"input_ids": ids, "attention_mask": mask}, targets)


def resnet() -> tuple[nn.Module, list[str], Any, Any]:
    t = quiet_transformers()
    config = t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                            depths=[1, 1], num_labels=3)
    generator = torch.Generator().manual_seed(1)
    return (t.ResNetForImageClassification(config), ["resnet.encoder.stages.1"],
            torch.randn(10, 3, 16, 16, generator=generator),
            torch.randint(0, 3, (10,), generator=generator))


MODELS: dict[str, Callable[[], tuple[nn.Module, list[str], Any, Any]]] = {
    "unet": unet, "gpt2": gpt2, "llama": llama, "bert": bert, "resnet": resnet}


def output_of(result: Any) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result["logits"]


def loss_of(name: str) -> Callable[[Any, Any], Any]:
    """Per micro-batch: a (sum, count) token loss for the language models (BERT's
    padding makes the counts differ), a mean for the others."""
    def token_loss(result: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = output_of(result)
        total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD,
                                reduction="sum")
        return total, (targets != PAD).sum()

    if name == "unet":
        return lambda result, targets: F.mse_loss(result, targets)
    if name == "resnet":
        return lambda result, targets: F.cross_entropy(output_of(result), targets)
    return token_loss


def plain_loss(name: str, result: Any, targets: torch.Tensor) -> torch.Tensor:
    loss = loss_of(name)(result, targets)
    return loss[0] / loss[1] if isinstance(loss, tuple) else loss


def plain_run(name: str, model: nn.Module, inputs: Any, targets: Any) -> tuple[torch.Tensor, Any]:
    """The plain model's loss on the whole batch, and its output; batch norm (ResNet)
    over the same micro-batches, as the pipeline normalises them."""
    def call(batch: Any) -> Any:
        args, kwargs = as_call(batch)
        return model(*args, **kwargs)

    if name == "resnet":
        result = torch.cat([output_of(call(part)) for part in split(inputs, CHUNKS)])
    else:
        result = call(inputs)
    return plain_loss(name, result, targets), result


def plain_step(name: str, reference: nn.Module, inputs: Any, targets: Any) -> torch.Tensor:
    """The plain model's loss on the whole batch, its gradients in ``reference``."""
    expected, result = plain_run(name, reference, inputs, targets)
    if name in ("llama", "gpt2", "bert"):
        # The pipeline back-propagates the summed token loss and divides the gradients by
        # the count at the end; so does the reference here. (Llama's RMSNorm computes in
        # float32 even in a float64 model, so dividing before backward instead differs at
        # float32's precision, in the plain model alone as well.)
        total, count = loss_of(name)(result, targets)
        total.backward()
        for param in reference.parameters():
            if param.grad is not None:
                param.grad /= count
    else:
        expected.backward()
    return expected.detach()


def build(name: str) -> tuple[nn.Module, nn.Module, list[str], Any, Any]:
    torch.manual_seed(0)
    model, split_at, inputs, targets = MODELS[name]()
    model = model.double()
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.double()
    if isinstance(targets, torch.Tensor) and targets.is_floating_point():
        targets = targets.double()
    return model, copy.deepcopy(model), split_at, inputs, targets


def assert_model_grads(pipe: nn.Module, reference: nn.Module) -> None:
    """Every parameter of the pipeline has the plain model's name and gradient, and every
    parameter of the plain model is there (a tie across stages as one copy per stage;
    within a stage, as in the plain model, one Parameter under several names)."""
    plain = dict(reference.named_parameters(remove_duplicate=False))
    names = [name for name, _ in pipe.named_parameters()]
    assert set(names) <= set(plain)
    assert {id(plain[name]) for name in names} == {id(p) for p in reference.parameters()}
    # Some gradients are zero in theory (BERT's key bias: softmax ignores a shift) and
    # roundoff in practice: measured against the whole gradient's norm.
    scale = torch.stack([p.grad.norm() for p in reference.parameters()]).norm()
    for name, param in pipe.named_parameters():
        expected = plain[name].grad
        assert param.grad is not None and expected is not None, name
        error = float((param.grad - expected).norm() / max(expected.norm(), 1e-6 * scale))
        assert error <= 1e-10, f"{name}: relative error {error:.3g}"


def sample_of(inputs: Any) -> Any:
    return split(inputs, CHUNKS)[0]


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
    """One launch of two processes running every case of scenario_any_model."""
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


@pytest.mark.timeout(600)  # the first one waits for the launch
def test_under_torchrun_a_skip_of_a_layer_list_crosses_ranks(torchrun: Path) -> None:
    from tests.test_skip import long_skip

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
