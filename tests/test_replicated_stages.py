"""PipeDream's replicated stages over 3 processes (``data_parallel=[2, 1]`` and
``[1, 2]``): equal to the plain model, a replicated stage's state, micro-batches the
caller made, and a plain pipeline's refusal of gradients NaN on one rank; one launch
(tests/support/scenarios/replicated.py) serves every check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.cases import (case_batch, case_model, padded_batch, plain_gradients,
                                 plain_token_loss)
from tests.support.launch import collect, launch
from tests.support.models import relative_error

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replicated")
    outcome = launch("replicated_stages", 3, out, timeout=240)
    assert outcome.returncodes == [0] * 3, "\n".join(outcome.outputs)
    return out


def test_replicated_stages_equal_the_plain_model(replicated: Path) -> None:
    """data_parallel=[2, 1] and [1, 2]: each replica of a stage runs its share of the
    micro-batches and ends with the stage's whole gradient, tied weights included."""
    import conveyor.schedules.replicas
    from tests.support.scenarios.replicated import REPLICATED

    for model_name, schedule, replicas, chunks in REPLICATED:
        label = f"{model_name} {schedule} {list(replicas)}"
        losses, _, results = collect(replicated, f"{model_name}-{schedule}-rank{{rank}}.pt", 3)
        expected_loss, expected = plain_gradients(model_name)
        assert all(abs(loss - expected_loss) <= 1e-12 * abs(expected_loss)
                   for loss in losses), label
        for rank, result in enumerate(results):  # every replica holds the whole gradient
            for name, grad in result["grads"].items():  # type: ignore[attr-defined]
                assert relative_error(grad, expected[name]) <= 1e-10, f"{label} {rank} {name}"
        # the gradients' norm over every stage, a replicated one's counted once (the
        # max-norm under GPipe, the 2-norm else; tied weights once)
        model, _ = case_model(model_name)
        grads = {n: expected[n] for n, _ in model.named_parameters()}
        norm = (max(float(g.abs().max()) for g in grads.values()) if schedule == "gpipe"
                else float(torch.sqrt(sum((g ** 2).sum() for g in grads.values()))))
        assert all(abs(float(r["norm"]) - norm) <= 1e-6 * norm for r in results), label
        held: set[str] = set().union(*(r["grads"] for r in results))  # type: ignore[arg-type]
        assert held == set(expected), label
        # replica j of stage s ran the micro-batches m with m % replicas[s] == j, and
        # the recording has a row per process
        dealt = conveyor.schedules.replicas.StageReplicas(replicas)
        for rank, stage, _, microbatch in results[0]["ran"]:  # type: ignore[attr-defined]
            assert rank == dealt.worker(stage, microbatch), f"{label}: {rank} {stage}"
        assert {e[3] for e in results[0]["ran"]} == set(range(chunks)), label  # type: ignore[attr-defined]
        # a forward alone runs on each stage's first replica: the output on one rank
        last = sum(replicas) - replicas[-1]
        outputs = [r["eval"] for r in results]
        assert [o is None for o in outputs] == [r != last for r in range(3)], label
        model, _ = case_model(model_name)
        with torch.no_grad():
            assert relative_error(outputs[last], model(case_batch(model_name)[0])) <= 1e-12
        if model_name == "lm":
            x, y = padded_batch()
            token_expected = plain_token_loss(model(x), y)
            token_expected.backward()
            for result in results:
                assert abs(float(result["token_loss"]) - token_expected.item()) <= (  # type: ignore[arg-type]
                    1e-10 * token_expected.item()), label
                for name, grad in result["token_grads"].items():  # type: ignore[attr-defined]
                    p = dict(model.named_parameters(remove_duplicate=False))[name]
                    assert relative_error(grad, p.grad) <= 1e-10, f"{label} token {name}"


def test_a_replicated_stage_pools_deferred_batch_norm_and_refuses_other_state(
        replicated: Path) -> None:
    import torch.nn.functional as F

    import conveyor
    from tests.support.scenarios.replicated import batch_norm_mlp

    results = [torch.load(replicated / f"state-rank{r}.pt") for r in range(3)]
    x, y = case_batch("mlp")
    reference = conveyor.Pipeline(batch_norm_mlp(), chunks=4, balance=[2, 1],
                                  loss_fn=F.mse_loss, deferred_batch_norm=True)
    loss = reference.step(x, y)
    for rank, result in enumerate(results):  # both replicas of stage 0, and stage 1
        assert abs(float(result["lossTrue"]) - float(loss)) <= 1e-12, rank
        expected = reference.state_dict()
        for name, value in result["stateTrue"].items():
            if value.is_floating_point():
                assert relative_error(value, expected[name]) <= 1e-10, f"{rank} {name}"
            else:  # the batches tracked
                assert torch.equal(value, expected[name]), f"{rank} {name}"
        for name, grad in result["gradsTrue"].items():
            assert relative_error(grad, dict(reference.named_parameters())[name].grad) <= 1e-10
        # plain batch norm: every rank stops, naming the layer; nothing changed
        assert "lossFalse" not in result, rank
        assert "changed 1.running_mean (BatchNorm1d)" in result["errorFalse"], result
        assert "deferred_batch_norm=True" in result["errorFalse"]
        assert not result["gradsFalse"], rank
        start = batch_norm_mlp().state_dict()
        if rank < 2:
            assert torch.equal(result["stateFalse"]["1.running_mean"], start["1.running_mean"])


def test_gradients_nan_on_one_rank_are_refused_on_every_rank(replicated: Path) -> None:
    """Gradients NaN on rank 0's stage alone, the loss finite (the finite check's flags
    riding in the loss's all-reduce): every rank refuses the step, naming stage 0, with
    .grad as before it; the next step is the plain model's."""
    for rank in range(3):
        nan = torch.load(replicated / f"nan-rank{rank}.pt")
        assert "the gradients of stage 0" in nan["refused"] and "step 1" in nan["refused"], nan
        assert all(nan["kept"]) and nan["worst"] <= 1e-12, nan


def test_given_micro_batches_of_their_own_lengths_run_across_processes(
        replicated: Path) -> None:
    from tests.support.cases import lm_loss
    from tests.support.cases import lengths_batch

    model, _ = case_model("lm")
    pairs = lengths_batch()
    rows = sum(len(x) for x, _ in pairs)
    expected = sum(lm_loss(model(x), y) * len(x) / rows for x, y in pairs)
    expected.backward()
    plain = dict(model.named_parameters(remove_duplicate=False))
    for rank in range(3):
        result = torch.load(replicated / f"given-rank{rank}.pt")
        assert abs(float(result["loss"]) - expected.item()) <= 1e-12 * expected.item()
        for name, grad in result["grads"].items():
            assert relative_error(grad, plain[name].grad) <= 1e-10, f"{rank} {name}"
