"""Pipeline.step in one process: every schedule equals the plain model."""

from __future__ import annotations

import copy
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import BalanceError, ConveyorError, ScheduleError
from conveyor.graph.source import sequential
from conveyor.errors import NonFiniteLossError
from tests.support.cases import MIXED, case_batch, case_model, deep_mlp, lm_loss, tied_lm
from tests.support.models import one_costly_layer, one_cpu_thread, paired, relative_error

SCHEDULES = [("gpipe", 1, 3), ("1f1b", 1, 3), ("zero-bubble", 1, 3),
             ("interleaved-1f1b", 2, 2), ("zb-v", 1, 2), ("dualpipe-v", 1, 2), ("v-half", 1, 2),
             ("v-min", 1, 3)]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize(("schedule", "virtual", "stages"), SCHEDULES)
@pytest.mark.parametrize("model_name", ["mlp", "lm"])
def test_every_schedule_equals_the_plain_model(model_name: str, schedule: str, virtual: int,
                                               stages: int, checkpoint: str) -> None:
    model, loss_fn = case_model(model_name)
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=stages, devices=["cpu"] * stages, chunks=4,
                             schedule=schedule, virtual_stages=virtual, loss_fn=loss_fn,
                             checkpoint=checkpoint)
    x, y = case_batch(model_name)  # 10 samples: uneven micro-batches
    step_equals_the_plain_model(pipe, reference, loss_fn, x, y)


def step_equals_the_plain_model(pipe: conveyor.Pipeline, reference: nn.Module, loss_fn: Any,
                                x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of ``pipe``: the plain model's loss and gradients, in float64."""
    loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    same_grads_as(pipe, reference)


def same_grads_as(pipe: conveyor.Pipeline, reference: nn.Module) -> None:
    plain = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        assert relative_error(p.grad, plain[name].grad) <= 1e-10, name


def test_tied_copies_stay_equal_through_training() -> None:
    model, loss_fn = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=3, devices=["cpu"] * 3, chunks=2, schedule="1f1b",
                             loss_fn=loss_fn)
    first, last = pipe.get_parameter("0.weight"), pipe.get_parameter("5.weight")
    assert first is not last  # one copy per stage
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    optimizer_ref = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        x, y = case_batch("lm", seed=step)
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
        optimizer_ref.zero_grad()
        loss_fn(reference(x), y).backward()
        optimizer_ref.step()
    assert torch.equal(first, last)
    assert relative_error(first.detach(), reference[0].weight.detach()) <= 1e-10


def test_eval_step_is_the_plain_forward() -> None:
    model, _ = case_model("lm")
    reference = copy.deepcopy(model).eval()
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=3, loss_fn=lm_loss)
    pipe.eval()
    x, _ = case_batch("lm")
    out = pipe.eval_step(x)
    assert not out.requires_grad
    with torch.no_grad():
        assert relative_error(out, reference(x)) <= 1e-12


def test_clip_grad_norm_counts_a_tied_weight_once() -> None:
    model, loss_fn = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=3, devices=["cpu"] * 3, chunks=2, loss_fn=loss_fn)
    x, y = case_batch("lm")
    pipe.step(x, y)
    loss_fn(reference(x), y).backward()
    norm = pipe.clip_grad_norm_(0.1)
    expected = nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    assert abs(norm.item() - expected.item()) <= 1e-6 * expected.item()
    same_grads_as(pipe, reference)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble"])
def test_a_recomputed_last_stage_keeps_neither_its_logits_nor_what_the_loss_saves(
        schedule: str, pair: bool, compiled: bool) -> None:
    """A recomputed micro-batch's loss is recomputed with the last stage, so that it keeps
    its input alone: not its logits nor their log-softmax, one pair per micro-batch in
    flight (what kept Table 1's Pipeline-1 at 16 blocks where 18 fit; a stage compiled as
    one graph, which recomputes inside its own backward, keeps its logits for the loss).
    The loss runs again in backward, where ``conveyor.is_recomputing()`` is true; the
    gradients are the plain model's, also for a ``(loss_sum, count)`` loss and a split
    backward (zero-bubble rebuilds the stage and its loss once, for I and W)."""
    model, _ = case_model("lm")
    reference = copy.deepcopy(model)
    alive: dict[str, list[weakref.ref[torch.Tensor]]] = {"logits": [], "log-softmax": []}
    held: list[tuple[int, int]] = []  # at each first call: earlier ones' tensors alive
    calls = Counter[bool]()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> Any:
        calls[conveyor.is_recomputing()] += 1
        if not conveyor.is_recomputing():
            held.append((sum(r() is not None for r in alive["logits"]),
                         sum(r() is not None for r in alive["log-softmax"])))
            alive["logits"].append(weakref.ref(logits))
        logged = logits.flatten(0, 1).log_softmax(-1)
        if not conveyor.is_recomputing():
            alive["log-softmax"].append(weakref.ref(logged))
        summed = nn.functional.nll_loss(logged, targets.flatten(), reduction="sum")
        return (summed, targets.numel()) if pair else summed / targets.numel()

    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4,
                             schedule=schedule, loss_fn=loss_fn, recompute="always",
                             compile=compiled)
    x, y = case_batch("lm", batch=8)
    step_equals_the_plain_model(pipe, reference, lm_loss, x, y)
    assert calls == {False: 4, True: 4}  # each micro-batch's loss once more, in backward
    # GPipe's last stage runs its four forwards before its first backward (zero-bubble's
    # alternates F and I: nothing of an earlier micro-batch is left at the next F)
    kept_logits = compiled and schedule == "gpipe"
    assert held == ([(i, 0) for i in range(4)] if kept_logits else [(0, 0)] * 4), held


def test_non_finite_loss_names_the_micro_batch() -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y) * (float("inf") if bool((y > 100).any()) else 1)

    pipe = conveyor.Pipeline(deep_mlp(), stages=2, devices=["cpu"] * 2, chunks=4,
                             loss_fn=loss_fn, check_finite=True)
    x, y = case_batch("mlp", batch=8)
    y[5, 0] = 1000.0  # micro-batch 2
    with pytest.raises(NonFiniteLossError, match=r"the loss of micro-batch 2 is inf"):
        pipe.step(x, y)


def test_layer_builder_and_meta_models_match_their_reference() -> None:
    torch.manual_seed(3)
    pipe = conveyor.Pipeline(lambda i: deep_mlp()[i], layers=12, stages=3,
                             devices=["cpu"] * 3, chunks=2, loss_fn=nn.functional.mse_loss)
    torch.manual_seed(3)
    reference = sequential(lambda i: deep_mlp()[i], 12)
    assert list(pipe.state_dict()) == list(reference.state_dict())
    assert all(torch.equal(a, b) for a, b in paired(pipe.state_dict().values(),
                                                     reference.state_dict().values()))
    with torch.device("meta"):
        meta = tied_lm()
    pipe = conveyor.Pipeline(meta, stages=2, devices=["cpu"] * 2, chunks=2, loss_fn=lm_loss)
    assert not any(p.is_meta for p in pipe.parameters())
    assert torch.equal(pipe.get_parameter("0.weight"), pipe.get_parameter("5.weight"))


def test_balance_by_time_on_a_sample() -> None:
    # Five layers with the same parameters; the last does 8x the work of the others. Any
    # other split is at least 1/8 slower: far outside the 5% within which balance_by_time
    # takes the split with the most even layer counts.
    model = one_costly_layer(5, 4, times=8)
    x, y = torch.randn(128, 128), torch.randn(128, 128)
    by_parameters = conveyor.Pipeline(copy.deepcopy(model), stages=2, devices=["cpu"] * 2, chunks=2,
                                      loss_fn=nn.functional.mse_loss)
    with one_cpu_thread():  # the sample is profiled as one micro-batch
        by_time = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2,
                                    loss_fn=nn.functional.mse_loss, balance="time", sample=x)
    assert by_parameters.balance == [2, 3]
    assert by_time.balance == [4, 1]  # the costly layer alone, the four others together
    reference = copy.deepcopy(model)
    by_time.step(x, y)
    nn.functional.mse_loss(reference(x), y).backward()
    for p, r in paired(by_time.parameters(), reference.parameters()):
        assert relative_error(p.grad, r.grad) <= 1e-5
    with pytest.raises(BalanceError, match=r"balance='time' profiles the model on a batch"):
        conveyor.Pipeline(case_model("lm")[0], stages=2, devices=["cpu"] * 2, chunks=2,
                          loss_fn=lm_loss, balance="time")


def test_bad_arguments_say_what_to_do() -> None:
    mlp = deep_mlp()
    with pytest.raises(ScheduleError, match=r"unknown schedule 'pipedream'"):
        conveyor.Pipeline(mlp, stages=2, devices=["cpu"] * 2, chunks=2, schedule="pipedream",
                          loss_fn=nn.functional.mse_loss)
    with pytest.raises(ScheduleError, match=r"needs a multiple of 2 micro-batches"):
        conveyor.Pipeline(mlp, stages=2, devices=["cpu"] * 2, chunks=3,
                          schedule="interleaved-1f1b", virtual_stages=2,
                          loss_fn=nn.functional.mse_loss)
    with pytest.raises(BalanceError, match=r"give stages= \(the number of pipeline ranks\)"):
        conveyor.Pipeline(mlp, chunks=2, loss_fn=nn.functional.mse_loss)
    with pytest.raises(BalanceError, match=r"has 2 stages but the schedule has 4"):
        conveyor.Pipeline(mlp, stages=2, devices=["cpu"] * 2, chunks=2, balance=[6, 6],
                          schedule="interleaved-1f1b", virtual_stages=2,
                          loss_fn=nn.functional.mse_loss)
    with pytest.raises(BalanceError, match=r"tie_weights names 'x.weight', but the model has "
                                           r"no layer 'x'"):
        conveyor.Pipeline(mlp, stages=2, devices=["cpu"] * 2, chunks=2,
                          tie_weights=[["0.weight", "x.weight"]],
                          loss_fn=nn.functional.mse_loss)
    pipe = conveyor.Pipeline(mlp, stages=2, devices=["cpu"] * 2, chunks=2,
                             loss_fn=lambda out, y: (out - y) ** 2)
    x, y = case_batch("mlp")
    with pytest.raises(ConveyorError, match=r"loss_fn must return a one-element tensor or a "
                                            r"\(loss_sum, count\) pair, got \(5, 3\) on "
                                            r"micro-batch 0"):
        pipe.step(x, y)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"use eval_step\(\) for inference"):
        pipe.step(x, y)


def test_a_custom_schedule_table_runs() -> None:
    model, loss_fn = case_model("mlp")
    reference = copy.deepcopy(model)
    table = conveyor.schedules.parse("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1", name="mine")
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2, schedule=table,
                             loss_fn=loss_fn)
    x, y = case_batch("mlp")
    pipe.step(x, y)
    loss_fn(reference(x), y).backward()
    for p, r in paired(pipe.parameters(), reference.parameters()):
        assert relative_error(p.grad, r.grad) <= 1e-10


class CountsCalls(nn.Module):
    """A Linear and tanh that counts its forward calls, and its recomputations apart."""

    conveyor_harmless = ("calls",)  # a log the test reads, not state the model uses

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls: Counter[str] = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["recompute" if conveyor.is_recomputing() else "forward"] += 1
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "mixed"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_recomputed_micro_batch_is_recomputed_once(schedule: str, checkpoint: str) -> None:
    # Split backwards too (zero-bubble, and the I/W half of MIXED): I and W share one
    # rebuilt graph.
    model = nn.Sequential(CountsCalls(), CountsCalls()).double()
    table = conveyor.schedules.parse(MIXED, name="mixed") if schedule == "mixed" else schedule
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4, schedule=table,
                             checkpoint=checkpoint, loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64))
    recomputed = {"always": 4, "except_last": 3, "never": 0}[checkpoint]
    for layer in model:
        assert layer.calls == Counter(forward=4, recompute=recomputed) - Counter(), schedule


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("model_name", ["mlp", "lm"])
def test_a_table_mixing_full_and_split_backwards_equals_the_plain_model(
        model_name: str, checkpoint: str) -> None:
    # B on some micro-batches and stages, I then W on others (MIXED, in support/cases.py).
    model, loss_fn = case_model(model_name)
    reference = copy.deepcopy(model)
    table = conveyor.schedules.parse(MIXED, name="mixed")
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4, schedule=table,
                             loss_fn=loss_fn, checkpoint=checkpoint)
    x, y = case_batch(model_name)
    loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    plain = dict(reference.named_parameters(remove_duplicate=False))
    grads = {name: p.grad for name, p in pipe.named_parameters()}
    assert grads.keys() == plain.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        assert relative_error(grad, plain[name].grad) <= 1e-10, name
