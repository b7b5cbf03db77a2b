"""Values that skip stages go from the stage that makes them straight to each stage that
uses them, once per micro-batch (an edge of the schedule), in threads and in processes:
the stages between never see them, values without gradients get no gradient message,
and every schedule and checkpoint mode keeps the plain model's gradients (float64)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.engine.microbatch import split
from conveyor.engine.backward.routing import check_no_gradient
from conveyor.errors import ConveyorError, ScheduleError
from conveyor.schedules import Edge, parse
from tests.support.crossing_models import Crossing, UNet, crossing, token_batch, token_loss
from tests.support.launch import launch
from tests.support.models import relative_error

CHUNKS = 4
FLOAT64 = 8
# tests.support.crossing_models' token batch: 10 sequences of 5 tokens; the width is 8.
SAMPLES, LENGTH, WIDTH = 10, 5, 8
HIDDEN = SAMPLES * LENGTH * WIDTH * FLOAT64  # a (10, 5, 8) float64 tensor, all micro-batches
MASK = SAMPLES * LENGTH  # the bool padding mask, (10, 5, 1)


def flows(pipe: Any) -> dict[tuple[str, int, int], tuple[int, int]]:
    """What the pipeline's transport sent, as (messages, bytes) per (kind, source, destination)."""
    return {key: (flow.messages, flow.bytes)
            for key, flow in pipe.runtime.transport.traffic.flows.items()}


def traced(model: Crossing, schedule: str = "1f1b", *, virtual: int = 1,
           checkpoint: str = "except_last") -> conveyor.Pipeline:
    ids, _ = token_batch()
    ranks = (len(model.split_at()) + 1) // virtual
    return conveyor.Pipeline(model, split_at=model.split_at(), sample=split(ids, CHUNKS)[0],
                             stages=ranks, devices=["cpu"] * ranks, chunks=CHUNKS,
                             schedule=schedule, virtual_stages=virtual,
                             checkpoint=checkpoint, loss_fn=token_loss)


def plain_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    ids, targets = token_batch()
    token_loss(model(ids), targets).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_gradients(model: nn.Module, expected: dict[str, torch.Tensor], label: str) -> None:
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(expected), label
    for name, grad in got.items():
        assert relative_error(grad, expected[name]) <= 1e-10, f"{label}: {name}"


def test_a_skip_goes_straight_to_the_stage_that_uses_it_and_its_gradient_comes_back() -> None:
    torch.manual_seed(0)
    model = UNet().double()
    x, y = torch.randn(10, 2, 8, 8, dtype=torch.float64), torch.randn(10, 2, 8, 8).double()
    pipe = conveyor.Pipeline(model, split_at=["up2", "up1"], sample=split(x, CHUNKS)[0],
                             stages=3, devices=["cpu"] * 3, chunks=CHUNKS, schedule="1f1b",
                             loss_fn=F.mse_loss)
    assert pipe.schedule.edges == (Edge(0, 2),)
    assert pipe.schedule.to_text().endswith("\nedges: 0->2")
    pipe.step(x, y)
    # Each a float64 tensor of all 10 samples: stage 0's output cat(middle(second),
    # second) at 16 x 4 x 4, up2's output upsampled at 4 x 8 x 8, and the skip `first`
    # at 4 x 8 x 8. Stage 1 receives and sends its own values alone: relayed, the skip
    # would double both of its messages.
    middle, up, skip = (10 * 16 * 4 * 4 * FLOAT64, 10 * 4 * 8 * 8 * FLOAT64,
                        10 * 4 * 8 * 8 * FLOAT64)
    assert flows(pipe) == {
        ("activation", 0, 1): (CHUNKS, middle), ("gradient", 1, 0): (CHUNKS, middle),
        ("activation", 1, 2): (CHUNKS, up), ("gradient", 2, 1): (CHUNKS, up),
        ("activation", 0, 2): (CHUNKS, skip), ("gradient", 2, 0): (CHUNKS, skip)}


def test_a_value_reaches_every_stage_that_uses_it_and_a_mask_gets_no_gradient() -> None:
    model = crossing(4, context_at=(1, 2), mask_at=(2, 3))
    expected = plain_gradients(crossing(4, context_at=(1, 2), mask_at=(2, 3)))
    pipe = traced(model)
    assert pipe.schedule.edges == (Edge(0, 2, gradient=True), Edge(0, 3, gradient=False))
    pipe.step(*token_batch())
    # The context goes to stages 1 and 2, the mask to stages 2 and 3, each once per
    # micro-batch; gradients come back for the context alone (from stage 2 straight
    # to stage 0: none from stage 3, whose edge carries the mask alone).
    assert flows(pipe) == {
        ("activation", 0, 1): (CHUNKS, 2 * HIDDEN), ("gradient", 1, 0): (CHUNKS, 2 * HIDDEN),
        ("activation", 0, 2): (CHUNKS, HIDDEN + MASK), ("gradient", 2, 0): (CHUNKS, HIDDEN),
        ("activation", 0, 3): (CHUNKS, MASK),
        ("activation", 1, 2): (CHUNKS, HIDDEN), ("gradient", 2, 1): (CHUNKS, HIDDEN),
        ("activation", 2, 3): (CHUNKS, HIDDEN), ("gradient", 3, 2): (CHUNKS, HIDDEN)}
    assert_gradients(model, expected, "1f1b")  # the context's two gradients, summed
    ids, _ = token_batch()
    with torch.no_grad():
        assert relative_error(pipe.eval_step(ids), crossing()(ids)) <= 1e-12


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1),
                                                   ("zero-bubble", 1), ("interleaved-1f1b", 2)])
def test_every_schedule_and_checkpoint_mode_keeps_the_plain_gradients(schedule: str,
                                                                     virtual: int) -> None:
    expected = plain_gradients(crossing())
    model = crossing()
    pipe = traced(model, schedule, virtual=virtual)
    if virtual == 2:  # stages 0 and 2 on rank 0: edge 0->2 stays on the rank
        assert pipe.schedule.stage_ranks == (0, 1, 0, 1)
    for checkpoint in ("always", "except_last", "never"):
        pipe.recompute = checkpoint
        model.zero_grad(set_to_none=True)
        loss = pipe.step(*token_batch())
        ids, targets = token_batch()
        assert abs(loss.item() - token_loss(crossing()(ids), targets).item()) <= 1e-12
        assert_gradients(model, expected, f"{schedule} {checkpoint}")


def test_gpipe_sends_values_past_the_next_stage_too() -> None:
    model = crossing()
    ids, targets = token_batch()
    pipe = conveyor.GPipe(model, split_at=model.split_at(), sample=split(ids, CHUNKS)[0],
                          devices=["cpu"] * 4, chunks=CHUNKS)
    assert pipe.runtime.schedule.edges == (Edge(0, 2), Edge(0, 3, gradient=False))
    token_loss(pipe(ids), targets).backward()
    assert_gradients(model, plain_gradients(crossing()), "GPipe")
    assert pipe.runtime.executor.transport.traffic.between(0, 3).bytes == MASK
    with torch.no_grad():
        assert relative_error(pipe(ids), crossing()(ids)) <= 1e-12


def test_the_timeline_of_a_step_shows_the_edges_messages() -> None:
    pipe = traced(crossing())
    with conveyor.record(pipe) as timeline:
        pipe.step(*token_batch())
    assert timeline.edges == [(0, 2, True), (0, 3, False)]
    messages = [(sent.label, received.label, kind)
                for sent, received, kind in timeline.edge_messages()]
    assert len(messages) == 3 * CHUNKS  # 0->2 and back, 0~>3 one way
    assert ("0F1", "2F1", "activation") in messages
    assert ("2B1", "0B1", "gradient") in messages
    assert ("0F1", "3F1", "activation") in messages
    assert ("3B1", "0B1", "gradient") not in messages


def test_a_table_must_carry_the_models_edges() -> None:
    model = crossing()
    ids, _ = token_batch()
    other = parse("0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0\n1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0\n"
                  "2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0\n3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0\n"
                  "edges: 0->2")
    with pytest.raises(ScheduleError, match=r"lists edges 0->2, but the model cut at "
                                            r"split_at has 0->2 0~>3; give the table without"):
        conveyor.Pipeline(model, split_at=model.split_at(), sample=split(ids, CHUNKS)[0],
                          stages=4, devices=["cpu"] * 4, chunks=CHUNKS, schedule=other,
                          loss_fn=token_loss)
    bare = parse(other.to_text().rsplit("\n", 1)[0])  # the model's edges are added
    pipe = conveyor.Pipeline(model, split_at=model.split_at(), sample=split(ids, CHUNKS)[0],
                             stages=4, devices=["cpu"] * 4, chunks=CHUNKS, schedule=bare,
                             loss_fn=token_loss)
    assert pipe.schedule.edges == (Edge(0, 2), Edge(0, 3, gradient=False))
    with pytest.raises(ScheduleError, match=r"has edges \(0->2\), but a sequence of layers "
                                            r"sends each stage's output to the next stage"):
        conveyor.Pipeline(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]),
                          stages=4, devices=["cpu"] * 4, chunks=CHUNKS, schedule=other,
                          loss_fn=F.mse_loss)


def test_a_value_requiring_grad_over_an_edge_without_gradients_is_an_error() -> None:
    check_no_gradient({"mask": torch.ones(2, dtype=torch.bool)}, 0, 3)
    with pytest.raises(ConveyorError, match=r"stage 0 sends stage 3 a value that requires "
                                            r"grad \(at\['context'\]\) over edge 0~>3"):
        check_no_gradient({"context": torch.ones(2, requires_grad=True)}, 0, 3)


def test_processes_send_values_straight_to_the_ranks_that_use_them(tmp_path: Path) -> None:
    """Three processes, each with its stage of a traced model (split_at under torchrun):
    the plain model's gradients, and rank 1 never carries stage 0's values to stage 2."""
    outcome = launch("direct_edges", 3, tmp_path, timeout=240)
    assert outcome.returncodes == [0, 0, 0], "\n".join(outcome.outputs)
    for case, context_at, mask_at, schedule in [("context", (1, 2), (), "1f1b"),
                                                ("context", (1, 2), (), "zero-bubble"),
                                                ("mask", (), (2,), "gpipe")]:
        results = [torch.load(tmp_path / f"{case}-{schedule}-rank{r}.pt") for r in range(3)]
        grads: dict[str, torch.Tensor] = {}
        for result in results:
            grads.update(result["grads"])
        plain = crossing(3, context_at=context_at, mask_at=mask_at)
        expected = plain_gradients(plain)
        assert sorted(grads) == sorted(expected), (case, schedule)
        for name, grad in grads.items():
            assert relative_error(grad, expected[name]) <= 1e-10, (case, schedule, name)
        # Per rank, (messages, tensor bytes) by (kind, source, destination).
        sent = [{key: flow[:2] for key, flow in result["traffic"].items()}
                for result in results]
        assert sent[1] == {("activation", 1, 2): (CHUNKS, HIDDEN),  # h alone
                           ("gradient", 1, 0): (CHUNKS, sent[0][("activation", 0, 1)][1])}
        edge, back = sent[0][("activation", 0, 2)], sent[2].get(("gradient", 2, 0))
        if case == "context":  # used by stages 1 and 2: to each, and gradients from each
            assert results[0]["edges"] == ["0->2"]
            assert edge == back == (CHUNKS, HIDDEN)
            assert sent[0][("activation", 0, 1)] == (CHUNKS, 2 * HIDDEN)
        else:  # the mask: no gradient message at all
            assert results[0]["edges"] == ["0~>2"]
            assert edge == (CHUNKS, MASK) and back is None
        wire = results[0]["traffic"][("activation", 0, 2)][2]
        assert wire > edge[1]  # the headers too left the process
