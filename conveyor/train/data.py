"""Bundled data: nothing is downloaded at run time.

* Text: the standard library's own Python sources, read as bytes (the most common
  bytes of code; every Python has them). Files go to the held-out split by a hash of
  their name, so the split is the same on every run and machine with that Python.
* Images: scikit-learn's 8x8 digits, when scikit-learn is installed (optional).

Batches are random windows, drawn from a generator seeded by (seed, step), so batch s
is the same whether a run got there in one go or resumed from a checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TextCorpus", "digits", "text_corpus"]

_SKIP = ("site-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "__pycache__")


@dataclass(frozen=True)
class TextCorpus:
    """Bytes for training and held-out evaluation.

    Attributes:
        train: the training bytes (uint8).
        heldout: the held-out bytes (uint8).
    """

    train: torch.Tensor
    heldout: torch.Tensor

    def batch(self, step: int, size: int, length: int, *, seed: int = 0,
              heldout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows of ``length`` bytes and the next byte at each position.

        Returns:
            (inputs, targets), both (size, length) int64.
        """
        data = self.heldout if heldout else self.train
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + int(heldout))
        starts = torch.randint(0, len(data) - length - 1, (size,), generator=generator)
        windows = torch.stack([data[s:s + length + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def prompt(self, length: int) -> torch.Tensor:
        """The first ``length`` bytes of the held-out text's first function definition
        (of its start, if it has none): a prompt to sample from. Shape (1, length), int64."""
        marker = torch.tensor(list(b"\ndef "), dtype=torch.uint8)
        found = (self.heldout.unfold(0, len(marker), 1) == marker).all(dim=1).nonzero()
        start = int(found[0]) + 1 if len(found) else 0
        return self.heldout[start:start + length].long().unsqueeze(0)

    def unigram_bits_per_byte(self) -> float:
        """The held-out cross-entropy of byte frequencies counted on the training bytes
        (add-one smoothed): the baseline a language model must beat."""
        counts = torch.bincount(self.train.long(), minlength=256).double() + 1
        log_p = (counts / counts.sum()).log2()
        return float(-log_p[self.heldout.long()].mean())


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
                      torch.frombuffer(heldout, dtype=torch.uint8).clone())


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
