"""Bundled data: the standard library as text, scikit-learn's digits as images."""

from __future__ import annotations

import pytest
import torch

from conveyor.train.data import digits, text_corpus
from tests.support.extras import require


def test_the_text_corpus_is_real_python_split_by_file() -> None:
    corpus = text_corpus()
    assert len(corpus.train) > 1_000_000 and len(corpus.heldout) > 100_000
    assert b"def " in bytes(corpus.train[:100_000].tolist())
    # Whole files go one way or the other: a long window of held-out text is not in train.
    probe = bytes(corpus.heldout[50_000:50_200].tolist())
    assert probe not in bytes(corpus.train.tolist())
    again = text_corpus.__wrapped__()  # read afresh: the split does not depend on the run
    assert torch.equal(again.train, corpus.train) and torch.equal(again.heldout, corpus.heldout)


def test_batches_depend_only_on_seed_and_step() -> None:
    corpus = text_corpus()
    inputs, targets = corpus.batch(7, 5, 32, seed=3)
    assert inputs.shape == targets.shape == (5, 32) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next bytes
    same = corpus.batch(7, 5, 32, seed=3)
    assert torch.equal(same[0], inputs) and torch.equal(same[1], targets)
    assert not torch.equal(corpus.batch(8, 5, 32, seed=3)[0], inputs)
    assert not torch.equal(corpus.batch(7, 5, 32, seed=4)[0], inputs)
    assert not torch.equal(corpus.batch(7, 5, 32, seed=3, heldout=True)[0], inputs)


def test_the_unigram_baseline_is_the_cross_entropy_of_byte_frequencies() -> None:
    corpus = text_corpus()
    counts = torch.bincount(corpus.train.long(), minlength=256).double() + 1
    p = counts / counts.sum()
    heldout = torch.bincount(corpus.heldout.long(), minlength=256).double()
    expected = float(-(heldout * p.log2()).sum() / heldout.sum())
    assert corpus.unigram_bits() == pytest.approx(expected, rel=1e-12)
    assert 4 < expected < 5  # code: far from uniform (8 bits), far from predictable


def test_digits_are_grey_8x8_images_with_a_fixed_split() -> None:
    require("sklearn")
    (train_x, train_y), (test_x, test_y) = digits()
    assert train_x.shape[1:] == test_x.shape[1:] == (1, 8, 8)
    assert len(train_x) + len(test_x) == 1797 and len(test_x) == 360
    assert 0 <= float(train_x.min()) and float(train_x.max()) <= 1
    assert set(train_y.tolist()) == set(range(10))
    (again_x, _), _ = digits()
    assert torch.equal(again_x, train_x)


def test_the_prompt_opens_a_held_out_function() -> None:
    prompt = text_corpus().prompt(30)
    assert prompt.shape == (1, 30) and prompt.dtype == torch.long
    assert bytes(prompt[0].tolist()).startswith(b"def ")
