"""The V-shape schedules (ZB-V, DualPipeV): their tables, and the bubble and memory
the simulator predicts for them against the published figures."""

from __future__ import annotations

import copy

import pytest

import conveyor
from conveyor.errors import ScheduleError
from conveyor.schedules.simulate import CostModel, simulate
from conveyor.schedules import (
    build,
    dualpipe_v,
    layout_clock,
    render_clock,
    v_stages,
    validate,
    zero_bubble_v,
)
from tests.support.cases import case_batch, case_model
from tests.support.models import assert_same_grads, relative_error

#: (K, M) with M >= 2K, where the published figures hold.
FULL = [(k, m) for k in (1, 2, 3, 4, 5, 8) for m in (2 * k, 2 * k + 1, 3 * k, 4 * k, 24)]


def test_zb_v_table() -> None:
    assert zero_bubble_v(3, 6).to_text() == (
        "0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 5I2 5W2 0F5 0I0 0W0 5F3 5I3 5W3 "
        "0I1 0W1 5F4 5I4 5W4 0I2 0W2 5F5 5I5 5W5 0I3 0W3 0I4 0W4 0I5 0W5\n"
        "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 4I1 4W1 1F4 1I0 1W0 4F3 4I2 4W2 1F5 1I1 1W1 "
        "4F4 4I3 4W3 1I2 1W2 4F5 4I4 4W4 1I3 4I5 1I4 1W3 1I5 1W4 4W5 1W5\n"
        "2F0 3F0 2F1 3F1 2F2 3F2 3I0 3W0 2F3 2I0 2W0 3F3 3I1 3W1 2F4 2I1 2W1 3F4 3I2 3W2 "
        "2F5 2I2 2W2 3F5 3I3 3W3 2I3 3I4 2I4 3I5 2I5 2W3 3W4 3W5 2W4 2W5"
    )


def test_zb_v_clock_is_the_docstring_picture() -> None:
    clock = render_clock(layout_clock(zero_bubble_v(2, 4))).splitlines()
    assert clock[1].startswith("rank 0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 "
                               "3F2 3I2 3W2 0I1 ")
    assert clock[2].startswith("rank 1  .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 "
                               "2W1 1F3 1I1 1W1 ")


def test_dualpipe_v_table() -> None:
    # Rank 0: warm-up forwards, I/W of stage 3, then (F 0, B 3, F 3, B 0) pairs, then
    # backwards split into I and a deferred W.
    assert dualpipe_v(2, 4).to_text() == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3\n"
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"
    )
    assert dualpipe_v(1, 2).to_text() == "0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1"


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v", "v-half", "v-min"])
def test_v_placement_puts_the_first_and_the_last_stage_on_rank_0(name: str) -> None:
    table = build(name, 4, 8)
    assert table.num_stages == 8
    assert table.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [table.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [v_stages(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert table.name == name


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_every_v_table_is_valid(ranks: int) -> None:
    for microbatches in range(1, 4 * ranks + 3):
        validate(build("zb-v", ranks, microbatches))
        if microbatches >= 2 * ranks:
            validate(build("dualpipe-v", ranks, microbatches, virtual_stages=2))


def test_v_shapes_say_what_sizes_they_need() -> None:
    with pytest.raises(ScheduleError, match=r"dualpipe-v needs at least 2 x 4 = 8 "
                                            r"micro-batches for 4 ranks .*got 7: use "
                                            r"chunks=8 or more, or fewer ranks"):
        build("dualpipe-v", 4, 7)
    with pytest.raises(ScheduleError, match=r"'zb-v' runs two stages per rank, in a V; "
                                            r"virtual_stages=3 cannot change that"):
        build("zb-v", 2, 4, virtual_stages=3)
    with pytest.raises(ScheduleError, match=r"ranks must be a positive integer, got 0"):
        zero_bubble_v(0, 4)
    assert build("zb-v", 2, 4, virtual_stages=2) == build("zb-v", 2, 4)


def _idle(name: str, ranks: int, microbatches: int, **costs: float) -> float:
    """Each rank's idle time in a simulated step, in units of one rank's forward of a
    micro-batch (every rank does the same work, so they idle as long)."""
    table = build(name, ranks, microbatches)
    result = simulate(table, CostModel.per_rank(table, **costs))
    work = microbatches * sum(costs.get(k, 1.0) for k in ("forward", "backward", "weight"))
    return result.makespan - work


@pytest.mark.parametrize(("ranks", "microbatches"), FULL)
@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_v_shapes_idle_only_while_the_first_micro_batch_fills_the_v(
        name: str, ranks: int, microbatches: int) -> None:
    """The published bubbles, with T_F = T_I = T_W = T (a rank's layers) and M >= 2K:

    - 1F1B: (K-1)(T_F + T_B) with B = I + W, i.e. 3(K-1)T (Narayanan et al., 2021);
    - ZB-H1: (K-1)(T_F + T_I - T_W) = (K-1)T (Qi et al., "Zero Bubble Pipeline
      Parallelism", ICLR 2024, table of section 6);
    - ZB-V: no bubble when T_F = T_B = T_W (ibid.: ZB-H2's bubble at 1F1B's memory);
    - DualPipeV: (PP/2-1)(F&B + B - 3W) with PP = 2K stages of T/2 and F&B a forward
      overlapped with a backward (github.com/deepseek-ai/DualPipe, README), = (K-1)T/2
      when the overlap hides the forward (F&B = B = T).

    Those are counted over a steady run of steps. A single step, as simulated, also
    idles while the first micro-batch reaches the last rank: (K-1) forwards of a stage,
    T/2 each on a V. That ramp is all the V shapes idle, so their bubble is
    (K-1)/(6M+K-1) of the step: half of ZB-H1's idle time and a sixth of 1F1B's.
    DualPipeV gets there without the overlap (the simulator runs its F&B pairs one
    after the other, as the runtime does): the ramp bounds the step from below.
    """
    k, m = ranks, microbatches
    ramp = (k - 1) * 0.5
    assert _idle(name, k, m) == pytest.approx(ramp, abs=1e-12)
    assert _idle("zero-bubble", k, m) == pytest.approx(2 * ramp, abs=1e-12)
    assert _idle("1f1b", k, m) == pytest.approx(6 * ramp, abs=1e-12)
    table = build(name, k, m)
    result = simulate(table, CostModel.per_rank(table))
    assert result.bubble == pytest.approx((k - 1) / (6 * m + k - 1), rel=1e-12)


def test_zb_v_with_fewer_micro_batches_idles_longer_but_runs() -> None:
    assert _idle("zb-v", 4, 4) > _idle("zb-v", 4, 8) == pytest.approx(1.5)


@pytest.mark.parametrize(("ranks", "microbatches"), FULL)
def test_zb_v_holds_1f1b_s_k_micro_batches(ranks: int, microbatches: int) -> None:
    """Peak activations: ZB-V p·M_B, as 1F1B and ZB-H1 (Qi et al., 2024, section 6),
    M_B being one micro-batch's activations of a rank's layers: a rank holds at most 2K
    stages' activations of one micro-batch, each half that size."""
    k, m = ranks, microbatches
    table = build("zb-v", k, m)
    result = simulate(table, CostModel.per_rank(table, activation_bytes=10.0))
    one_f_one_b = simulate(build("1f1b", k, m), CostModel.uniform(k, activation_bytes=10.0))
    assert result.peak_bytes[0] == one_f_one_b.peak_bytes[0] == 10.0 * k
    assert max(result.peak_bytes) == 10.0 * k


@pytest.mark.parametrize(("ranks", "microbatches"), FULL)
def test_dualpipe_v_holds_pp_plus_1_stages_of_activations(ranks: int,
                                                          microbatches: int) -> None:
    """Peak activations: DualPipeV PP + 1 (DualPipe README), in micro-batches of one
    stage with PP = 2K stages: 2K + 1 halves of a rank's micro-batch, on every rank."""
    k, m = ranks, microbatches
    table = build("dualpipe-v", k, m)
    result = simulate(table, CostModel.per_rank(table, activation_bytes=10.0))
    assert result.peak_bytes == [5.0 * (2 * k + 1)] * k


# ------------------------------------------------ equivalence on threads, one per rank

@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 2), (2, 4), (2, 5), (3, 6), (3, 8)])
@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v", "v-half", "v-min"])
def test_v_shapes_equal_the_plain_model(name: str, ranks: int, microbatches: int,
                                        checkpoint: str) -> None:
    if ranks < {"v-half": 2, "v-min": 3}.get(name, 1):
        pytest.skip(f"{name} cannot hold its share on {ranks} rank(s): tested to refuse")
    model, loss_fn = case_model("mlp")  # 12 layers: up to 6 stages
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=ranks, devices=["cpu"] * ranks,
                             chunks=microbatches, schedule=name, checkpoint=checkpoint,
                             loss_fn=loss_fn)
    assert pipe.schedule.num_stages == 2 * ranks and len(pipe.balance) == 2 * ranks
    x, y = case_batch("mlp", batch=11)  # uneven micro-batches
    loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_a_tied_lm_s_first_and_last_stage_share_rank_0(name: str) -> None:
    # The embedding (stage 0) and the head (stage 2K-1) are one weight, both on rank 0.
    model, loss_fn = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=4, schedule=name,
                             loss_fn=loss_fn)
    assert pipe.schedule.stage_ranks[0] == pipe.schedule.stage_ranks[-1] == 0
    x, y = case_batch("lm")
    pipe.step(x, y)
    loss_fn(reference(x), y).backward()
    plain = dict(reference.named_parameters(remove_duplicate=False))
    for n, p in pipe.named_parameters():
        assert relative_error(p.grad, plain[n].grad) <= 1e-10, n


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
@pytest.mark.parametrize(("model_name", "split_at"), [
    ("unet", ["down2", "up2", "up1"]),  # long skips, stage 0 -> 3 within rank 0
    ("gpt2", ["transformer.h.1", "transformer.h.2", "transformer.h.3"]),  # tied head
])
def test_a_traced_model_split_into_a_v_equals_the_plain_model(
        model_name: str, split_at: list[str], name: str) -> None:
    from tests.support.any_models import CHUNKS, assert_model_grads, build as build_model
    from tests.support.any_models import loss_of, plain_step, sample_of

    model, reference, _, inputs, targets = build_model(model_name)
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=sample_of(inputs), stages=2,
                             devices=["cpu"] * 2, chunks=CHUNKS, schedule=name,
                             loss_fn=loss_of(model_name))
    assert pipe.schedule.stage_ranks == (0, 1, 1, 0)
    loss = pipe.step(inputs, targets)
    expected = plain_step(model_name, reference, inputs, targets)
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item())
    assert_model_grads(pipe, reference)


def test_conveyor_simulate_takes_the_v_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.cli import main

    assert main(["simulate", "--schedule", "zb-v", "--stages", "4", "--chunks", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("zb-v: 4 ranks, 2 stages each, 8 micro-batches; step 25.5 units, "
                          "bubble 5.9% (textbook (K-1)/(6M+K-1) = 5.9%)")
    assert "rank 0    0, 7  24 units" in out and "Each of a rank's 2 stages does 1/2" in out
    assert main(["simulate", "--schedule", "dualpipe-v", "--stages", "4", "--chunks",
                 "6"]) == 2
    assert "dualpipe-v needs at least 2 x 4 = 8 micro-batches" in capsys.readouterr().err


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 8), (3, 9), (4, 8), (4, 16), (6, 12),
                                                    (8, 16)])
@pytest.mark.parametrize(("name", "share"), [("v-half", 1 / 2), ("v-min", 2 / 5)])
def test_v_half_and_v_min_hold_their_share_of_1f1b_s_activations(
        name: str, share: float, ranks: int, microbatches: int) -> None:
    """Peak activations per rank, a stage's counted from its F to its W: V-Half at most
    half of 1F1B's, V-Min at most 2/5 (the paper's V-Min reaches a third through its
    building blocks; this builder stalls there, see conveyor.schedules.vmemory); each
    table valid, and V-Half's step within 1F1B's + 25% once each rank has a few
    micro-batches to run (K >= 4)."""
    if (name, ranks) == ("v-min", 2):
        with pytest.raises(ScheduleError, match=r"v-min holds at most 0.4 of 1F1B's "
                                                r".*needs 3 ranks or more; got 2"):
            build(name, ranks, microbatches)
        return
    table = build(name, ranks, microbatches)
    validate(table)
    assert table.name == name and table.num_stages == 2 * ranks
    result = simulate(table, CostModel.per_rank(table, activation_bytes=10.0))
    one_f_one_b = simulate(build("1f1b", ranks, microbatches),
                           CostModel.uniform(ranks, activation_bytes=10.0))
    assert max(result.peak_bytes) <= share * one_f_one_b.peak_bytes[0] + 1e-9
    if name == "v-half" and ranks >= 4:
        assert result.makespan <= 1.25 * one_f_one_b.makespan
