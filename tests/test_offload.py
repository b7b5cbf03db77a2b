"""``offload="activations"``: what each micro-batch's forward saves for its backward waits
on the host and comes back one action ahead of its backward, with the gradients of the
plain model in float64, under every schedule, recomputation, per stage, compiled and on
a Hugging Face model; the device keeps a fraction of what it would hold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.offload import (
    KEPT_WITHIN,
    Offloader,
    OffloadMeter,
    offload_plan,
)
from conveyor.observe.plan import rank_peaks
from conveyor.schedules import V_SHAPES, build
from conveyor.train.models import feed_forward_stack
from tests.support.any_models import assert_model_grads, loss_of, plain_step, sample_of
from tests.support.any_models import build as build_model
from tests.support.cases import SCHEDULES, case_batch, case_model, lm_loss
from tests.support.extras import require
from tests.support.models import relative_error


def _gradients_match(pipe: nn.Module, reference: nn.Module) -> None:
    plain = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        assert relative_error(p.grad, plain[name].grad) <= 1e-10, name


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize(("schedule", "virtual", "ranks"), SCHEDULES)
def test_offloaded_activations_give_the_plain_model_gradients(
        schedule: str, virtual: int, ranks: int, checkpoint: str) -> None:
    model, _ = case_model("lm")  # tied embedding and head, attention, layer norm
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=ranks, devices=["cpu"] * ranks, chunks=6,
                             schedule=schedule, virtual_stages=virtual, checkpoint=checkpoint,
                             offload="activations", loss_fn=lm_loss)
    x, y = case_batch("lm", batch=12)
    for _ in range(2):  # a second step reuses nothing of the first
        pipe.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        expected = lm_loss(reference(x), y)
        expected.backward()
        assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
        _gradients_match(pipe, reference)
    meters = pipe.runtime.offload_meters
    assert sorted(meters) == list(range(ranks))
    if checkpoint == "never" and schedule != "dualpipe-v":
        assert max(m.host_peak for m in meters.values()) > 0  # it offloaded something
    # Every store left with its graph: nothing is held after the step.
    assert all(m.device == 0 and m.host == 0 for m in meters.values())


def test_offload_keeps_a_fraction_on_the_device() -> None:
    """GPipe with M=8 on one stage: every forward runs before the first backward, so
    without offload the device holds 8 micro-batches' activations; with it, the one
    being saved and the one brought back for the next backward."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                             for _ in range(4)])
    pipe = conveyor.Pipeline(layers, balance=[2, 2], chunks=8, devices=["cpu"] * 2,
                             recompute="never", offload="activations",
                             loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(64, 32), torch.randn(64, 32))
    first = pipe.runtime.offload_meters[0]
    held = first.host_peak + first.device_peak  # offloaded ones come back one at a time
    assert first.device_peak <= held / 3
    # One entry per stage: only the first stage offloads.
    pipe = conveyor.Pipeline(copy.deepcopy(layers), balance=[2, 2], chunks=8,
                             devices=["cpu"] * 2, recompute="never",
                             offload=["activations", None], loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(64, 32), torch.randn(64, 32))
    assert list(pipe.runtime.offload_meters) == [0]
    assert pipe.runtime.stages[1].offloader is None


def test_the_plan_offloads_what_is_not_due_and_reloads_it_one_action_ahead() -> None:
    table = build("1f1b", 2, 4)
    lanes = {rank: [(rank, a) for a in column] for rank, column in enumerate(table.columns)}
    plan = offload_plan(lanes, {0, 1}, lambda stage, m: False)
    for lead, lane in lanes.items():
        position = {(a.kind.value, a.stage, a.microbatch): i for i, (_, a) in enumerate(lane)}
        for (stage, m) in plan.offloaded:
            if stage != lead:
                continue
            forward = position[("F", stage, m)]
            backward = position[("B", stage, m)]
            assert backward - forward > KEPT_WITHIN
            assert plan.reloads[lead][backward - 1] == (stage, m)
    # The last stage's backward follows its forward: it keeps everything.
    assert not any(stage == 1 for stage, _ in plan.offloaded)
    assert offload_plan(lanes, {0, 1}, lambda stage, m: True).offloaded == frozenset()


def test_a_split_backward_parks_what_its_weight_gradient_waits_for() -> None:
    table = build("zero-bubble", 3, 6)
    lanes = {rank: [(rank, a) for a in column] for rank, column in enumerate(table.columns)}
    plan = offload_plan(lanes, {0, 1, 2}, lambda stage, m: False)
    parked = 0
    for lead, lane in lanes.items():
        for at, key in plan.parks.get(lead, {}).items():
            action = lane[at][1]
            assert (action.kind.value, action.stage, action.microbatch) == ("I", *key)
            weight = next(i for i, (_, a) in enumerate(lane)
                          if a.kind.value == "W" and (a.stage, a.microbatch) == key)
            assert weight - at > KEPT_WITHIN and plan.reloads[lead][weight - 1] == key
            parked += 1
    assert parked > 0


def test_offload_on_a_traced_hugging_face_gpt2() -> None:
    require("transformers")
    model, reference, split_at, inputs, targets = build_model("gpt2")
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=sample_of(inputs),
                             devices=["cpu"] * 2, chunks=4, schedule="zero-bubble",
                             recompute="never", offload="activations", loss_fn=loss_of("gpt2"))
    loss = pipe.step(inputs, targets)
    expected = plain_step("gpt2", reference, inputs, targets)
    assert relative_error(loss.detach(), expected) <= 1e-10
    assert_model_grads(pipe, reference)
    assert pipe.runtime.offload_meters[0].host_peak > 0


def test_offload_with_compiled_stages() -> None:
    model, _ = case_model("mlp")
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, balance=[6, 6], devices=["cpu"] * 2, chunks=4,
                             schedule="zero-bubble", recompute="never", compile=True,
                             offload="activations", loss_fn=nn.functional.mse_loss)
    x, y = case_batch("mlp", batch=8)
    pipe.step(x, y)
    nn.functional.mse_loss(reference(x), y).backward()
    _gradients_match(pipe, reference)
    assert pipe.runtime.offload_meters[0].host_peak > 0


def test_offload_says_what_it_takes() -> None:
    model, _ = case_model("mlp")
    with pytest.raises(ValueError, match='"activations"'):
        conveyor.Pipeline(model, balance=[6, 6], devices=["cpu"] * 2, chunks=2,
                          offload="yes", loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match="3 entries for 2 stages"):
        conveyor.Pipeline(model, balance=[6, 6], devices=["cpu"] * 2, chunks=2,
                          offload=["activations", None, None], loss_fn=nn.functional.mse_loss)


def test_what_stays_in_memory_anyway_is_not_copied() -> None:
    """A stage's output saved by its last layer (tanh saves its result) is kept for the
    backward anyway: offload leaves it, also when it was saved before it was known to
    be the output; what only the graph holds goes to the host."""
    meter = OffloadMeter()
    offloader = Offloader(torch.device("cpu"), meter)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    store = offloader.activations(nn.Identity(), x, offload=True)
    with store.saving():
        hidden = torch.sigmoid(x * 2)  # saved (its result): only the graph holds it
        y = torch.tanh(hidden * 3)  # saved (its result): the output
        store.keep(y)
    assert meter.device == 0 and meter.host == hidden.numel() * 8
    y.sum().backward()
    expected = (1 - y.detach() ** 2) * 3 * hidden.detach() * (1 - hidden.detach()) * 2
    assert torch.equal(x.grad, expected) or relative_error(x.grad, expected) <= 1e-15


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "zb-v", "v-half",
                                      "v-min", "interleaved-1f1b"])
def test_the_planner_predicts_what_offload_keeps_on_the_device(schedule: str) -> None:
    """``rank_peaks`` (what the planner reckons with) against the meter: blocks of
    Linear-GELU-Linear, whose saved bytes per sample are known (the block's input, the
    hidden layer before and after GELU; the stage's input stays where it is)."""
    width, ranks, chunks, batch = 8, 4, 8, 32
    virtual = 2 if schedule in V_SHAPES or schedule == "interleaved-1f1b" else 1
    stages = ranks * virtual
    torch.manual_seed(0)
    pipe = conveyor.Pipeline(feed_forward_stack(stages, width, 4 * width), balance=[1] * stages,
                             chunks=chunks, schedule=schedule, devices=["cpu"] * ranks,
                             virtual_stages=virtual if schedule == "interleaved-1f1b" else 1,
                             recompute="never", offload="activations",
                             loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(batch, width), torch.randn(batch, width))
    micro = batch // chunks
    moves = [micro * (4 * width + 4 * width) * 4.0] * stages  # the stage input stays
    none = [0.0] * stages  # the meter counts what moves, nothing else
    predicted = rank_peaks(pipe.schedule, moves, none, none, moves)
    measured = [pipe.runtime.offload_meters[r].device_peak for r in range(ranks)]
    assert measured == predicted
