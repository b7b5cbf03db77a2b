"""State a pipeline cannot put back around a recomputation, or that crosses stages:
exact where it can be, otherwise refused by name at the first step (issue 46).

The reference is the plain model run micro-batch by micro-batch, in order, each
backward right after its forward, in float64, on threads.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.schedules.builders import SCHEDULES, V_SHAPES
from tests.support.models import assert_same_grads, relative_error
from tests.test_side_effects import loss_fn, micro_batch_reference, schedule_options

WIDTH = 4


def _data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(batch, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return x, y


def _pipe(model: nn.Module, schedule: str = "1f1b", recompute: str = "always",
          **options: Any) -> conveyor.Pipeline:
    ranks, extra = schedule_options(schedule)
    stages = ranks * extra.get("virtual_stages", 2 if schedule in V_SHAPES else 1)
    layers = len(model)  # type: ignore[arg-type]
    base, more = divmod(layers, stages)
    balance = [base + (s < more) for s in range(stages)]
    return conveyor.Pipeline(model, balance=balance, devices=["cpu"] * ranks, chunks=4,
                             schedule=schedule, recompute=recompute, loss_fn=loss_fn,
                             **extra, **options)


# ---------------------------------------------------------------- 1. across stages

class Writer(nn.Module):
    """Adds its input's mean into a buffer it may share with another layer."""

    def __init__(self, state: torch.Tensor) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("state", state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.state.add_(x.mean(0))
        return torch.tanh(self.f(x))


class Reader(nn.Module):
    """Reads a buffer it may share with another layer."""

    def __init__(self, state: torch.Tensor) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("state", state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.f(x) + self.state)


def shared_buffer_model() -> nn.Sequential:
    torch.manual_seed(0)
    state = torch.zeros(WIDTH, dtype=torch.float64)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), Writer(state), Reader(state),
                         nn.Linear(WIDTH, 2)).double()


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_a_buffer_written_in_one_stage_and_read_in_another_is_refused(recompute: str) -> None:
    # Silent before: stage 1 read the buffer as stage 0's later micro-batches left it
    # (loss off by 1e-3 and more, with thread timing).
    pipe = _pipe(shared_buffer_model(), "gpipe", recompute)
    with pytest.raises(conveyor.ModelError, match=r"stage 0's forward of micro-batch 0 "
                       r"changed one tensor object held as 1\.state \(stage 0\) and 2\.state "
                       r"\(stage 1\)(.|\n)*Put those modules in one stage"):
        pipe.step(*_data())


def test_a_buffer_shared_across_stages_and_only_read_trains_exactly() -> None:
    torch.manual_seed(0)
    table = torch.randn(WIDTH, dtype=torch.float64)
    model = nn.Sequential(Reader(table), nn.Linear(WIDTH, WIDTH), Reader(table),
                          nn.Linear(WIDTH, 2)).double()
    reference = copy.deepcopy(model)
    x, y = _data()
    loss = _pipe(model, "1f1b", "always").step(x, y)
    assert relative_error(loss, micro_batch_reference(reference, x, y, 4)) <= 1e-12
    assert_same_grads(model.named_parameters(), reference.named_parameters())


class Counting(nn.Module):
    """A module used by two layers of different stages, counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (1 + 0.1 * self.calls)


class Using(nn.Module):
    def __init__(self, counting: Counting) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.counting = counting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.counting(self.f(x)))


def test_a_module_used_by_two_stages_whose_forward_counts_is_refused() -> None:
    torch.manual_seed(0)
    counting = Counting()
    model = nn.Sequential(Using(counting), Using(counting), nn.Linear(WIDTH, 2)).double()
    pipe = conveyor.Pipeline(model, balance=[1, 2], devices=["cpu"] * 2, chunks=4,
                             recompute="never", loss_fn=loss_fn)
    with pytest.raises(conveyor.ModelError, match=r"one module object held as 0\.counting "
                       r"\(stage 0\) and 1\.counting \(stage 1\)"):
        pipe.step(*_data())


class Counted(nn.Module):
    """Counts its calls in a buffer, then reads it after its submodule: a cut at the
    submodule splits the write from the read."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.inner(h))
        return self.head(h * self.count)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
@pytest.mark.parametrize("recompute", ["always", "never"])
def test_a_traced_module_split_between_its_write_and_its_read_is_exact(
        schedule: str, recompute: str) -> None:
    # The write is a value of the graph: it crosses the cut with its micro-batch.
    torch.manual_seed(0)
    model = Counted().double()
    reference = copy.deepcopy(model)
    x, y = _data()
    pipe = conveyor.Pipeline(model, split_at=["inner"], devices=["cpu"] * 2, chunks=4,
                             schedule=schedule, recompute=recompute, loss_fn=loss_fn,
                             sample=x[:2])
    loss = pipe.step(x, y)
    assert relative_error(loss, micro_batch_reference(reference, x, y, 4)) <= 1e-12
    assert_same_grads(model.named_parameters(), reference.named_parameters())
    assert torch.equal(model.count, reference.count)


# ---------------------------------------------------------------- 2. own generators

class Noisy(nn.Module):
    """Adds noise drawn from a generator of its own."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, dtype=x.dtype, generator=self.gen)
        return torch.tanh(self.f(x) * (1 + 0.5 * noise))


def noisy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Noisy(1), nn.Linear(WIDTH, WIDTH), Noisy(2), Noisy(3),
                         nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)).double()


@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_module_s_own_generator_draws_as_in_the_plain_model(schedule: str,
                                                              recompute: str) -> None:
    # Wrong before under recomputation: the recomputation drew the generator's next
    # numbers, not those the forward drew (gradients 5e-2 off).
    model = noisy_model()
    reference = copy.deepcopy(model)
    x, y = _data(10)
    pipe = _pipe(model, schedule, recompute)
    for _ in range(2):
        loss = pipe.step(x, y)
        assert relative_error(loss, micro_batch_reference(reference, x, y, 4)) <= 1e-12
        assert_same_grads(model.named_parameters(), reference.named_parameters())
    for got, want in zip(model, reference):
        if isinstance(got, Noisy):
            assert torch.equal(got.gen.get_state(), want.gen.get_state())


class NoisyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Noisy(1)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x))


def test_a_traced_model_drawing_from_its_own_generator_is_refused_naming_it() -> None:
    model = NoisyModel().double()
    with pytest.raises(conveyor.ModelError, match=r"first\.gen is a torch\.Generator(.|\n)*"
                       r"balance="):
        conveyor.Pipeline(model, split_at=["head"], devices=["cpu"] * 2, chunks=2,
                          loss_fn=loss_fn, sample=torch.randn(2, WIDTH, dtype=torch.float64))


# ---------------------------------------------------------------- 3. containers

class Logging(nn.Module):
    """Appends to a list and counts in a dict in forward, and reads the list."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.seen: list[float] = []
        self.counts: dict[str, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(float(x.detach().sum()))
        self.counts["calls"] = self.counts.get("calls", 0) + 1
        return torch.tanh(self.f(x) * (1 + 0.1 * len(self.seen)))


def logging_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), Logging(), nn.Linear(WIDTH, 2)).double()


@pytest.mark.parametrize("recompute", ["always", "except_last"])
def test_a_list_appended_in_a_recomputed_forward_is_refused_naming_it(recompute: str) -> None:
    # Silent before: the list ended 7 or 8 long instead of 4, its length read.
    pipe = _pipe(logging_model(), "gpipe", recompute)
    with pytest.raises(conveyor.ModelError, match=r"changed 1\.seen \(list, Logging\) in "
                       r"place(.|\n)*Logging\.conveyor_harmless = \('seen',\)"):
        pipe.step(*_data())


def test_a_container_declared_harmless_is_left_alone_and_never_recomputed_is_exact() -> None:
    model = logging_model()
    model[1].conveyor_harmless = ("seen", "counts")  # type: ignore[assignment]
    _pipe(model, "gpipe", "always").step(*_data())
    assert len(model[1].seen) == 8  # 4 forwards and 4 recomputations: declared harmless
    model, x_y = logging_model(), _data()
    reference = copy.deepcopy(model)
    loss = _pipe(model, "1f1b", "never").step(*x_y)
    assert relative_error(loss, micro_batch_reference(reference, *x_y, 4)) <= 1e-12
    assert_same_grads(model.named_parameters(), reference.named_parameters())
    assert model[1].seen == reference[1].seen and model[1].counts == {"calls": 4}


# ---------------------------------------------------------------- 4. parameters

class Clamped(nn.Module):
    """WGAN's critic layer: clamps its weight in forward."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.through_data = through_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_data:
            self.f.weight.data.mul_(0.99)
        else:
            with torch.no_grad():
                self.f.weight.clamp_(-0.1, 0.1)
        return torch.tanh(self.f(x))


@pytest.mark.parametrize("through_data", [False, True], ids=["no_grad", "data"])
@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_a_parameter_changed_in_forward_is_refused_at_the_first_step_naming_it(
        schedule: str, recompute: str, through_data: bool) -> None:
    # Before: autograd's "modified by an inplace operation" mid-step under most of
    # these, a silent wrong gradient through .data.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Clamped(through_data),
                          nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)).double()
    pipe = conveyor.Pipeline(model, balance=[2, 2], devices=["cpu"] * 2, chunks=4,
                             schedule=schedule, recompute=recompute, loss_fn=loss_fn)
    with pytest.raises(conveyor.ModelError, match=r"stage 0's forward of micro-batch 0 "
                       r"changed the parameter 1\.f\.weight in place(.|\n)*optimizer\.step"):
        pipe.step(*_data())


# ---------------------------------------------------------------- traced batch norm

class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH, momentum=None)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.f(x)))


def test_a_traced_batch_norm_with_a_cumulative_average_says_why_and_what_to_do() -> None:
    with pytest.raises(conveyor.ModelError, match=r"norm \(BatchNorm1d\) has momentum=None"
                       r"(.|\n)*num_batches_tracked(.|\n)*nn\.Sequential with balance="):
        conveyor.Pipeline(Normed().double(), split_at=["head"], devices=["cpu"] * 2,
                          chunks=2, loss_fn=loss_fn,
                          sample=torch.randn(4, WIDTH, dtype=torch.float64))


def test_the_first_look_runs_once_per_stage_and_mode_not_at_every_action(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.engine.recompute.firstlook import FirstLook
    looks: list[int] = []
    own = FirstLook._look

    def counted(self: FirstLook, recomputed: bool) -> Any:
        looks.append(self.stage)
        return own(self, recomputed)

    monkeypatch.setattr(FirstLook, "_look", counted)
    pipe = _pipe(logging_model(), "1f1b", "except_last")
    model_logging = pipe.get_submodule("1")
    model_logging.conveyor_harmless = ("seen", "counts")
    pipe.step(*_data())
    first = sorted(looks)
    assert first == [0, 0, 1, 1, 2, 2]  # each stage: recomputed, and its last micro-batch
    pipe.step(*_data())
    assert sorted(looks) == first



class Sizes(Logging):
    """Logs its input's size (a traced forward cannot take a tensor's value)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        self.counts["calls"] = self.counts.get("calls", 0) + 1
        return torch.tanh(self.f(x) * (1 + 0.1 * len(self.seen)))


class LoggingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Sizes()
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x))


def test_a_traced_forward_that_changes_a_container_is_refused_naming_it() -> None:
    # Silent before: torch.export keeps no record of a list appended to; the traced
    # stages read its length at trace time for ever.
    with pytest.raises(conveyor.ModelError, match=r"first\.seen \(a container changed in "
                       r"place\), first\.counts \(a container changed in place\)"):
        conveyor.Pipeline(LoggingModel().double(), split_at=["head"], devices=["cpu"] * 2,
                          chunks=2, loss_fn=loss_fn,
                          sample=torch.randn(2, WIDTH, dtype=torch.float64))


class SharedTraced(nn.Module):
    """One buffer held by a writer and a reader, in the order ``order`` gives."""

    def __init__(self, order: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        state = torch.zeros(WIDTH, dtype=torch.float64)
        self.order = order
        self.a = Writer(state) if order == "write-read" else Reader(state)
        self.b = Reader(state) if order == "write-read" else Writer(state)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_a_traced_buffer_written_then_read_by_the_next_stage_crosses_with_its_micro_batch(
        recompute: str) -> None:
    # Silent before: the write (inside torch.no_grad()) went to stage 1 as the buffer
    # itself, which stage 0's later micro-batches kept changing.
    model = SharedTraced("write-read").double()
    reference = copy.deepcopy(model)
    x, y = _data()
    pipe = conveyor.Pipeline(model, split_at=["b"], devices=["cpu"] * 2, chunks=4,
                             schedule="1f1b", recompute=recompute, loss_fn=loss_fn,
                             sample=x[:2])
    loss = pipe.step(x, y)
    assert relative_error(loss, micro_batch_reference(reference, x, y, 4)) <= 1e-12
    assert_same_grads(model.named_parameters(), reference.named_parameters())
    assert torch.equal(model.a.state, reference.a.state)


def test_a_traced_buffer_read_by_one_stage_and_written_by_a_later_one_is_refused() -> None:
    with pytest.raises(conveyor.ModelError, match=r"the buffer a\.state = b\.state is written "
                       r"in place by stage 1 and read by stage 0(.|\n)*split_at"):
        conveyor.Pipeline(SharedTraced("read-write").double(), split_at=["b"],
                          devices=["cpu"] * 2, chunks=2, loss_fn=loss_fn,
                          sample=torch.randn(2, WIDTH, dtype=torch.float64))
