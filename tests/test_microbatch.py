"""Splitting batches into micro-batches and gathering outputs back."""

from __future__ import annotations

import pytest
import torch

from conveyor.errors import MicroBatchError
from conveyor.engine.microbatch import gather, microbatch_sizes, split


def test_uneven_sizes_follow_tensor_split() -> None:
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    parts = split(torch.arange(10), 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [len(p) for p in torch.arange(10).tensor_split(4)] == microbatch_sizes(10, 4)


def test_micro_batches_are_views_not_copies() -> None:
    x = torch.randn(6, 2)
    assert split(x, 3)[1].data_ptr() == x[2].data_ptr()


def test_nested_batches_keep_their_structure_and_broadcast_non_tensors() -> None:
    x, mask = torch.randn(5, 3), torch.ones(5, 2, dtype=torch.bool)
    scale = torch.tensor(2.0)
    batch = {"x": x, "extra": (mask, "causal", 7, None, scale)}
    parts = split(batch, 2)
    assert len(parts) == 2
    assert parts[0]["x"].shape == (3, 3) and parts[1]["extra"][0].shape == (2, 2)
    assert parts[1]["extra"][1:4] == ("causal", 7, None)
    assert parts[0]["extra"][4] is scale  # 0-dim tensors go to every micro-batch
    gathered = gather([{"x": p["x"], "extra": p["extra"][:4]} for p in parts])
    assert torch.equal(gathered["x"], x) and torch.equal(gathered["extra"][0], mask)
    assert gathered["extra"][1:4] == ("causal", 7, None)


def test_fewer_samples_than_chunks() -> None:
    with pytest.raises(MicroBatchError, match=r"a batch of 3 samples cannot be split into 4 "
                                              r"micro-batches; use chunks <= 3 or a batch of "
                                              r"at least 4 samples"):
        split(torch.zeros(3, 2), 4)


def test_batch_sizes_must_agree() -> None:
    with pytest.raises(MicroBatchError, match=r"input\[0\] has 4 samples but "
                                              r"input\[1\]\['mask'\] has 3"):
        split((torch.zeros(4, 2), {"mask": torch.zeros(3)}), 2)


def test_empty_batch() -> None:
    with pytest.raises(MicroBatchError, match=r"the batch is empty: input has 0 samples"):
        split(torch.zeros(0, 3), 2)


def test_batch_without_a_batched_tensor() -> None:
    with pytest.raises(MicroBatchError, match=r"holds no tensor with a batch dimension"):
        split({"a": 1, "b": torch.tensor(3.0)}, 2)


def test_gather_rejects_scalars_and_disagreeing_constants() -> None:
    with pytest.raises(MicroBatchError, match=r"output\[1\] is a 0-dim tensor"):
        gather([(torch.ones(2), torch.tensor(1.0)), (torch.ones(2), torch.tensor(2.0))])
    with pytest.raises(MicroBatchError, match=r"output\['k'\] is not a tensor and differs "
                                              r"between micro-batches \('a' in micro-batch 0, "
                                              r"'b' in micro-batch 1\)"):
        gather([{"t": torch.ones(1), "k": "a"}, {"t": torch.ones(1), "k": "b"}])
    with pytest.raises(MicroBatchError, match=r"micro-batch 1 returned a different structure"):
        gather([(torch.ones(1),), [torch.ones(1)]])
