"""I then W gives exactly the gradients of one full backward B."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from conveyor.engine.backward import weightpath
from conveyor.engine.backward.weightgrad import backward_input
from tests.support.models import cnn, mlp, paired, relative_error, transformer


class TiedTwice(nn.Module):
    """One Linear used twice in a row, and a bias added to the output only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.offset = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x))) + self.offset


def stage_and_input(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        return mlp(), torch.randn(5, 6, dtype=torch.float64)
    if name == "cnn":
        return cnn(), torch.randn(5, 3, 8, 8, dtype=torch.float64)
    if name == "transformer blocks":
        model = transformer()
        return nn.Sequential(*list(model)[1:]), torch.randn(5, 7, 16, dtype=torch.float64)
    return TiedTwice().double(), torch.randn(5, 6, dtype=torch.float64)


@pytest.mark.parametrize("from_outputs", [False, True], ids=["by groups", "from outputs"])
@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer blocks", "tied"])
def test_split_backward_equals_full_backward(name: str, input_requires_grad: bool,
                                             from_outputs: bool) -> None:
    stage, x = stage_and_input(name)
    reference = copy.deepcopy(stage)
    grad = torch.randn_like(stage(x))

    x_ref = x.clone().requires_grad_(input_requires_grad)
    reference(x_ref).backward(grad)

    x_split = x.clone().requires_grad_(input_requires_grad)
    out = stage(x_split)
    params = list(stage.parameters())
    input_grads, weight_work = backward_input([out], [grad], [x_split], params,
                                              from_outputs=from_outputs)
    assert all(p.grad is None for p in params)  # I computed no weight gradient
    if input_requires_grad:
        assert input_grads[0] is not None and x_ref.grad is not None
        assert relative_error(input_grads[0], x_ref.grad) <= 1e-12
    else:
        assert input_grads == [None]
    weight_work.run()
    for (pname, p), r in paired(stage.named_parameters(), reference.parameters()):
        assert p.grad is not None, pname
        assert relative_error(p.grad, r.grad) <= 1e-12, pname


@pytest.mark.parametrize("from_outputs", [False, True], ids=["by groups", "from outputs"])
def test_scalar_loss_and_accumulation_into_existing_gradients(from_outputs: bool) -> None:
    stage, x = stage_and_input("mlp")
    reference = copy.deepcopy(stage)
    for p, r in paired(stage.parameters(), reference.parameters()):
        p.grad = torch.ones_like(p)
        r.grad = torch.ones_like(r)
    reference(x).pow(2).sum().backward()
    x = x.clone().requires_grad_()
    loss = stage(x).pow(2).sum()
    _, weight_work = backward_input([loss], [None], [x], list(stage.parameters()),
                                    from_outputs=from_outputs)
    weight_work.run()
    for p, r in paired(stage.parameters(), reference.parameters()):
        assert relative_error(p.grad, r.grad) <= 1e-12


class TwoOutputs(nn.Module):
    """A stage whose two outputs leave one autograd node: the halves of a ``chunk``, as
    the outputs of a compiled graph all leave its one backward node."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = self.linear(x).chunk(2, dim=-1)
        return first, second


@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_outputs_that_leave_one_node_each_get_their_own_gradient(
        input_requires_grad: bool, compiled: bool) -> None:
    # Found by the generator under compile=True: the first stage of zb-v at K=1 sent a
    # skip and its block's output, both leaving the compiled graph's one node, and W
    # started both at slot 0 of that node (the first output's gradient twice).
    torch.manual_seed(0)
    stage = TwoOutputs().double()
    reference = copy.deepcopy(stage)
    x = torch.randn(5, 6, dtype=torch.float64)
    grads = [torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)]
    x_ref = x.clone().requires_grad_(input_requires_grad)
    torch.autograd.backward(list(reference(x_ref)), grads)

    run = torch.compile(stage, backend="aot_eager") if compiled else stage
    x_split = x.clone().requires_grad_(input_requires_grad)
    outputs = list(run(x_split))
    assert outputs[0].grad_fn is not outputs[1].grad_fn or outputs[1].output_nr == 1
    input_grads, weight_work = backward_input(outputs, grads, [x_split],
                                              list(stage.parameters()))
    weight_work.run()
    if input_requires_grad:
        assert input_grads[0] is not None and x_ref.grad is not None
        assert relative_error(input_grads[0], x_ref.grad) <= 1e-12
    for (name, p), r in paired(stage.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        assert relative_error(p.grad, r.grad) <= 1e-12, name


class Clock:
    """A stand-in for time.perf_counter: each call advances by the next of ``steps``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.steps: list[float] = []

    def __call__(self) -> float:
        self.now += self.steps.pop(0) if self.steps else 0.0
        return self.now


@pytest.mark.parametrize("faster", ["groups", "outputs"])
def test_each_stage_takes_the_way_whose_weight_gradient_it_measured_cheaper(
        monkeypatch: pytest.MonkeyPatch, faster: str) -> None:
    clock = Clock()
    monkeypatch.setattr(weightpath.time, "perf_counter", clock)
    path = weightpath.WeightPath(0, torch.device("cpu"), None)
    taken = []
    for m in range(2 * weightpath.TRIALS):
        way = path.take(m)
        taken.append(way)
        cost = 1.0 if way == faster else 3.0
        started = path.start(m)
        clock.steps = [cost / 2]  # I
        path.stop(m, started, weight=False)
        started = path.start(m)
        clock.steps = [cost / 2]  # W
        path.stop(m, started, weight=True)
    assert taken == ["groups", "outputs"] * weightpath.TRIALS
    assert path.chosen == faster
    assert [path.take(m) for m in range(3)] == [faster] * 3
    assert path.start(0) is None  # no more timing once chosen


def test_each_ways_first_micro_batch_does_not_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fastest time decides, so a warm-up that misleads is one that ran unusually
    # fast (a slow one never wins a minimum): groups' first comes in at 0.1 here.
    clock = Clock()
    monkeypatch.setattr(weightpath.time, "perf_counter", clock)
    path = weightpath.WeightPath(0, torch.device("cpu"), None)
    for m in range(2 * weightpath.TRIALS):
        way = path.take(m)
        first = m < 2  # each way's first micro-batch is its warm-up
        cost = 0.1 if first and way == "groups" else {"groups": 2.0, "outputs": 1.0}[way]
        started = path.start(m)
        path.stop(m, started, weight=False)
        started = path.start(m)
        clock.steps = [cost]
        path.stop(m, started, weight=True)
    assert path.chosen == "outputs"


def test_the_way_can_be_fixed_and_a_wrong_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_WEIGHT_PATH", "outputs")
    assert weightpath.fixed_path() == "outputs"
    path = weightpath.WeightPath(0, torch.device("cpu"), weightpath.fixed_path())
    assert path.take(0) == "outputs" and path.start(0) is None
    monkeypatch.setenv("CONVEYOR_WEIGHT_PATH", "roots")
    with pytest.raises(ValueError, match="CONVEYOR_WEIGHT_PATH='roots': give 'groups' or"):
        weightpath.fixed_path()


@pytest.mark.parametrize("way", ["groups", "outputs", ""])
@pytest.mark.parametrize("schedule", ["zero-bubble", "zb-v"])
def test_zero_bubble_gives_the_plain_models_gradients_whichever_way_w_starts(
        monkeypatch: pytest.MonkeyPatch, way: str, schedule: str) -> None:
    import conveyor

    monkeypatch.setenv("CONVEYOR_WEIGHT_PATH", way)  # "": measured, both ways taken
    torch.manual_seed(0)
    model = mlp().double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, stages=2, chunks=8, schedule=schedule,
                             loss_fn=nn.functional.mse_loss)
    for _ in range(2):  # the second step runs by the way the first chose
        pipe.zero_grad()
        loss = pipe.step(x, y)
    nn.functional.mse_loss(plain(x), y).backward()
    assert relative_error(loss, nn.functional.mse_loss(plain(x), y).detach()) <= 1e-12
    for (name, p), r in paired(pipe.named_parameters(), plain.parameters()):
        assert relative_error(p.grad, r.grad) <= 1e-10, name
    stages = pipe.runtime.layout.stages
    chosen = {stage.weight_path.chosen for index, stage in stages.items() if index > 0}
    assert chosen <= set(weightpath.PATHS) and (not way or chosen == {way})
    # The first stage's input takes no gradient: its W is its whole backward, unsplit.
    assert way or stages[0].weight_path.chosen is None


@pytest.mark.parametrize("from_outputs", [False, True], ids=["by groups", "from outputs"])
def test_a_stage_without_parameters_has_nothing_to_do_in_w(from_outputs: bool) -> None:
    # Found by the generator (seed 16.2): zb-v's stage of a function and a relu_.
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    out = torch.relu(x * 2)
    input_grads, weight_work = backward_input([out], [torch.ones_like(out)], [x], [],
                                              from_outputs=from_outputs)
    weight_work.run()
    assert input_grads[0] is not None and torch.equal(input_grads[0], 2.0 * (x > 0))


class Doubling(torch.autograd.Function):
    """A Python autograd function whose backward counts its calls (as one that
    communicates or adds into ``.grad`` would act on each)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        Doubling.calls += 1
        return 2 * grad


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(Doubling.apply(x))


def test_a_python_autograd_function_in_a_stage_keeps_w_by_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import conveyor

    monkeypatch.delenv("CONVEYOR_WEIGHT_PATH", raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), WithFunction()).double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, balance=[2, 1], chunks=8, schedule="zero-bubble",
                             loss_fn=nn.functional.mse_loss)
    Doubling.calls = 0
    pipe.step(x, y)
    assert Doubling.calls == 8  # once a micro-batch: its backward never ran twice
    nn.functional.mse_loss(plain(x), y).backward()
    for (name, p), r in paired(pipe.named_parameters(), plain.parameters()):
        assert relative_error(p.grad, r.grad) <= 1e-10, name
    assert pipe.runtime.layout.stages[1].weight_path.chosen == "groups"


def test_a_graph_with_a_python_autograd_function_is_split_by_groups_even_from_outputs() -> None:
    # A stage's micro-batches may build different graphs (zb-v with a recomputed last
    # stage: some rebuilt from their outputs, some with the loss at the root), so each I
    # from the outputs looks at its own graph.
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(6, 6), WithFunction()).double()  # a weight below it
    reference = copy.deepcopy(stage)
    x = torch.randn(4, 6, dtype=torch.float64)
    grad = torch.randn(4, 3, dtype=torch.float64)
    reference(x.clone().requires_grad_()).backward(grad)
    Doubling.calls = 0
    x_split = x.clone().requires_grad_()
    out = stage(x_split)
    _, weight_work = backward_input([out], [grad], [x_split], list(stage.parameters()),
                                    from_outputs=True)
    weight_work.run()
    assert Doubling.calls == 1 and not weight_work.repeatable  # I alone ran it
    for (name, p), r in paired(stage.named_parameters(), reference.parameters()):
        assert relative_error(p.grad, r.grad) <= 1e-12, name
