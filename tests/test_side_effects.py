"""A forward that changes its module's state: recomputation sees what the forward saw.

The reference is the plain model run micro-batch by micro-batch, in order, each
backward right after its forward: a counter counts micro-batches, as it would under
gradient accumulation. The pipeline must give its gradients and leave its state, under
every schedule, recompute mode and face.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.engine.microbatch import split
from conveyor.schedules.builders import SCHEDULES, V_SHAPES
from tests.generated.models import Doubled  # a backward that is the forward's derivative
from tests.support.models import assert_same_grads, paired, relative_error


class InPlaceCounter(nn.Module):
    """A buffer advanced in place by every forward and read (a step counter)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return torch.tanh(self.f(x) * self.count.clone())


class Average(nn.Module):
    """A running average of its input, updated in place and added to its output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)
        self.register_buffer("average", torch.zeros(width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.average.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return torch.tanh(self.f(x) + self.average)


class Rebound(nn.Module):
    """A buffer replaced by a new tensor at every forward (``self.count = ...``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)
        self.register_buffer("count", torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count * 2
        return torch.tanh(self.f(x) / self.count)


class Calls(nn.Module):
    """A plain Python counter, and a tensor attribute that caches the last input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)
        self.calls = 0
        self.last = torch.zeros(width, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = torch.tanh(self.f(x) * (1 + 0.25 * self.calls) + self.last)
        self.last = x.detach().mean(0)
        return out


def stateful_model() -> nn.Sequential:
    torch.manual_seed(0)
    width = 4
    return nn.Sequential(InPlaceCounter(width), Average(width), Rebound(width), Calls(width),
                         InPlaceCounter(width), nn.Linear(width, 2)).double()


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def micro_batch_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          chunks: int) -> torch.Tensor:
    """The plain model over ``chunks`` micro-batches in order, each weighted by its
    share of the batch, gradients accumulated; returns the whole batch's loss."""
    total = torch.zeros((), dtype=torch.float64)
    for xs, ys in zip(split(x, chunks), split(y, chunks)):
        loss = loss_fn(model(xs), ys) * (len(xs) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def assert_same_state(pipe_model: nn.Module, reference: nn.Module) -> None:
    for (name, got), (_, want) in paired(pipe_model.named_buffers(),
                                         reference.named_buffers()):
        if got.is_floating_point():
            assert relative_error(got, want) <= 1e-12, name
        else:
            assert torch.equal(got, want), name
    for got, want in paired(pipe_model.modules(), reference.modules()):
        if isinstance(got, Calls):
            assert got.calls == want.calls
            assert relative_error(got.last, want.last) <= 1e-12


def schedule_options(schedule: str) -> tuple[int, dict[str, int]]:
    """Ranks and options for ``schedule`` on six layers."""
    if schedule in V_SHAPES:
        return 3 if schedule == "v-min" else 2, {}  # v-min holds its share from 3 on
    if schedule == "interleaved-1f1b":
        return 2, {"virtual_stages": 2}
    return 3, {}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_state_changed_in_forward_is_seen_by_recomputation_as_the_forward_saw_it(
        schedule: str, recompute: str, train: bool) -> None:
    model = stateful_model().train(train)
    reference = copy.deepcopy(model)
    ranks, options = schedule_options(schedule)
    stages = ranks * options.get("virtual_stages", 2 if schedule in V_SHAPES else 1)
    balance = {2: [3, 3], 3: [2, 2, 2], 4: [2, 1, 2, 1], 6: [1] * 6}[stages]
    pipe = conveyor.Pipeline(model, balance=balance, devices=["cpu"] * ranks, chunks=4,
                             schedule=schedule, recompute=recompute, loss_fn=loss_fn,
                             **options)
    x = torch.randn(10, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(10, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # the second step starts from the state the first left
        loss = pipe.step(x, y)
        expected = micro_batch_reference(reference, x, y, 4)
        assert relative_error(loss, expected) <= 1e-12
        assert_same_grads(model.named_parameters(), reference.named_parameters())
        assert_same_state(model, reference)


@pytest.mark.parametrize("recompute", ["always", "except_last"])
def test_gpipe_recomputes_a_counter_as_its_forward_saw_it(recompute: str) -> None:
    model = stateful_model()
    reference = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=3,
                          recompute=recompute)
    x = torch.randn(7, 4, dtype=torch.float64)
    y = torch.randn(7, 2, dtype=torch.float64)
    sizes = [len(part) for part in split(x, 3)]
    outputs = pipe(x)
    sum(loss_fn(out, ys) * (n / len(x)) for out, ys, n in
        zip(split(outputs, 3), split(y, 3), sizes)).backward()
    micro_batch_reference(reference, x, y, 3)
    assert_same_grads(model.named_parameters(), reference.named_parameters())
    assert_same_state(model, reference)


class TracedState(nn.Module):
    """Buffers updated in place, in a traced model (torch.export functionalises the
    updates; the stage writes the new values back)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.counter = InPlaceCounter(4)
        self.average = Average(4)
        self.again = InPlaceCounter(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.again(self.average(self.counter(x))))


@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_a_traced_model_s_buffer_updates_are_recomputed_as_first_seen(
        schedule: str, recompute: str) -> None:
    model = TracedState().double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, split_at=["average", "again"], devices=["cpu"] * 3,
                             chunks=4, schedule=schedule, recompute=recompute,
                             loss_fn=loss_fn, sample=x[:2])
    loss = pipe.step(x, y)
    expected = micro_batch_reference(reference, x, y, 4)
    assert relative_error(loss, expected) <= 1e-12
    assert_same_grads(model.named_parameters(), reference.named_parameters())
    assert_same_state(model, reference)


class Rebinding(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.first(x))


@pytest.mark.parametrize("inner, named", [(Rebound(4), "inner.count"),
                                          (Calls(4), "inner.calls, inner.last")])
def test_a_traced_forward_that_rebinds_its_state_is_refused_naming_it(
        inner: nn.Module, named: str) -> None:
    # torch.export keeps no record of `self.count = ...` or `self.calls += 1`: traced,
    # the stages would read the value of trace time for ever.
    model = Rebinding(inner).double()
    with pytest.raises(conveyor.ModelError, match=rf"Rebinding's forward rebinds {named}; "
                       r"torch.export records no such change(.|\n)*nn.Sequential with balance="):
        conveyor.Pipeline(model, split_at=["inner"], devices=["cpu"] * 2, chunks=2,
                          loss_fn=loss_fn, sample=torch.randn(2, 4, dtype=torch.float64))


def spectral() -> nn.Module:
    return nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))


def fake_quantized() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), torch.ao.quantization.FakeQuantize())


@pytest.mark.parametrize("recompute", ["always", "except_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble"])
@pytest.mark.parametrize("layer", [spectral, fake_quantized, lambda: nn.BatchNorm1d(4)],
                         ids=["spectral_norm", "FakeQuantize", "BatchNorm1d"])
def test_torch_s_own_modules_that_update_state_in_forward_train_exactly(
        layer: Callable[[], nn.Module], schedule: str, recompute: str) -> None:
    # Spectral norm's power iteration and a quantization observer update buffers in
    # every training forward, and what they updated shapes the output.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), layer(), nn.Tanh(), layer(),
                          nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=4,
                             schedule=schedule, recompute=recompute, loss_fn=loss_fn)
    x = torch.randn(12, 4, dtype=torch.float64)
    y = torch.randn(12, 2, dtype=torch.float64)
    for _ in range(2):
        loss = pipe.step(x, y)
        expected = micro_batch_reference(reference, x, y, 4)
        assert relative_error(loss, expected) <= 1e-12
        assert_same_grads(model.named_parameters(), reference.named_parameters())
        assert_same_state(model, reference)


@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
@pytest.mark.parametrize("face", ["sequential", "split_at", "gpipe"])
def test_an_in_place_module_at_a_cut_trains_exactly(face: str, recompute: str) -> None:
    torch.manual_seed(0)
    # Stage 2 hands its input on through an identity (dropout in eval mode does) to a
    # layer that writes into it (found by the generator, seed 254).
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4),
                          nn.Identity(), nn.LeakyReLU(inplace=True), nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    if face == "gpipe":
        pipe = conveyor.GPipe(model, [1, 2, 3], devices=["cpu"] * 3, chunks=4,
                              recompute=recompute)
        loss_fn(pipe(x), y).backward()
    else:
        cut = {"balance": [1, 2, 3]} if face == "sequential" else \
            {"split_at": ["1", "4"], "sample": x[:2]}
        pipe = conveyor.Pipeline(model, devices=["cpu"] * 3, chunks=4, recompute=recompute,
                                 loss_fn=loss_fn, **cut)
        pipe.step(x, y)
    loss_fn(reference(x), y).backward()
    assert_same_grads(model.named_parameters(), reference.named_parameters())


class StraightThrough(torch.autograd.Function):
    """Rounds forward; passes the gradient through unchanged (a straight-through
    estimator): its backward is not the derivative of its forward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.round()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


@torch.library.custom_op("conveyor_tests::straight_through", mutates_args=())
def straight_through(x: torch.Tensor) -> torch.Tensor:
    return x.round()


straight_through.register_fake(torch.empty_like)
straight_through.register_autograd(lambda ctx, grad: grad)


ROUNDINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "function": StraightThrough.apply, "custom_op": straight_through}


class Rounded(nn.Module):
    def __init__(self, rounding: str) -> None:
        super().__init__()
        self.rounding = rounding
        self.first = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(ROUNDINGS[self.rounding](self.first(x) * 3))


def test_a_traced_autograd_function_is_refused_as_export_drops_its_backward() -> None:
    model = Rounded("function").double()
    with pytest.raises(conveyor.ModelError, match=r"applies the autograd.Function "
                       r"StraightThrough, whose backward is not its forward's derivative "
                       r"\(they differ by 1 relative\): torch.export traces a Function's "
                       r"forward and drops its backward(.|\n)*torch.library.custom_op"):
        conveyor.Pipeline(model, split_at=["head"], devices=["cpu"] * 2, chunks=2,
                          loss_fn=loss_fn, sample=torch.randn(2, 4, dtype=torch.float64))


ROUNDINGS["derivative"] = Doubled.apply


@pytest.mark.parametrize("face", ["custom_op traced", "Function in nn.Sequential",
                                  "derivative Function traced"])
def test_a_straight_through_estimator_trains_exactly(face: str) -> None:
    torch.manual_seed(0)
    if face != "Function in nn.Sequential":
        model: nn.Module = Rounded(face.split()[0]).double()
        cut: dict[str, object] = {"split_at": ["head"]}
    else:
        inner = Rounded("function")
        model = nn.Sequential(inner.first, Scaled(), inner.head).double()
        cut = {"balance": [1, 2]}
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, devices=["cpu"] * 2, chunks=4, loss_fn=loss_fn,
                             schedule="zero-bubble", recompute="always",
                             sample=x[:2], **cut)
    pipe.step(x, y)
    loss_fn(reference(x), y).backward()
    assert_same_grads(model.named_parameters(), reference.named_parameters())
    first = next(reference.parameters())
    assert first.grad is not None and float(first.grad.abs().sum()) > 0  # passed through


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return StraightThrough.apply(x * 3)
