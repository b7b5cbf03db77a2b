"""A user's model directory and corpus, made here (nothing downloaded): a small Llama
saved by ``save_pretrained`` in shards with a tokenizer trained on the corpus, and a
folder of ``.txt`` and ``.jsonl`` files."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def documents(count: int = 40) -> list[str]:
    """Texts with a pattern a model can learn in a few steps."""
    return [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(60))
            for i in range(count)]


def corpus_folder(folder: Path) -> Path:
    """Half the documents as ``.txt`` files (five to a file), half as ``.jsonl`` lines
    beside an unused key; a hidden file and a ``.csv`` that are not read."""
    texts = documents()
    (folder / "text").mkdir(parents=True, exist_ok=True)
    for part in range(4):
        (folder / "text" / f"part{part}.txt").write_text("\n".join(texts[5 * part:5 * part + 5]))
    with open(folder / "lines.jsonl", "w") as lines:
        for text in texts[20:]:
            lines.write(json.dumps({"text": text, "source": "test"}) + "\n")
    (folder / ".hidden.txt").write_text("never read")
    (folder / "notes.csv").write_text("not,read\n")
    return folder


def parquet_file(path: Path, column: str = "body") -> Path:
    """The documents as one Parquet column."""
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({column: documents()}), path)
    return path


def tokenizer(extra: int = 0) -> object:
    """A byte-level BPE tokenizer trained on :func:`documents` (300 ids, ``extra`` more)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(documents(), trainers.BpeTrainer(
        vocab_size=300 + extra, special_tokens=["<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>",
                                                unk_token="<unk>")


def llama_folder(folder: Path, *, vocab: int = 300, positions: int = 64,
                 weights: bool = True, tokenizer_extra: int = 0) -> Path:
    """A Llama of 4 blocks and tied embeddings saved in 4 KB shards (with their index),
    its config and a tokenizer (of ``tokenizer_extra`` ids more than 300); without
    ``weights`` the config and tokenizer alone."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if weights:
        model.save_pretrained(folder, max_shard_size="40KB")
    else:
        config.save_pretrained(folder)
    tokenizer(tokenizer_extra).save_pretrained(folder)  # type: ignore[attr-defined]
    return folder
