"""``conveyor train --data PATH``: the user's text, read from local files and tokenized.

``PATH`` is a file or a folder (read recursively, in sorted order, hidden files left
out) of:

* ``.txt``, ``.md``, ``.text``: each file one document, UTF-8;
* ``.jsonl``: one JSON object per line, the document under ``--text-field`` (``text``);
* ``.parquet``: the ``--text-field`` column, one document per row (``pyarrow``).

Documents are tokenized by the model directory's tokenizer (``tokenizers`` through
``transformers``; each document followed by its end-of-sequence token), or read as
UTF-8 bytes (each followed by a newline), and packed one after another into one stream
(:class:`~conveyor.train.data.TextCorpus` cuts it into windows of ``--length``). A
document goes to the held-out split by a hash of its file's relative path and its place
in the file, the same on every run and machine; a corpus too small for that keeps its
last tenth apart instead. Nothing is downloaded and no code in the data runs.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from conveyor.errors import ConfigError
from conveyor.train.data import TextCorpus, decode_bytes, text_corpus
from conveyor.train.options import TrainConfig
from conveyor.train.user.model import BuiltModel, check_fits

__all__: list[str] = []

TEXT = (".txt", ".md", ".text")
READABLE = (*TEXT, ".jsonl", ".parquet")
HELDOUT_SHARE = 0.1


def read_data(config: TrainConfig, built: BuiltModel, *, show: bool = True) -> TextCorpus:
    """What ``--data`` names (the bundled Python sources without it), tokenized as the
    model reads it: by its directory's tokenizer, else as bytes.

    Raises:
        ConfigError: the data cannot be read (:func:`read_corpus`), or the model cannot
            read it (:func:`~conveyor.train.user.model.check_fits`).
    """
    tokenizer = built.tokenizer
    if config.data:
        corpus = read_corpus(config.data, tokenizer=tokenizer, text_field=config.text_field,
                             length=config.length, show=show)
    else:
        corpus = text_corpus()
        if tokenizer is not None:  # the bundled text, as the model's tokenizer reads it
            train, heldout = (torch.cat(_encoded([decode_bytes(part.numpy().tobytes())],
                                                 tokenizer))
                              for part in (corpus.train, corpus.heldout))
            corpus = TextCorpus(train, heldout, vocab=len(tokenizer), unit="token",
                                decode=_decoder(tokenizer),
                                source=f"{len(train)} tokens of Python")
    source = (f"the tokenizer of {config.model}" if tokenizer is not None
              else "the text, read as bytes,")
    check_fits(built, vocab=corpus.vocab, length=config.length, tokenizer_from=source)
    return corpus


def read_corpus(path: str | Path, *, tokenizer: Any = None, text_field: str = "text",
                length: int, show: bool = True) -> TextCorpus:
    """The documents under ``path`` as a training and a held-out stream of ids.

    Args:
        path: a file or a folder of them.
        tokenizer: a Hugging Face tokenizer, or None for UTF-8 bytes.
        text_field: the key (JSONL) or column (Parquet) that holds each document.
        length: the window length, so that each split is checked to hold one.
        show: print what was read (rank 0).

    Raises:
        ConfigError: no readable file, a file that is not what its name says (named with
            its line), or too little text for one window in each split.
    """
    began = time.monotonic()
    root = Path(path)
    files = _files(root)
    splits: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # train, held out
    documents = 0
    for batch in _batches(_documents(root, files, text_field), 1000):
        documents += len(batch)
        for (key, _), ids in zip(batch, _encoded([text for _, text in batch], tokenizer)):
            share = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32
            splits[share < HELDOUT_SHARE].append(ids)
    if documents == 0:
        raise ConfigError(f"--data {path}: its files hold no document "
                          f"({', '.join(f.name for f in files[:3])}{', ...' * (len(files) > 3)})")
    dtype = torch.uint8 if tokenizer is None else torch.int32
    train, heldout = (torch.cat(part) if part else torch.zeros(0, dtype=dtype)
                      for part in splits)
    if len(heldout) < length + 2 or len(train) < length + 1:  # too few documents to split
        joined = torch.cat([train, heldout])
        cut = len(joined) - max(length + 2, len(joined) // 10)
        train, heldout = joined[:max(cut, 0)], joined[max(cut, 0):]
    unit = "byte" if tokenizer is None else "token"
    if len(train) < length + 1:
        raise ConfigError(f"--data {path} holds {len(train) + len(heldout)} {unit}s, too few "
                          f"for a window of --length {length} to train on and one held out; "
                          "give more text or a shorter --length")
    many = "s" * (documents != 1)
    corpus = TextCorpus(
        train, heldout, vocab=256 if tokenizer is None else len(tokenizer), unit=unit,
        decode=decode_bytes if tokenizer is None else _decoder(tokenizer),
        source=f"{len(train)} {unit}s of {documents} document{many} in {path}")
    if show:
        print(f"read {documents} document{many} from {len(files)} file"
              f"{'s' * (len(files) != 1)} in {path}: {len(train)} {unit}s to train on, "
              f"{len(heldout)} held out ({time.monotonic() - began:.1f} s)", flush=True)
    return corpus


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _files(root: Path) -> list[Path]:
    if root.is_file():
        if root.suffix.lower() not in READABLE:
            raise ConfigError(f"--data {root}: a {root.suffix or 'nameless'} file; give "
                              f"{', '.join(READABLE)} files, or a folder of them")
        return [root]
    if not root.is_dir():
        raise ConfigError(f"--data {root}: no such file or folder")
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and p.suffix.lower() in READABLE
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise ConfigError(f"--data {root}: no readable file in the folder (looked for "
                          f"{', '.join(READABLE)}, recursively)")
    return files


def _documents(root: Path, files: list[Path], field: str) -> Iterator[tuple[str, str]]:
    """(key, text) of every document: the key names its file and place, for the split."""
    base = root if root.is_dir() else root.parent
    for path in files:
        name = path.relative_to(base).as_posix()
        suffix = path.suffix.lower()
        if suffix in TEXT:
            try:
                yield name, path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"--data: {path} is not UTF-8 text (byte {exc.start}); "
                                  "convert it, or leave it out of the folder") from None
        elif suffix == ".jsonl":
            yield from _jsonl(path, name, field)
        else:
            for row, text in enumerate(_parquet(path, field)):
                yield f"{name}#{row}", text


def _jsonl(path: Path, name: str, field: str) -> Iterator[tuple[str, str]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--data: {path} line {number} is not JSON ({exc.msg}); "
                                  "a .jsonl file holds one JSON object per line") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(sorted(record)) if isinstance(record, dict) else "none"
                raise ConfigError(f"--data: {path} line {number} has no text under "
                                  f"{field!r} (its keys: {keys}); name the key with "
                                  "--text-field")
            yield f"{name}#{number}", text


def _parquet(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ConfigError(f"--data: {path} is Parquet, which needs pyarrow: pip install "
                          "'conveyor[data]'") from None
    try:
        columns = parquet.read_schema(path).names
    except Exception as exc:  # pyarrow's errors have no common base
        raise ConfigError(f"--data: {path} cannot be read as Parquet: {exc}") from None
    if field not in columns:
        raise ConfigError(f"--data: {path} has no column {field!r} (its columns: "
                          f"{', '.join(columns)}); name it with --text-field")
    values = parquet.read_table(path, columns=[field]).column(field).to_pylist()
    if any(not isinstance(v, str) for v in values if v is not None):
        raise ConfigError(f"--data: {path}'s column {field!r} does not hold text")
    return [v for v in values if v]


def _batches(documents: Iterator[tuple[str, str]],
             size: int) -> Iterator[list[tuple[str, str]]]:
    batch: list[tuple[str, str]] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _encoded(texts: list[str], tokenizer: Any) -> list[torch.Tensor]:
    """Each text's ids, its end marker after it: UTF-8 bytes and a newline, or the
    tokenizer's ids (a batch at a time: a fast tokenizer runs them in parallel) and its
    end-of-sequence token."""
    if tokenizer is None:
        return [torch.frombuffer(bytearray(text.encode("utf-8") + b"\n"), dtype=torch.uint8)
                for text in texts]
    end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [torch.tensor(ids + end, dtype=torch.int32) for ids in encoded]
