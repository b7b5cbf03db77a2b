"""Models nobody here wrote (Hugging Face GPT-2, Llama, BERT, ResNet, built from small
configurations) and a U-Net whose first skip goes from stage 0 straight to stage 2, in
float64, with their batches and losses, the plain model's reference step, and the cases
the any_model scenario runs (tests/test_any_model.py and others compare with them)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.microbatch import split
from conveyor.graph.tracedstage import as_call
from tests.support.cases import PAD
from tests.support.crossing_models import UNet
from tests.support.extras import require

CHUNKS = 4


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


def tied_llama() -> nn.Module:
    """:func:`llama`'s model with its head tied to its embedding, as saved models of
    this kind often are (the head is then stored once, under the embedding's name)."""
    model, *_ = llama()
    model.config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = type(model)(model.config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    return tied


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


def assert_model_grads(pipe: nn.Module, reference: nn.Module, tolerance: float = 1e-10) -> None:
    """Every parameter of the pipeline has the plain model's name and gradient (to a
    relative ``tolerance``), and every parameter of the plain model is there (a tie
    across stages as one copy per stage; within a stage, as in the plain model, one
    Parameter under several names)."""
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
        assert error <= tolerance, f"{name}: relative error {error:.3g}"


def sample_of(inputs: Any) -> Any:
    return split(inputs, CHUNKS)[0]


# Split at (2 ranks) per model, for the any_model scenario; the U-Net also as four stages
# on two ranks (interleaved), its first level's output crossing three stages.
ANY_MODEL_SPLITS = {"unet": ["up1"], "gpt2": ["transformer.h.2"], "llama": ["model.layers.2"],
                    "bert": ["bert.encoder.layer.1"], "resnet": ["resnet.encoder.stages.1"]}
ANY_MODEL_CASES = [(name, schedule, split_at, 1) for name, split_at in ANY_MODEL_SPLITS.items()
                   for schedule in ("gpipe", "1f1b", "zero-bubble")]
ANY_MODEL_CASES.append(("unet", "interleaved-1f1b", ["down2", "up2", "up1"], 2))
# In a V: the U-Net's outer skip and GPT-2's tied head stay on rank 0, with the loss.
ANY_MODEL_CASES += [("unet", "dualpipe-v", ["down2", "up2", "up1"], 1),
                    ("gpt2", "zb-v", ["transformer.h.1", "transformer.h.2", "transformer.h.3"], 1)]
