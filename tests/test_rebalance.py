"""Re-balancing while training: layers move between stages between two steps, and
every parameter and optimizer state stays the plain model's (float64, 1e-10)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.runtime.rebalance.optimizer import adopt, release
from conveyor.runtime.rebalance.rebalancing import StageTimes
from conveyor.runtime.rebalance.policy import layer_costs
from conveyor.schedules import build
from tests.support.launch import launch
from tests.support.models import relative_error
from tests.support.scenarios.rebalance import (
    LAYERS,
    OPTIMIZERS,
    STEPS,
    Slow,
    batch,
    by_name,
    layer,
    model,
    plain_model,
    train,
)

pytestmark = pytest.mark.timeout(300)

POLICY = conveyor.Rebalance(window=2, warmup=1, threshold=0.05)


def plain_run(name: str) -> list[dict[str, Any]]:
    """The plain model trained as the pipelines are: per step, what ``by_name`` says."""
    plain = plain_model(name)
    optimizer = OPTIMIZERS[name](list(plain.named_parameters()))
    steps = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step)
        nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()
        steps.append(by_name(list(plain.named_parameters()), optimizer))
    return steps


def assert_same(found: dict[str, Any], expected: dict[str, Any], label: str) -> None:
    """Weights and optimizer state as the plain model's. AdamW's weights to 1e-6: its
    step divides each gradient by its size plus 1e-8, so an element near zero turns the
    roundoff of a sum over micro-batches into up to 3e-7 of the weights (torch 2.14.1);
    its moments, the gradients themselves, are held to 1e-10."""
    assert sorted(found) == sorted(expected), label
    for name, want in expected.items():
        got = found[name]
        tolerance = 1e-6 if "exp_avg" in want["state"] else 1e-10
        assert relative_error(got["value"], want["value"]) <= tolerance, f"{label} {name}"
        assert sorted(got["state"]) == sorted(want["state"]) != [], f"{label} {name}"
        for key, value in want["state"].items():
            if isinstance(value, torch.Tensor) and value.dim():
                assert relative_error(got["state"][key], value) <= 1e-10, f"{label} {name} {key}"
            else:
                assert float(got["state"][key]) == float(value), f"{label} {name} {key}"
        assert got["decay"] == want["decay"], f"{label} {name}"


@pytest.mark.parametrize("name, schedule", [("adamw", "1f1b"), ("sgd", "zero-bubble"),
                                            ("sgd", "gpipe")])
def test_a_move_in_threads_trains_as_the_plain_model(
        name: str, schedule: str, caplog: pytest.LogCaptureFixture) -> None:
    source: Any = model() if name == "adamw" else layer
    torch.manual_seed(7)
    pipe = conveyor.Pipeline(source, layers=None if name == "adamw" else LAYERS,
                             balance=[1, 5], devices=["cpu", "cpu"], chunks=4,
                             schedule=schedule, loss_fn=nn.functional.mse_loss,
                             rebalance=POLICY)
    optimizer = OPTIMIZERS[name](list(pipe.named_parameters()))
    with caplog.at_level(logging.INFO, logger="conveyor"):
        steps = train(pipe, optimizer)
    # Step 1 warms up, steps 2-3 are measured, the move comes before step 4.
    assert [s["balance"] for s in steps[:3]] == [[1, 5]] * 3
    moved = steps[3]["balance"]
    assert moved != [1, 5] and moved[0] > 1 and steps[-1]["balance"] == moved
    # The two slow layers (2 and 4) end on different stages.
    assert moved[0] in (3, 4)
    lines = [r.getMessage() for r in caplog.records if "rebalanced" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("rebalanced after step 3: stage times [")
    assert f"balance [1, 5] -> {moved}, predicted step" in lines[0]
    for step, (found, expected) in enumerate(zip(steps, plain_run(name), strict=True)):
        assert_same(found["params"], expected, f"{name} {schedule} step {step + 1}")
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in
                                                       plain_model(name).named_parameters()]


def test_no_move_below_the_threshold(caplog: pytest.LogCaptureFixture) -> None:
    pipe = conveyor.Pipeline(model(), balance=[1, 5], devices=["cpu", "cpu"], chunks=4,
                             loss_fn=nn.functional.mse_loss,
                             rebalance=conveyor.Rebalance(window=2, warmup=1, threshold=50))
    with caplog.at_level(logging.DEBUG, logger="conveyor"):
        steps = train(pipe, torch.optim.SGD(pipe.parameters(), lr=0.01))
    assert [s["balance"] for s in steps] == [[1, 5]] * STEPS
    lines = [r.getMessage() for r in caplog.records if "re-balance" in r.getMessage()]
    assert lines and lines[0].startswith("no re-balance after step 3: stage times [")
    assert "not above the threshold of 5000%" in lines[0]


def test_a_recording_goes_on_across_a_move() -> None:
    pipe = conveyor.Pipeline(model(), balance=[1, 5], devices=["cpu", "cpu"], chunks=4,
                             loss_fn=nn.functional.mse_loss, rebalance=POLICY)
    x, y = batch(0)
    with conveyor.record(pipe) as timeline:
        for _ in range(4):
            pipe.step(x, y)
    assert pipe.balance != [1, 5]
    assert len(timeline.events) == 4 * 2 * 2 * 4  # steps x stages x (F, B) x micro-batches
    assert pipe.runtime.executor.recorder is None


def test_deferred_batch_norm_statistics_move_with_their_layer() -> None:
    # Deferred batch norm normalises each micro-batch by its own statistics, unlike the
    # plain model: the reference is the same pipeline, kept at its balance.
    def bn_model() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), Slow(), nn.Tanh(),
                             Slow(), nn.Linear(12, 3)).double()

    pipes = [conveyor.Pipeline(bn_model(), balance=[1, 5], devices=["cpu", "cpu"], chunks=4,
                               loss_fn=nn.functional.mse_loss, rebalance=policy,
                               deferred_batch_norm=True) for policy in (POLICY, None)]
    optimizers = [torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9) for pipe in pipes]
    for step in range(STEPS):
        x, y = batch(step)
        for pipe, optimizer in zip(pipes, optimizers, strict=True):
            optimizer.zero_grad()
            pipe.step(x, y)
            optimizer.step()
    assert [pipe.balance for pipe in pipes] == [[3, 3], [1, 5]]
    found, expected = (pipe.state_dict() for pipe in pipes)
    assert sorted(found) == sorted(expected)
    for key, value in expected.items():
        assert relative_error(found[key].double(), value.double()) <= 1e-10, key
    assert int(found["1.num_batches_tracked"]) == STEPS
    assert found["1.running_mean"].abs().sum() > 0


# ---------------------------------------------------------------------- the policy


def times(forward: list[float], backward: list[float], layers: int = 8) -> StageTimes:
    return StageTimes(tuple(forward), tuple(backward), (0.0,) * len(forward),
                      (1.0,) * layers, 0.0, 2)


def test_the_policy_predicts_with_the_simulator() -> None:
    # Every layer costs F 0.5 and B 1 s: balance [2, 6] has stages of F 1 / B 2 and
    # F 3 / B 6. GPipe over 4 micro-batches: 1 + 4 x 3 for the forwards, 4 x 6 + 2 for
    # the backwards = 39 s; balanced [4, 4], 5 x 2 + 5 x 4 = 30 s.
    proposal = conveyor.Rebalance(threshold=0.1).propose(times([1, 3], [2, 6]), [2, 6],
                                                         build("gpipe", 2, 4))
    assert proposal.move and proposal.balance == [4, 4]
    assert proposal.reason == ("stage times [12000, 36000] ms, slowest 1.50x the balanced "
                               "optimum; balance [2, 6] -> [4, 4], predicted step 39000 ms "
                               "-> 30000 ms")
    kept = conveyor.Rebalance(threshold=0.5).propose(times([1, 3], [2, 6]), [2, 6],
                                                     build("gpipe", 2, 4))
    assert not kept.move and kept.balance == [2, 6]
    assert kept.reason.endswith("(30.0% faster, not above the threshold of 50%)")
    there = conveyor.Rebalance().propose(times([2, 2], [4, 4]), [4, 4], build("1f1b", 2, 4))
    assert not there.move and there.reason.endswith("(already there)")


def test_a_stage_time_divides_by_the_layers_forward_times() -> None:
    measured = StageTimes((4.0, 1.0), (8.0, 2.0), (0.0, 1.0), (1.0, 3.0, 0.0, 0.0), 0.0, 1)
    assert layer_costs(measured, [2, 2]) == [(1.0, 2.0, 0.0), (3.0, 6.0, 0.0),
                                             (0.5, 1.0, 0.5), (0.5, 1.0, 0.5)]


@pytest.mark.parametrize("options, match", [
    ({"window": 0}, r"Rebalance\(window=0\): the window is a number of steps"),
    ({"warmup": -1}, r"Rebalance\(warmup=-1\)"),
    ({"threshold": -0.1}, r"Rebalance\(threshold=-0.1\): give the least gain"),
])
def test_policy_options_are_checked(options: dict[str, Any], match: str) -> None:
    with pytest.raises(conveyor.ConfigError, match=match):
        conveyor.Rebalance(**options)


# ---------------------------------------------------------------------- refusals


def test_what_cannot_be_rebalanced_yet_is_refused() -> None:
    mse = nn.functional.mse_loss
    with pytest.raises(conveyor.ConfigError, match=r"rebalance=True: give a policy"):
        conveyor.Pipeline(model(), balance=[1, 5], devices=["cpu", "cpu"], chunks=2,
                          loss_fn=mse, rebalance=True)  # type: ignore[arg-type]
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    tied[2].weight = tied[1].weight
    with pytest.raises(conveyor.ConfigError, match=r"1.weight = 2.weight tied across layers "
                                                   r"\['1', '2'\] is not supported yet"):
        conveyor.Pipeline(tied, balance=[2, 2], devices=["cpu", "cpu"], chunks=2,
                          loss_fn=mse, rebalance=POLICY)
    tied[2].weight = nn.Parameter(torch.randn(4, 4))
    tied[3].weight = tied[0].weight  # the first and the last layer never move: allowed
    pipe = conveyor.Pipeline(tied, balance=[1, 3], devices=["cpu", "cpu"], chunks=2,
                             loss_fn=mse, rebalance=POLICY)
    assert pipe.rebalancing is not None
    block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(conveyor.ConfigError, match=r"split_at= \(traced\) cannot be re-balanced"):
        conveyor.Pipeline(block, split_at=["2"], sample=torch.randn(2, 4), chunks=2,
                          devices=["cpu", "cpu"], loss_fn=mse, rebalance=POLICY)


def test_skips_are_refused() -> None:
    @conveyor.skip.skippable(stash=["x"])
    class Keep(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield conveyor.skip.stash("x", x)
            return x

    @conveyor.skip.skippable(pop=["x"])
    class Add(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x + (yield conveyor.skip.pop("x"))

    with pytest.raises(conveyor.ConfigError, match=r"skip connections .* not supported yet"):
        conveyor.Pipeline(nn.Sequential(Keep(), nn.Linear(4, 4), Add(), nn.Linear(4, 4)),
                          balance=[3, 1], devices=["cpu", "cpu"], chunks=2,
                          loss_fn=nn.functional.mse_loss, rebalance=POLICY)


# ---------------------------------------------------------------------- the optimizer


def test_an_optimizer_share_goes_to_the_group_with_the_same_hyper_parameters() -> None:
    torch.manual_seed(0)
    giver, taker = nn.Linear(3, 2), nn.Linear(3, 2)
    first = OPTIMIZERS["adamw"](list(giver.named_parameters()))
    giver(torch.randn(4, 3)).sum().backward()
    first.step()
    shares = release(first, dict(giver.named_parameters()))
    assert [len(g["params"]) for g in first.param_groups] == [0, 0] and not first.state
    second = OPTIMIZERS["adamw"]([("other.weight", nn.Parameter(torch.zeros(1)))])
    adopt(second, dict(taker.named_parameters()), shares)
    assert [len(g["params"]) for g in second.param_groups] == [2, 1]  # weight, bias
    assert second.param_groups[1]["params"][0] is taker.bias
    assert torch.equal(second.state[taker.weight]["exp_avg"], shares["weight"]["state"]["exp_avg"])
    plain = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    adopt(plain, {"weight": taker.weight}, shares)  # no AdamW group here: a new one
    assert len(plain.param_groups) == 2 and plain.param_groups[1]["weight_decay"] == 0.1


# ---------------------------------------------------------------------- torchrun


def test_a_move_under_torchrun_trains_as_the_plain_model(tmp_path: Path) -> None:
    outcome = launch("rebalance_moves", 2, tmp_path, timeout=240)
    assert outcome.returncodes == [0, 0], "\n".join(outcome.outputs)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in ("adamw", "sgd"):
        expected = plain_run(name)
        steps = [rank[name] for rank in ranks]
        balances = [[s["balance"] for s in rank] for rank in steps]
        assert balances[0] == balances[1], name  # every rank took the same decision
        assert balances[0][:3] == [[1, 5]] * 3 and balances[0][3] != [1, 5], name
        for step in range(STEPS):
            found = {**steps[0][step]["params"], **steps[1][step]["params"]}
            assert not set(steps[0][step]["params"]) & set(steps[1][step]["params"])
            assert_same(found, expected[step], f"{name} step {step + 1}")
            # every parameter a rank holds is in its optimizer, once
            assert [s[step]["held"] for s in steps] == [len(s[step]["params"]) for s in steps]
    for output in outcome.outputs:
        assert output.count("INFO rebalanced after step 3: stage times [") == 2, output


def test_train_refuses_rebalance_with_shard() -> None:
    from conveyor.train.options import TrainConfig

    with pytest.raises(conveyor.ConfigError, match=r"--rebalance cannot move layers sharded"):
        TrainConfig(rebalance=True, shard=True).check()
    TrainConfig(rebalance=True).check()
