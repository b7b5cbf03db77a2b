"""What ``conveyor train --model`` trains: the bundled Transformer, the user's function,
or a Hugging Face model built from its config.

``--model`` takes

* nothing (the default): the bundled byte-level Transformer of ``--layers``, ``--width``,
  ``--hidden``, ``--heads`` (:func:`conveyor.train.models.transformer_lm`);
* ``package.module:function``, as ``conveyor plan`` does: a function of no arguments
  returning the model (or ``(model, sample)``), which maps token ids (batch, length) to
  logits (batch, length, vocabulary), a ``ModelOutput`` or tuple holding them;
* a Hugging Face model directory or its ``config.json``: the causal language model of
  that config, built on the meta device and given the directory's weights where it has
  them (sharded safetensors and their index, or ``pytorch_model.bin``: read by the
  pipeline's ``weights=``, each rank its own stages' tensors), else initialised from
  ``--seed``; its tokenizer, where the directory has one, tokenizes ``--data``. Nothing
  is downloaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConfigError
from conveyor.graph.modeldir import STORED
from conveyor.train.user.code import load_model
from conveyor.train.models import transformer_lm
from conveyor.train.options import TrainConfig

__all__: list[str] = []

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                    "tokenizer.model")


@dataclass
class BuiltModel:
    """The model a run trains, and what comes with it.

    Attributes:
        model: the whole plain model (on the meta device when ``weights`` fill it).
        name: what it is, for the line a run starts with.
        identity: what a checkpoint records of it beyond the options ("" for the bundled
            model, whose options say it all).
        weights: a model directory the pipeline reads the weights from, or None.
        tokenizer: the directory's tokenizer, or None (UTF-8 bytes).
        config: a Hugging Face model's config, written beside an export.
        vocab: how many ids the model predicts, where it says (None: unknown).
        positions: the longest sequence it takes, where it says.
    """

    model: nn.Module
    name: str
    identity: str = ""
    weights: Path | None = None
    tokenizer: Any = None
    config: Any = None
    vocab: int | None = None
    positions: int | None = None


def build_model(config: TrainConfig, *, materialize: bool = False) -> BuiltModel:
    """The model ``--model`` names, initialised from ``--seed`` (or read from its
    directory). ``materialize``: weights in memory, never on the meta device (for the
    plain model ``--check`` compares with).

    Raises:
        ConfigError: ``--model`` names nothing that exists, its function fails to load,
            or it needs ``transformers`` and that is not installed.
    """
    torch.manual_seed(config.seed)
    if not config.model:
        model = transformer_lm(config.layers, config.width, config.hidden, config.heads,
                               vocab=256, max_length=config.length, dropout=config.dropout,
                               tie=config.tie)
        return BuiltModel(model, f"T({config.layers}, {config.hidden}, {config.heads}) width "
                                 f"{config.width}", vocab=256, positions=config.length)
    path = Path(config.model)
    if path.exists():
        return _hugging_face(path, materialize=materialize)
    if ":" not in config.model:
        raise ConfigError(f"--model {config.model}: no such folder or file; give a Hugging "
                          "Face model directory (or its config.json), or "
                          "package.module:function")
    model, _ = load_model(config.model)
    hf_config = getattr(model, "config", None)
    return BuiltModel(model, config.model, identity=config.model, config=hf_config,
                      vocab=getattr(hf_config, "vocab_size", None),
                      positions=getattr(hf_config, "max_position_embeddings", None))


def _hugging_face(path: Path, *, materialize: bool) -> BuiltModel:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model {path}: a Hugging Face model needs transformers: pip "
                          "install 'conveyor[transformers]'") from None
    folder = path if path.is_dir() else path.parent
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--model {path}: the folder has no config.json; give a model "
                          "directory as save_pretrained writes it, or package.module:function")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(config_file),
                                                            local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--model {path}: {config_file} is not a config transformers "
                          f"reads: {exc}") from None
    hf_config.use_cache = False  # training: no key-value cache between the stages
    weights = folder if any((folder / name).is_file() for name in STORED) else None
    loader = transformers.AutoModelForCausalLM
    try:
        if weights is not None and materialize:
            model = loader.from_pretrained(str(folder), config=hf_config, local_files_only=True,
                                           dtype=torch.float32)
        elif weights is not None:
            with torch.device("meta"):
                model = loader.from_config(hf_config)
        else:
            model = loader.from_config(hf_config)
    except ValueError as exc:  # a config of no causal language model
        raise ConfigError(f"--model {path}: {exc}") from None
    tokenizer = None
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder),
                                                               local_files_only=True)
    digest = hashlib.sha256(json.dumps(hf_config.to_dict(), sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    how = "its weights" if weights is not None else "initialised"
    return BuiltModel(model, f"{type(model).__name__} from {path} ({how})",
                      identity=f"{hf_config.model_type}, config sha256 {digest}",
                      weights=weights, tokenizer=tokenizer, config=hf_config,
                      vocab=getattr(hf_config, "vocab_size", None),
                      positions=getattr(hf_config, "max_position_embeddings", None))


def check_fits(built: BuiltModel, *, vocab: int, length: int, tokenizer_from: str) -> None:
    """Refuses data the model cannot read: ids beyond its vocabulary, windows beyond its
    positions.

    Raises:
        ConfigError: naming the tokenizer (or bytes) and the model's figure.
    """
    if built.vocab is not None and vocab > built.vocab:
        raise ConfigError(f"{tokenizer_from} has {vocab} ids but the model predicts "
                          f"{built.vocab} (its vocab_size): the tokenizer is not this model's; "
                          "give the model directory its own tokenizer")
    if built.positions is not None and length > built.positions:
        raise ConfigError(f"--length {length} is beyond the model's {built.positions} "
                          "positions (max_position_embeddings); use --length "
                          f"{built.positions} or less")
