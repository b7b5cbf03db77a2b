"""Splitting batches into micro-batches and gathering outputs back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import conveyor
from conveyor.engine.microbatch import gather, microbatch_count, microbatch_sizes, split
from conveyor.errors import ConveyorError, MicroBatchError
from conveyor.schedules.builders import SCHEDULES, V_SHAPES
from tests.support.models import assert_same_grads, build, relative_error, sample


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


def test_a_forward_only_call_counts_one_micro_batch_per_sample_at_most() -> None:
    assert [microbatch_count(torch.zeros(n, 2), 4) for n in (1, 3, 4, 9)] == [1, 3, 4, 4]
    with pytest.raises(MicroBatchError, match=r"chunks must be a positive integer, got 0"):
        microbatch_count(torch.zeros(3, 2), 0)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_eval_step_runs_a_batch_smaller_than_chunks_by_every_schedule(schedule: str) -> None:
    model, reference = build("mlp")
    two_per_rank = schedule in V_SHAPES or schedule == "interleaved-1f1b"
    ranks = 3 if schedule == "v-min" else 2  # v-min holds its share from 3 ranks on
    balance = ([2, 1, 1, 1, 1, 1] if ranks == 3 else [2, 2, 2, 1]) if two_per_rank else [3, 4]
    pipe = conveyor.Pipeline(model, stages=ranks, balance=balance,
                             chunks=4, schedule=schedule, devices=["cpu"] * ranks,
                             virtual_stages=2 if two_per_rank else 1, loss_fn=F.mse_loss)
    x = sample("mlp", batch=3)
    with torch.no_grad():
        for n in (1, 2, 3):
            assert relative_error(pipe.eval_step(x[:n]), reference(x[:n])) <= 1e-12, n
    pipe.eval()
    assert relative_error(pipe(x[:1]), reference(x[:1])) <= 1e-12


def test_pipeline_call_is_inference_and_says_how_to_train() -> None:
    model, reference = build("mlp")
    pipe = conveyor.Pipeline(model, stages=2, balance=[3, 4], chunks=4, devices=["cpu"] * 2,
                             loss_fn=F.mse_loss)
    x = sample("mlp", batch=6)
    with pytest.raises(ConveyorError, match=r"Pipeline\(inputs\) runs inference, the same as "
                                            r"pipe.eval_step\(inputs\): call pipe.eval\(\) "
                                            r"first or run it under torch.no_grad\(\); to "
                                            r"train, call pipe.step\(inputs, targets\)"):
        pipe(x)
    with torch.no_grad():
        assert relative_error(pipe(x), reference(x)) <= 1e-12
    pipe.eval()
    out = pipe(x)
    assert relative_error(out, reference(x)) <= 1e-12 and not out.requires_grad


def test_gpipe_trains_on_a_batch_smaller_than_chunks() -> None:
    model, reference = build("mlp")
    pipe = conveyor.GPipe(model, balance=[3, 4], devices=["cpu"] * 2, chunks=4)
    x, y = sample("mlp", batch=2), sample("mlp", batch=2, seed=2)[:, :3]
    F.mse_loss(pipe(x), y).backward()
    F.mse_loss(reference(x), y).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


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


def test_a_python_list_as_a_batch_is_named_by_its_type_not_its_numbers() -> None:
    numbers = [[0.123456 * i, 7.654321] for i in range(1000)]
    with pytest.raises(MicroBatchError) as raised:
        split(numbers, 2)
    message = str(raised.value)
    assert "got list[1000] of list[2] of float: pass a tensor" in message
    assert "0.123456" not in message and "7.654321" not in message and len(message) < 250
