"""The data ``conveyor train`` reads: token streams, their batches, and the bundled data.

* Text: a stream of token ids for training and one held out. The bundled one is the
  standard library's Python sources read as bytes (the most common bytes of code; every
  Python has them); files go to the held-out split by a hash of their name, so the split
  is the same on every run and machine with that Python. ``--data`` reads the user's
  (:mod:`conveyor.train.user.corpus`).
* Images: scikit-learn's 8x8 digits, when scikit-learn is installed (optional).

Training batches are windows of the stream in epoch order: the stream is cut into
windows of ``length + 1`` tokens (documents packed one after another), each epoch takes
them all in an order drawn from (seed, epoch), and a batch is the next ``size`` windows
from a *position* (windows read so far). A checkpoint records the position, so a resume
reads on from the same window mid-epoch, whatever the batch size. Held-out batches are
random windows drawn from (seed, index): the same at every evaluation.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["TextCorpus", "digits", "text_corpus"]

_SKIP = ("site-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "__pycache__")


def decode_bytes(ids: list[int] | bytes) -> str:
    """Byte ids as text (a broken UTF-8 sequence as the replacement character)."""
    return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TextCorpus:
    """Token ids for training and held-out evaluation.

    Attributes:
        train: the training tokens (bytes: uint8).
        heldout: the held-out tokens.
        vocab: the number of distinct ids a model must predict (256 for bytes).
        unit: what one id is, as the figures say it ("byte" or "token").
        decode: ids to text.
        source: what the text is, for the line a run starts with.
    """

    train: torch.Tensor
    heldout: torch.Tensor
    vocab: int = 256
    unit: str = "byte"
    decode: Callable[[list[int]], str] = field(default=decode_bytes, compare=False)
    source: str = "Python"

    @property
    def metric(self) -> str:
        """The short name of bits per unit: ``bpb`` (byte) or ``bpt`` (token)."""
        return f"bp{self.unit[0]}"

    def windows_per_epoch(self, length: int) -> int:
        """How many training windows of ``length`` (+1 for the targets) one epoch has."""
        return max(0, (len(self.train) - 1) // length)

    def windows(self, position: int, size: int, length: int, *,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``size`` training windows from ``position`` (windows read before), in
        epoch order, and the next token at each place.

        Returns:
            (inputs, targets), both (size, length) int64.

        Raises:
            ValueError: the training text is shorter than one window.
        """
        count = self.windows_per_epoch(length)
        if count < 1:
            raise ValueError(f"the training text holds {len(self.train)} {self.unit}s, fewer "
                             f"than one window of {length} + 1")
        starts = [int(_epoch_order(count, seed, p // count)[p % count]) * length
                  for p in range(position, position + size)]
        return _inputs_and_targets(self.train, starts, length)

    def batch(self, step: int, size: int, length: int, *, seed: int = 0,
              heldout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of ``size`` windows: training windows from position
        ``step * size``, or (``heldout``) random held-out windows drawn from (seed, step).

        Returns:
            (inputs, targets), both (size, length) int64.
        """
        if not heldout:
            return self.windows(step * size, size, length, seed=seed)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + 1)
        starts = torch.randint(0, len(self.heldout) - length - 1, (size,), generator=generator)
        return _inputs_and_targets(self.heldout, starts.tolist(), length)

    def prompt(self, length: int) -> torch.Tensor:
        """A prompt to sample from: the first ``length`` ids of the held-out text (of
        bytes: from its first function definition, where it has one). Shape (1, length),
        int64."""
        start = 0
        if self.unit == "byte":
            marker = torch.tensor(list(b"\ndef "), dtype=self.heldout.dtype)
            found = (self.heldout.unfold(0, len(marker), 1) == marker).all(dim=1).nonzero()
            start = int(found[0]) + 1 if len(found) else 0
        return self.heldout[start:start + length].long().unsqueeze(0)

    def unigram_bits(self) -> float:
        """The held-out cross-entropy, in bits per unit, of the ids' frequencies counted
        on the training text (add-one smoothed): the baseline a language model must beat."""
        counts = torch.bincount(self.train.long(), minlength=self.vocab).double() + 1
        log_p = (counts / counts.sum()).log2()
        return float(-log_p[self.heldout.long()].mean())

    def identity(self) -> str:
        """A short checksum of the training ids: what a checkpoint records of its data."""
        data = self.train.detach().cpu().contiguous().numpy().tobytes()
        return (f"{len(self.train)} {self.unit}s, sha256 "
                f"{hashlib.sha256(data).hexdigest()[:16]}")


def _inputs_and_targets(data: torch.Tensor, starts: list[int],
                        length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of ``length`` + 1 ids at ``starts``: inputs, and targets one ahead."""
    rows = torch.stack([data[s:s + length + 1] for s in starts]).long()
    return rows[:, :-1], rows[:, 1:]


@functools.lru_cache(maxsize=4)  # one epoch's order at a time, and the next
def _epoch_order(count: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 2)
    return torch.randperm(count, generator=generator)


@functools.lru_cache(maxsize=2)  # read once per process
def text_corpus(*, limit: int = 8 << 20, heldout_share: float = 0.1) -> TextCorpus:
    """The standard library's Python sources, up to ``limit`` bytes, split by file.

    Raises:
        FileNotFoundError: the standard library's sources are not on this machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not any(part in _SKIP for part in p.relative_to(root).parts))
    if not files:
        raise FileNotFoundError(f"no Python sources under {root} to build the text corpus")
    train, heldout = bytearray(), bytearray()
    for path in files:
        if len(train) + len(heldout) >= limit:
            break
        name = str(path.relative_to(root)).encode()
        share = int.from_bytes(hashlib.sha256(name).digest()[:4], "big") / 2**32
        (heldout if share < heldout_share else train).extend(path.read_bytes())
    return TextCorpus(torch.frombuffer(train, dtype=torch.uint8).clone(),
                      torch.frombuffer(heldout, dtype=torch.uint8).clone(),
                      source=f"{len(train)} bytes of Python")


def digits(*, heldout_share: float = 0.2) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                   tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's 8x8 digits as (1, 8, 8) images in [0, 1]: (train, held-out) pairs.

    Raises:
        ImportError: scikit-learn is not installed (``pip install 'conveyor[images]'``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the digits need scikit-learn: pip install 'conveyor[images]'") from exc
    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    cut = math.floor(len(images) * (1 - heldout_share))
    return (images[:cut], labels[:cut]), (images[cut:], labels[cut:])
