"""The planner: exact parameter counts, meta-device planning, growth with devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.errors import BalanceError
from conveyor.observe.plan import Plan, largest, parse_bytes, plan, rank_plans
from conveyor.train.models import convnet_figures, transformer_figures
from tests.support.models import paired

GIB = 2**30
ROOT = Path(__file__).resolve().parent.parent


def transformer_parameters(layers: int, d: int, h: int, vocab: int, length: int) -> int:
    """Embedding and positions, then per block: 2 norms, qkv, projection, two feed-forward
    layers (each with biases), then the final norm and the output head (with bias)."""
    block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    return vocab * d + length * d + layers * block + 2 * d + (d * vocab + vocab)


@pytest.mark.parametrize(("layers", "d", "h", "heads", "vocab", "length"), [
    (2, 64, 256, 4, 1000, 128), (12, 768, 3072, 12, 50257, 1024), (48, 2048, 8192, 16, 32000, 512),
])
def test_transformer_parameter_counts_follow_the_formula(layers: int, d: int, h: int,
                                                         heads: int, vocab: int,
                                                         length: int) -> None:
    figures = transformer_figures(layers, d, h, heads, vocab=vocab, length=length)
    assert len(figures) == layers + 3
    assert sum(f.parameters for f in figures) == transformer_parameters(layers, d, h, vocab,
                                                                        length)


# Run in a process of its own: ru_maxrss is a peak, which earlier tests may have raised.
_PLAN_A_13B_MODEL = """
import json, resource, time
import torch  # loaded before the first reading: only the planner's growth counts
from conveyor.train.models import transformer_figures
from conveyor.observe.plan import plan
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
figures = transformer_figures(80, 4096, 16384, 32, vocab=50000, length=2048)
result = plan(figures, devices=16, memory=80 * 2**30, batch=64, chunks=32, schedule="1f1b",
              optimizer="adam")
print(json.dumps({"seconds": time.perf_counter() - start,
                  "grown_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "parameters": sum(f.parameters for f in figures), "layers": len(figures),
                  "stages": len(result.stages), "balanced": sum(result.balance)}))
"""


def test_a_model_of_over_ten_billion_parameters_plans_in_seconds_without_memory() -> None:
    done = subprocess.run([sys.executable, "-c", _PLAN_A_13B_MODEL], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ,
                                                                "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["parameters"] > 10e9
    assert figures["seconds"] < 30 and figures["grown_mib"] < 500
    assert figures["stages"] == 16 and figures["balanced"] == figures["layers"]


def test_the_largest_model_grows_near_linearly_with_devices_when_rematerialized() -> None:
    def figures_of(depth: int):  # type: ignore[no-untyped-def]
        return transformer_figures(depth, 1024, 4096, 16, vocab=32000, length=512)

    depths = {k: largest(figures_of, devices=k, memory=8 * GIB, batch=32, chunks=32,
                         optimizer="rmsprop")[0] for k in (1, 2, 4, 8)}
    assert 0 < depths[1] < depths[2] < depths[4] < depths[8]
    assert depths[8] >= 6.5 * depths[1]
    naive = largest(figures_of, devices=1, memory=8 * GIB, batch=32, chunks=1,
                    optimizer="rmsprop", rematerialize=False)[0]
    assert depths[1] >= 2 * naive  # re-materialization alone fits a deeper model


def test_memory_counts_parameters_optimizer_state_and_held_micro_batches() -> None:
    figures = transformer_figures(8, 512, 2048, 8, vocab=1000, length=128)
    common = dict(devices=4, memory=16 * GIB, batch=16, chunks=8, optimizer="rmsprop")
    gpipe = plan(figures, schedule="gpipe", rematerialize=False, **common)  # type: ignore[arg-type]
    one_f_one_b = plan(figures, schedule="1f1b", rematerialize=False, **common)  # type: ignore[arg-type]
    remat = plan(figures, schedule="gpipe", rematerialize=True, **common)  # type: ignore[arg-type]
    assert gpipe.balance == one_f_one_b.balance == remat.balance  # cut by time, not memory
    micro = 16 / 8  # samples per micro-batch
    for k, (g, o, r) in enumerate(paired(gpipe.stages, one_f_one_b.stages, remat.stages)):
        layers = figures[g.layers[0]:g.layers[1] + 1]
        saved = sum(f.activation_bytes for f in layers)
        output = layers[-1].output_bytes
        assert g.parameter_bytes == 12 * g.parameters  # weight, gradient, RMSProp's square
        # Without re-materialization each micro-batch in flight holds everything the
        # stage's layers save, and its output. GPipe holds all 8 at once; 1F1B holds
        # K - k = 4, 3, 2, 1 (the simulator's peak).
        assert g.activation_bytes == pytest.approx(micro * 8 * (saved + output), rel=1e-12)
        assert o.activation_bytes == pytest.approx(g.activation_bytes * (4 - k) / 8, rel=1e-12)
        # With it, each of the 8 holds only the stage's input and output (the last
        # stage its input alone: it recomputes its logits with the loss), plus what one
        # micro-batch saves while it is recomputed: 5 to 7 times less here.
        boundary = layers[0].input_bytes + (output if k < 3 else 0)
        assert r.activation_bytes == pytest.approx(micro * (8 * boundary + saved), rel=1e-12)
        assert 5 * r.activation_bytes < g.activation_bytes


def test_zero_bubble_with_rematerialization_holds_each_graph_from_i_to_w() -> None:
    figures = transformer_figures(8, 512, 2048, 8, vocab=1000, length=128)
    common = dict(devices=4, memory=16 * GIB, batch=16, chunks=8, optimizer="rmsprop",
                  rematerialize=True)
    one_f_one_b = plan(figures, schedule="1f1b", **common)  # type: ignore[arg-type]
    zero_bubble = plan(figures, schedule="zero-bubble", **common)  # type: ignore[arg-type]
    micro = 16 / 8
    for k, (o, z) in enumerate(paired(one_f_one_b.stages, zero_bubble.stages)):
        layers = figures[o.layers[0]:o.layers[1] + 1]
        saved = sum(f.activation_bytes for f in layers)
        boundary = layers[0].input_bytes + (layers[-1].output_bytes if k < 3 else 0)
        # 1F1B rebuilds one micro-batch at a time. Zero-bubble's stage k keeps k + 1
        # rebuilt graphs at once, each from its I until its W (the simulator's peak).
        assert o.activation_bytes == pytest.approx(micro * ((4 - k) * boundary + saved),
                                                   rel=1e-12)
        assert z.activation_bytes == pytest.approx(micro * (4 * boundary + (k + 1) * saved),
                                                   rel=1e-12)
    # Both recompute once per micro-batch: zero-bubble's I (input gradient plus the
    # recomputation) and W together cost 1F1B's B, so it is faster by its smaller bubble.
    assert zero_bubble.step_time < one_f_one_b.step_time


def find(plans: list[Plan], schedule: str, chunks: int) -> Plan:
    return next(p for p in plans if (p.schedule, p.chunks) == (schedule, chunks))


def test_ranking_puts_fitting_plans_first_then_the_fastest() -> None:
    figures = convnet_figures(12, 32, image=64, classes=10)
    plans = rank_plans(figures, devices=2, memory=64 * 2**20, batch=32, optimizer="sgd")
    fitting = [p for p in plans if p.fits]
    assert 0 < len(fitting) < len(plans)
    assert plans[:len(fitting)] == fitting
    for group in (fitting, plans[len(fitting):]):
        throughputs = [p.throughput for p in group]
        assert throughputs == sorted(throughputs, reverse=True)
    assert all(p.throughput == pytest.approx(32 / p.step_time, rel=1e-12) for p in plans)
    # (V-Min needs 3 ranks: refused on 2, so not ranked)
    assert {p.schedule for p in plans} == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble",
                                           "v-half"}
    # More micro-batches shrink the bubble; interleaving shrinks it again.
    order = [plans.index(find(plans, "1f1b", m)) for m in (32, 16, 8, 4, 2, 1)]
    assert order == sorted(order)
    assert find(plans, "interleaved-1f1b", 32).throughput > find(plans, "1f1b", 32).throughput


def test_a_faster_plan_that_does_not_fit_ranks_below_one_that_fits() -> None:
    figures = convnet_figures(12, 32, image=64, classes=10)
    plans = rank_plans(figures, devices=2, memory=15 * 2**20, batch=32, optimizer="sgd")
    # Zero-bubble is faster than 1F1B but keeps the graphs it rebuilt from I to W
    # (18.0 MiB); 1F1B needs 13.8 MiB, and interleaving, the fastest, 14.2 MiB (a rank
    # rebuilds one micro-batch at a time, whichever of its two stages): both fit in 15 MiB.
    interleaved = find(plans, "interleaved-1f1b", 32)
    zero_bubble = find(plans, "zero-bubble", 32)
    one_f_one_b = find(plans, "1f1b", 32)
    assert interleaved.throughput == max(p.throughput for p in plans)
    assert interleaved.throughput > zero_bubble.throughput > one_f_one_b.throughput
    assert interleaved.fits and one_f_one_b.fits and not zero_bubble.fits
    assert plans[0] is interleaved
    assert max(one_f_one_b.rank_bytes) < 15 * 2**20 < max(zero_bubble.rank_bytes)
    assert plans.index(zero_bubble) > max(plans.index(p) for p in plans if p.fits)


def test_bad_input() -> None:
    figures = transformer_figures(2, 64, 256, 4, vocab=100, length=16)
    with pytest.raises(BalanceError, match=r"unknown optimizer 'lamb'"):
        plan(figures, devices=2, memory=GIB, batch=8, chunks=2, optimizer="lamb")
    with pytest.raises(BalanceError, match=r"cannot cut 5 layers into 8 stages"):
        plan(figures, devices=8, memory=GIB, batch=8, chunks=2)
    assert parse_bytes("16GiB") == 16 * GIB and parse_bytes("80 GB") == 80e9
    with pytest.raises(ValueError, match=r"cannot read '16 gigs' as a memory size"):
        parse_bytes("16 gigs")


def test_under_a_tight_cap_the_planner_takes_v_half_or_v_min() -> None:
    """Without recomputation, a cap between what V-Half's ranks and 1F1B's need: only the
    V shapes that hold a share of 1F1B's activations fit (their ranks' peaks as the
    simulation shows them, the two stages of a rank together)."""
    figures = convnet_figures(12, 32, image=64, classes=10)
    schedules = (("1f1b", 1), ("v-half", 2), ("v-min", 2))
    unbounded = rank_plans(figures, devices=4, memory=float("inf"), batch=32,
                           rematerialize=False, schedules=schedules, chunk_options=[16])
    need = {p.schedule: max(p.rank_bytes) for p in unbounded}
    assert need["v-min"] < need["v-half"] < need["1f1b"]
    cap = (need["v-half"] + need["1f1b"]) / 2
    plans = rank_plans(figures, devices=4, memory=cap, batch=32, rematerialize=False,
                       schedules=schedules, chunk_options=[16])
    assert {p.schedule for p in plans if p.fits} == {"v-half", "v-min"}
    assert plans[0].schedule in ("v-half", "v-min") and plans[0].fits


def test_under_a_cap_the_planner_offloads_activations_and_pays_for_the_copies() -> None:
    """Offloaded, a 1F1B rank holds a micro-batch's activations at a time; the planner
    weighs it beside keeping and recomputing them, and an action lasts at least its
    copy over the host link."""
    figures = convnet_figures(12, 32, image=64, classes=10)
    kept = plan(figures, devices=4, memory=float("inf"), batch=32, chunks=16,
                rematerialize=False)
    offloaded = plan(figures, devices=4, memory=float("inf"), batch=32, chunks=16,
                     rematerialize=False, offload=True, host_bandwidth=1e15)
    assert offloaded.offload and offloaded.name == "1f1b + offload"
    assert max(offloaded.rank_bytes) < 0.75 * max(kept.rank_bytes)
    assert offloaded.step_time == kept.step_time  # a fast link: the copies hide
    # At 25 GB/s a convnet's activations take longer to copy than to compute at 1e14
    # FLOP/s: the step waits for the link.
    slow = plan(figures, devices=4, memory=float("inf"), batch=32, chunks=16,
                rematerialize=False, offload=True)
    assert slow.step_time > 10 * kept.step_time
    cap = (max(offloaded.rank_bytes) + max(kept.rank_bytes)) / 2
    plans = rank_plans(figures, devices=4, memory=cap, batch=32, rematerialize=False,
                       offload=True, schedules=(("1f1b", 1),), chunk_options=[16])
    assert [(p.offload, p.fits) for p in plans] == [(True, True), (False, False)]
