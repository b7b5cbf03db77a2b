"""The zoo's families: one small builder per Hugging Face architecture, each a model from a
tiny config (2 layers, width 16-32, no dropout), the forward kwargs a user would pass
(default kwargs otherwise: no ``use_cache=False``), a loss over its output and a named
split. ``python -m tests.zoo`` pipelines each of them (tests/zoo/harness.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BATCH", "CHUNKS", "FAMILIES", "Case", "Family"]

BATCH = 4   # samples per step
CHUNKS = 2  # micro-batches per step
LENGTH = 8  # tokens per sample (``python -m tests.zoo --length N`` for others: 9, 11, 12
#            make a (loss_sum, count) loss's counts no power of two, which tells rounding
#            inside a float32 norm apart; see conveyor.checking.floor)
VOCAB = 64


@dataclass
class Case:
    """What a family's builder returns: the model (seeded, float32 as built), the whole
    batch as the model takes it (a dict of keyword arguments, or a tensor), the targets,
    a loss of one micro-batch's output and the named split."""

    model: nn.Module
    inputs: Any
    targets: torch.Tensor
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    split_at: list[str]


@dataclass(frozen=True)
class Family:
    """A family of the zoo: its name, kind, builder, and how the reference runs.

    ``per_microbatch``: the model normalises over the batch (batch norm), so the plain
    model's reference runs the same micro-batches as the pipeline. ``dtype``: float64
    unless the family has no float64 kernels. ``float32_grads``: the parameters whose
    gradients the model itself sums over the batch in float32 even in a float64 model
    (compared at float32's 1e-5, the others at float64's 1e-10); ``why`` says why."""

    name: str
    kind: str
    build: Callable[[], Case]
    per_microbatch: bool = False
    dtype: torch.dtype = torch.float64
    float32_grads: str = ""
    why: str = ""


FAMILIES: dict[str, Family] = {}


def family(name: str, kind: str, **options: Any) -> Callable[[Callable[[], Case]],
                                                              Callable[[], Case]]:
    def register(build: Callable[[], Case]) -> Callable[[], Case]:
        FAMILIES[name] = Family(name, kind, build, **options)
        return build
    return register


def transformers() -> Any:
    import transformers as t

    t.utils.logging.set_verbosity_error()
    return t


def ids(vocab: int = VOCAB, length: int | None = None, seed: int = 1) -> torch.Tensor:
    shape = (BATCH, length or LENGTH)  # LENGTH read now: --length may have set it
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def pixels(channels: int = 3, size: int = 32, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, channels, size, size, generator=generator)


def labels(classes: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, classes, (BATCH,), generator=torch.Generator().manual_seed(seed))


def logits_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output["logits"]


def token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every token's logits (no padding: the mean of a micro-batch
    weighted by its share is the whole batch's mean)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def class_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(output), targets)


def tower_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """A two-tower model's loss per pair (its own image with its own text): the diagonal
    of ``logits_per_image``. (A contrastive loss over the whole batch's pairs does not
    split into micro-batches: no pipeline gives the plain model's gradients for it.)"""
    return F.mse_loss(output["logits_per_image"].diagonal(), targets)


def causal_lm(name: str, kind: str, config: str, model: str, split: str,
              options: dict[str, Any] | None = None, **settings: Any) -> None:
    """A decoder-only language model: ``input_ids`` in, next-token logits out."""
    @family(name, kind, **(options or {}))
    def build() -> Case:
        t = transformers()
        torch.manual_seed(0)
        built = getattr(t, model)(getattr(t, config)(vocab_size=VOCAB, **settings))
        return Case(built, {"input_ids": ids()}, ids(seed=2), token_loss, [split])


GROUPED_MM = {"dtype": torch.float32, "why": "the experts' grouped_mm has no float64 kernel"}
FLOAT32_NORMS = {"float32_grads": r"norm\.weight$",
                 "why": "its RMSNorm computes in float32, its weight's gradient summed over "
                        "the batch in float32"}
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "max_position_embeddings": 64}
causal_lm("gpt2", "decoder-only", "GPT2Config", "GPT2LMHeadModel", "transformer.h.1",
          n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
          attn_pdrop=0.0)
causal_lm("gpt-neo", "decoder-only", "GPTNeoConfig", "GPTNeoForCausalLM", "transformer.h.1",
          {"why": "the plain GPT-Neo itself differs by 5.6e-8 between its default "
                  "use_cache=True and the use_cache=False conveyor traces with (it computes "
                  "attention scores in float32); against the plain model called with "
                  "use_cache=False the pipeline is exact (2e-16)"},
          num_layers=2, attention_types=[[["global", "local"], 1]], hidden_size=32,
          num_heads=4, max_position_embeddings=64, window_size=4, embed_dropout=0.0,
          attention_dropout=0.0, resid_dropout=0.0)
causal_lm("gpt-neox", "decoder-only", "GPTNeoXConfig", "GPTNeoXForCausalLM",
          "gpt_neox.layers.1", hidden_dropout=0.0, attention_dropout=0.0, **TINY)
causal_lm("llama", "decoder-only", "LlamaConfig", "LlamaForCausalLM", "model.layers.1",
          num_key_value_heads=2, **TINY)
causal_lm("mistral", "decoder-only", "MistralConfig", "MistralForCausalLM", "model.layers.1",
          num_key_value_heads=2, sliding_window=4, **TINY)
causal_lm("qwen2", "decoder-only", "Qwen2Config", "Qwen2ForCausalLM", "model.layers.1",
          num_key_value_heads=2, **TINY)
causal_lm("qwen3", "decoder-only", "Qwen3Config", "Qwen3ForCausalLM", "model.layers.1",
          num_key_value_heads=2, head_dim=8, **TINY)
causal_lm("gemma", "decoder-only", "GemmaConfig", "GemmaForCausalLM", "model.layers.1",
          FLOAT32_NORMS,
          num_key_value_heads=2, head_dim=8, **TINY)
causal_lm("phi", "decoder-only", "PhiConfig", "PhiForCausalLM", "model.layers.1",
          resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **TINY)
causal_lm("opt", "decoder-only", "OPTConfig", "OPTForCausalLM", "model.decoder.layers.1",
          num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
          word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0,
          attention_dropout=0.0)
causal_lm("bloom", "decoder-only", "BloomConfig", "BloomForCausalLM", "transformer.h.1",
          n_layer=2, hidden_size=32, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)
causal_lm("falcon", "decoder-only", "FalconConfig", "FalconForCausalLM", "transformer.h.1",
          num_hidden_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
          attention_dropout=0.0)
# The decoders a new user tried ``conveyor check`` on first (issue 46): most compute
# their norms, some their softmax or rotary angles, in float32 inside a float64 model.
causal_lm("phi3", "decoder-only", "Phi3Config", "Phi3ForCausalLM", "model.layers.1",
          num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
          pad_token_id=0, **TINY)
causal_lm("gemma2", "decoder-only", "Gemma2Config", "Gemma2ForCausalLM", "model.layers.1",
          FLOAT32_NORMS,
          num_key_value_heads=2, head_dim=8, **TINY)
causal_lm("gemma3", "decoder-only", "Gemma3TextConfig", "Gemma3ForCausalLM", "model.layers.1",
          FLOAT32_NORMS,
          num_key_value_heads=2, head_dim=8, **TINY)
causal_lm("olmo", "decoder-only", "OlmoConfig", "OlmoForCausalLM", "model.layers.1",
          num_key_value_heads=2, pad_token_id=0, **TINY)
causal_lm("olmo2", "decoder-only", "Olmo2Config", "Olmo2ForCausalLM", "model.layers.1",
          num_key_value_heads=2, pad_token_id=0, **TINY)
causal_lm("cohere", "decoder-only", "CohereConfig", "CohereForCausalLM", "model.layers.1",
          FLOAT32_NORMS,
          num_key_value_heads=2, pad_token_id=0, **TINY)
causal_lm("glm", "decoder-only", "GlmConfig", "GlmForCausalLM", "model.layers.1",
          num_key_value_heads=2, head_dim=8, pad_token_id=0, **TINY)
causal_lm("helium", "decoder-only", "HeliumConfig", "HeliumForCausalLM", "model.layers.1",
          FLOAT32_NORMS,
          num_key_value_heads=2, head_dim=8, pad_token_id=0, **TINY)
causal_lm("mamba", "state space", "MambaConfig", "MambaForCausalLM", "backbone.layers.1",
          {"why": "its scan computes in float32 (A = -exp(A_log.float()), residuals in "
                  "float32): the loss and the scan's parameters differ by 5e-8 to 7e-8, "
                  "also against the plain model over the same micro-batches, though the "
                  "traced model is bit-exact on one; conveyor check judges it against the "
                  "model's own float32 floor and matches"},
          num_hidden_layers=2, hidden_size=32, state_size=4, expand=2, conv_kernel=4,
          pad_token_id=0)
causal_lm("mixtral", "mixture of experts", "MixtralConfig", "MixtralForCausalLM",
          "model.layers.1", GROUPED_MM, num_key_value_heads=2, num_local_experts=4,
          num_experts_per_tok=2, **TINY)
causal_lm("qwen2-moe", "mixture of experts", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
          "model.layers.1", GROUPED_MM, num_key_value_heads=2, num_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=32,
          shared_expert_intermediate_size=32, **TINY)


def masked_lm(name: str, config: str, model: str, split: str, **settings: Any) -> None:
    """An encoder-only model: ``input_ids`` and a padding ``attention_mask`` in, logits of
    every token out (a masked language model's head)."""
    @family(name, "encoder-only")
    def build() -> Case:
        t = transformers()
        torch.manual_seed(0)
        built = getattr(t, model)(getattr(t, config)(vocab_size=VOCAB, **settings))
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[1, 5:] = mask[3, 6:] = 0  # padding in both micro-batches
        return Case(built, {"input_ids": ids(), "attention_mask": mask}, ids(seed=2),
                    token_loss, [split])


BERT = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}
masked_lm("bert", "BertConfig", "BertForMaskedLM", "bert.encoder.layer.1", **BERT)
masked_lm("roberta", "RobertaConfig", "RobertaForMaskedLM", "roberta.encoder.layer.1",
          pad_token_id=1, **BERT)
masked_lm("electra", "ElectraConfig", "ElectraForMaskedLM", "electra.encoder.layer.1",
          embedding_size=16, **BERT)
masked_lm("albert", "AlbertConfig", "AlbertForMaskedLM", "predictions", embedding_size=16,
          **BERT)  # one layer, shared by every depth: cut before its head
masked_lm("distilbert", "DistilBertConfig", "DistilBertForMaskedLM",
          "distilbert.transformer.layer.1", n_layers=2, dim=32, hidden_dim=64, n_heads=4,
          max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)


def seq2seq(name: str, config: str, model: str, split: str, **settings: Any) -> None:
    """An encoder-decoder: ``input_ids`` and ``decoder_input_ids`` in, the decoder's logits
    out (beside the encoder's last hidden state, which the model returns too)."""
    @family(name, "encoder-decoder")
    def build() -> Case:
        t = transformers()
        torch.manual_seed(0)
        built = getattr(t, model)(getattr(t, config)(vocab_size=VOCAB, **settings))
        inputs = {"input_ids": ids(), "decoder_input_ids": ids(seed=3)}
        return Case(built, inputs, ids(seed=2), token_loss, [split])


BART = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 32, "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "max_position_embeddings": 64, "dropout": 0.0, "attention_dropout": 0.0,
        "activation_dropout": 0.0, "pad_token_id": 1, "decoder_start_token_id": 2}
seq2seq("t5", "T5Config", "T5ForConditionalGeneration", "decoder.block.0", d_model=32, d_kv=8,
        d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)
seq2seq("bart", "BartConfig", "BartForConditionalGeneration", "model.decoder.layers.0", **BART)
seq2seq("mbart", "MBartConfig", "MBartForConditionalGeneration", "model.decoder.layers.0",
        **BART)
seq2seq("pegasus", "PegasusConfig", "PegasusForConditionalGeneration",
        "model.decoder.layers.0", **BART)


@family("whisper", "speech (encoder-decoder)")
def whisper() -> Case:
    """Log-mel features (8 bins x 32 frames) and decoder ids in, the decoder's logits out."""
    t = transformers()
    torch.manual_seed(0)
    config = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2,
                             decoder_layers=2, d_model=32, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=64,
                             decoder_ffn_dim=64, max_source_positions=16,
                             max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                             activation_dropout=0.0, pad_token_id=1, bos_token_id=1,
                             eos_token_id=2, decoder_start_token_id=1,
                             suppress_tokens=[], begin_suppress_tokens=[])
    features = torch.randn(BATCH, 8, 32, generator=torch.Generator().manual_seed(1))
    return Case(t.WhisperForConditionalGeneration(config),
                {"input_features": features, "decoder_input_ids": ids(seed=3)}, ids(seed=2),
                token_loss, ["model.decoder.layers.0"])


@family("wav2vec2", "speech (encoder)")
def wav2vec2() -> Case:
    """Raw audio (400 samples) in, a class per clip out; no time masking (SpecAugment draws
    its masks with numpy, outside any generator a pipeline could replay)."""
    t = transformers()
    torch.manual_seed(0)
    config = t.Wav2Vec2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64,
                              conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
                              num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                              hidden_dropout=0.0, attention_dropout=0.0,
                              activation_dropout=0.0, feat_proj_dropout=0.0,
                              final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
                              num_labels=3, classifier_proj_size=16)
    audio = torch.randn(BATCH, 400, generator=torch.Generator().manual_seed(1))
    return Case(t.Wav2Vec2ForSequenceClassification(config), {"input_values": audio},
                labels(3), class_loss, ["wav2vec2.encoder.layers.1"])


def classifier(name: str, config: str, model: str, split: str, **settings: Any) -> None:
    """A vision model: 32x32 RGB images in, one of 3 classes out."""
    batch_norm = {"per_microbatch": True,
                  "why": "batch norm: the reference runs the pipeline's micro-batches"}
    @family(name, "vision", **(batch_norm if name == "resnet" else {}))
    def build() -> Case:
        t = transformers()
        torch.manual_seed(0)
        built = getattr(t, model)(getattr(t, config)(num_labels=3, **settings))
        return Case(built, {"pixel_values": pixels()}, labels(3), class_loss, [split])


VIT = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
       "num_attention_heads": 4, "intermediate_size": 64, "hidden_dropout_prob": 0.0,
       "attention_probs_dropout_prob": 0.0}
classifier("vit", "ViTConfig", "ViTForImageClassification", "vit.layers.1", **VIT)
classifier("resnet", "ResNetConfig", "ResNetForImageClassification",
           "resnet.encoder.stages.1", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
classifier("convnext", "ConvNextConfig", "ConvNextForImageClassification",
           "convnext.encoder.stages.1", hidden_sizes=[16, 32], depths=[1, 1], patch_size=4,
           num_stages=2)
classifier("swin", "SwinConfig", "SwinForImageClassification", "swin.encoder.layers.1",
           image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
           window_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
           drop_path_rate=0.0)


def two_tower(name: str, config: str, model: str, text: dict[str, Any],
              vision: dict[str, Any]) -> None:
    """Image and text towers: ``input_ids`` and ``pixel_values`` in, each image's
    similarity to its own text out; split between the towers (the text tower runs
    second)."""
    @family(name, "multimodal (two-tower)")
    def build() -> Case:
        t = transformers()
        torch.manual_seed(0)
        built = getattr(t, model)(getattr(t, config)(text_config=text, vision_config=vision))
        targets = torch.randn(BATCH, generator=torch.Generator().manual_seed(2))
        return Case(built, {"input_ids": ids(), "pixel_values": pixels()}, targets,
                    tower_loss, ["text_model"])


TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "attention_dropout": 0.0}
two_tower("clip", "CLIPConfig", "CLIPModel",
          {"vocab_size": VOCAB, "max_position_embeddings": 64, **TOWER},
          {"image_size": 32, "patch_size": 8, **TOWER})
two_tower("siglip", "SiglipConfig", "SiglipModel",
          {"vocab_size": VOCAB, "max_position_embeddings": 64, **TOWER},
          {"image_size": 32, "patch_size": 8, **TOWER})
