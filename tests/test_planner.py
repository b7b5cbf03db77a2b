"""conveyor.planner: the cluster, the profile, PipeDream's solver and Pipeline(plan=...)."""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import random

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import ConveyorError, ScheduleError
from conveyor.planner import (Cluster, LayerCost, Level, ModelProfile, PipelinePlan, evaluate,
                              profile_model, solve)
from conveyor.planner.machines import parse_bandwidth, parse_seconds
from conveyor.schedules import build
from conveyor.schedules.simulate import CostModel, simulate
from tests.support.any_models import assert_model_grads


def layer(name: str, *, time: float = 1.0, out: float = 10.0, params: int = 100,
          saved: float = 10.0) -> LayerCost:
    return LayerCost(name, time / 3, 2 * time / 3, params, 4.0 * params, saved, out)


def profile_of(*layers: LayerCost) -> ModelProfile:
    return ModelProfile("toy", tuple(layers), 10.0, "written by hand")


def two_devices(bandwidth: float = 1e3, memory: float = 1e9) -> Cluster:
    return Cluster((Level("node", 2, bandwidth, 0.0),), memory=memory)


# ------------------------------------------------------------------ the cluster

def test_a_cluster_reads_sizes_speeds_and_times_as_people_write_them(tmp_path) -> None:
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("100Gbps") == parse_bandwidth("100Gb/s") == 12.5e9
    assert parse_bandwidth("1GiB/s") == 2**30
    assert parse_seconds("5us") == pytest.approx(5e-6)
    assert parse_seconds("1.5ms") == pytest.approx(1.5e-3)
    path = tmp_path / "cluster.toml"
    path.write_text('memory = "80GB"\nflops = 4e14\n'
                    '[[levels]]\nname = "node"\nsize = 8\nbandwidth = "300GB/s"\n'
                    'latency = "5us"\n'
                    '[[levels]]\nname = "network"\nsize = 2\nbandwidth = "200Gbps"\n')
    cluster = Cluster.load(path)
    assert cluster == Cluster.of(nodes=2, per_node=8, memory="80GB", intra="300GB/s",
                                 inter="200Gbps", intra_latency="5us", flops=4e14)
    assert cluster.devices == 16
    assert (cluster.level_of(0, 7), cluster.level_of(7, 8), cluster.level_of(3, 3)) == (0, 1, 0)
    assert cluster.transfer(25e9, 1) == pytest.approx(1.0)
    # A ring all-reduce: each of r devices sends 2(r-1)/r of the bytes.
    assert cluster.all_reduce(300e9, 8, 0) == pytest.approx(2 * 7 * (5e-6 + 300e9 / 8 / 300e9))
    # Across the nodes, as NCCL does: a ring in each node, then one between the nodes
    # whose uplink carries the node's whole share.
    assert cluster.all_reduce(300e9, 16, 1) == pytest.approx(
        2 * 7 * (5e-6 + 300e9 / 8 / 300e9) + 2 * 1 * (300e9 / 2 / 25e9))
    json_path = tmp_path / "cluster.json"
    json_path.write_text(json.dumps(cluster.to_dict()))
    assert Cluster.load(json_path) == cluster


def test_a_cluster_that_cannot_be_read_says_what_is_missing(tmp_path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"levels": [{"size": 8}], "memory": "80GB"}')
    with pytest.raises(ConveyorError, match="lacks 'bandwidth'"):
        Cluster.load(path)
    with pytest.raises(ConveyorError, match="nodes need the bandwidth between them"):
        Cluster.of(nodes=2, per_node=8, memory="1GB", intra="1GB/s")
    with pytest.raises(ValueError, match="as a bandwidth"):
        parse_bandwidth("fast")
    detected = Cluster.detect()
    assert detected.devices >= 1 and "bandwidth" in detected.guessed


# ------------------------------------------------------------------ serial links

def test_messages_on_one_link_wait_for_each_other_when_links_are_serial() -> None:
    table = build("gpipe", 2, 2)
    costs = CostModel((1.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0), (3.0,))
    starts = {}
    for serial in (False, True):
        timeline = simulate(table, CostModel(**{**costs.__dict__, "serial_links": serial})
                            ).timeline
        starts[serial] = {(e.stage, e.kind, e.microbatch): e.start for e in timeline.events}
    # Micro-batch 1's activation leaves stage 0 at 2; the wire is busy with micro-batch 0's
    # until 4 when serial, so it arrives at 7 rather than 5.
    assert starts[False][(1, "F", 1)] == 5.0
    assert starts[True][(1, "F", 1)] == 7.0
    assert CostModel.from_dict(CostModel(**{**costs.__dict__, "serial_links": True}).to_dict()
                               ).serial_links


# ------------------------------------------------------------------ the solver

def widening() -> ModelProfile:
    """Four equal layers; the second hands on 100 times more than the others."""
    return profile_of(layer("a"), layer("b", out=1000.0), layer("c"), layer("d"))


def test_the_solver_cuts_away_from_a_wide_boundary_when_links_are_slow() -> None:
    cluster = two_devices(bandwidth=1e2)  # a wide message: 2 samples x 1000 B: 20 s
    plan = solve(widening(), cluster, batch=8, replicate=False, schedules=("gpipe",),
                 chunk_options=[4])[0]
    assert len(plan.stages) == 2 and plan.balance != [2, 2]
    blind = solve(widening(), cluster, batch=8, replicate=False, schedules=("gpipe",),
                  chunk_options=[4], communication=False)[0]
    assert blind.balance == [2, 2]
    # What the solver predicted for its cut is what evaluate() predicts for it.
    again = evaluate(widening(), cluster, batch=8, balance=plan.balance, schedule="gpipe",
                     chunks=4)
    assert again.step_time == pytest.approx(plan.step_time)
    assert evaluate(widening(), cluster, batch=8, balance=[2, 2], schedule="gpipe",
                    chunks=4).step_time > plan.step_time
    assert "link" in evaluate(widening(), cluster, batch=8, balance=[2, 2], schedule="gpipe",
                              chunks=4).bottleneck


def test_memory_decides_recomputation_stage_by_stage_and_nothing_fits_below_the_weights() -> None:
    heavy = profile_of(layer("a", saved=1e6), layer("b"), layer("c"), layer("d"))
    parameters = 100 * 16  # adam: 16 bytes per parameter
    roomy = solve(heavy, two_devices(memory=1e9), batch=8, schedules=("gpipe",),
                  replicate=False, chunk_options=[4], max_stages=2)
    assert not any(s.recompute for s in roomy[0].stages)
    tight = solve(heavy, two_devices(memory=3 * parameters + 2.1e6), batch=8, replicate=False,
                  schedules=("gpipe",), chunk_options=[4], max_stages=2)
    assert tight, "recomputing the first stage fits"
    plan = tight[0]
    assert [s.recompute for s in plan.stages] == [True, False]
    assert plan.peak_memory <= plan.memory_cap
    assert plan.pipeline_options()["recompute"] == ["always", "never"]
    assert solve(heavy, two_devices(memory=parameters), batch=8) == []


def test_a_heavy_first_layer_gets_replicas_and_a_plan_says_why() -> None:
    # VGG's shape: a compute-heavy start with few parameters, a light end with many.
    vgg_like = profile_of(layer("conv", time=12.0, params=10), layer("fc", params=100_000))
    # The head's 400 kB of gradients take ten minutes to all-reduce among four; the
    # convolutions' 40 bytes, no time.
    cluster = Cluster((Level("node", 4, 1e3, 0.0),), memory=1e9)
    plan = solve(vgg_like, cluster, batch=48, chunk_options=[12], schedules=("1f1b",))[0]
    assert plan.replicas == [3, 1] and plan.balance == [1, 1]
    assert plan.bottleneck.startswith("stage 0 (layers 0-0, 3 replicas)")
    # one pipeline of 3 + 1 processes, stage 0's replicas taking turns at the 12
    options = plan.pipeline_options()
    assert options["data_parallel"] == [3, 1] and options["chunks"] == 12
    uniform = solve(vgg_like, cluster, batch=48, chunk_options=[12], schedules=("1f1b",),
                    uniform_replicas=True)
    assert all(len(set(p.replicas)) == 1 and 12 % p.replicas[0] == 0 for p in uniform)
    # D replicas of the pipeline, each running its share of the micro-batches.
    replicated = next(p for p in uniform if p.replicas[0] > 1)
    options = replicated.pipeline_options()
    assert options["data_parallel"] * options["chunks"] == 12


def test_a_plan_is_saved_and_read_back(tmp_path) -> None:
    plan = solve(widening(), two_devices(), batch=8, chunk_options=[4])[0]
    plan.save(tmp_path / "plan.json")
    assert PipelinePlan.load(tmp_path / "plan.json") == plan
    assert "bottleneck" in plan.describe()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConveyorError, match="cannot read the plan"):
        PipelinePlan.load(tmp_path / "bad.json")


# ------------------------------------------------------------------ profiles

def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3)).double()


def test_a_profile_is_per_sample_and_read_from_its_cache(tmp_path) -> None:
    model, x = mlp(), torch.randn(8, 6, dtype=torch.float64)
    profile = profile_model(model, x, repeat=1, cache=tmp_path)
    assert [c.name for c in profile.layers] == ["0", "1", "2", "3", "4"]
    assert profile.layers[0].output_bytes == 32 * 8  # float64, per sample
    assert profile.layers[0].parameters == 6 * 32 + 32
    assert all(c.forward > 0 and c.backward > 0 for c in profile.layers)
    assert list(tmp_path.glob("*.json")) == [tmp_path / f"{profile.key}.json"]
    assert profile_model(model, x, repeat=1, cache=tmp_path) == profile  # not measured again
    other = profile_model(model, torch.randn(4, 6, dtype=torch.float64), repeat=1,
                          cache=tmp_path)
    assert other.key != profile.key
    with torch.device("meta"):
        on_meta = profile_model(nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 3)),
                                torch.zeros(8, 6))
    assert on_meta.source.startswith("FLOPs") and on_meta.layers[0].backward == \
        pytest.approx(2 * on_meta.layers[0].forward)


# ------------------------------------------------------------------ Pipeline(plan=...)

def test_pipeline_runs_a_plan_exactly_as_the_plain_model() -> None:
    model, x = mlp(), torch.randn(16, 6, dtype=torch.float64)
    y = torch.randn(16, 3, dtype=torch.float64)
    profile = profile_model(model, x[:4], repeat=1)
    cluster = Cluster((Level("threads", 2, 1e9, 0.0),), memory=4 * 32 * 32 * 16 + 3000)
    plans = [p for p in solve(profile, cluster, batch=16, replicate=False)
             if len(p.stages) == 2]
    assert plans
    for plan in plans[:3]:
        reference = copy.deepcopy(model)
        nn.functional.mse_loss(reference(x), y).backward()
        pipe = conveyor.Pipeline(copy.deepcopy(model), loss_fn=nn.functional.mse_loss,
                                 plan=plan, devices=["cpu", "cpu"])
        assert (pipe.chunks, pipe.balance) == (plan.chunks, plan.balance)
        pipe.step(x, y)
        assert_model_grads(pipe, reference)


def test_per_stage_recomputation_is_exact_and_its_length_is_checked() -> None:
    model, x = mlp(), torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    reference = copy.deepcopy(model)
    nn.functional.mse_loss(reference(x), y).backward()
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        pipe = conveyor.Pipeline(copy.deepcopy(model), loss_fn=nn.functional.mse_loss,
                                 chunks=4, balance=[2, 3], schedule=schedule,
                                 recompute=["never", "always"])
        pipe.step(x, y)
        assert_model_grads(pipe, reference)
    with pytest.raises(ValueError, match="gives 3 modes for 2 stages"):
        conveyor.Pipeline(copy.deepcopy(model), loss_fn=nn.functional.mse_loss, chunks=4,
                          balance=[2, 3], recompute=["never", "always", "never"])
    with pytest.raises(ValueError, match="'sometimes' is not a recompute mode"):
        conveyor.Pipeline(copy.deepcopy(model), loss_fn=nn.functional.mse_loss, chunks=4,
                          balance=[2, 3], recompute=["never", "sometimes"])


def test_an_option_the_plan_sets_may_not_be_given_otherwise() -> None:
    plan = solve(profile_model(mlp(), torch.randn(8, 6, dtype=torch.float64), repeat=1),
                 two_devices(), batch=8, replicate=False, max_stages=2)[0]
    with pytest.raises(ConveyorError, match=r"plan= sets chunks=.*but chunks=3 was given"):
        conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, plan=plan, chunks=3)
    with pytest.raises(ConveyorError, match="give chunks="):
        conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, stages=2)
    assert math.isfinite(plan.step_time)


def test_a_tensor_two_layers_save_counts_once() -> None:
    from conveyor.observe.plan import measure

    with torch.device("meta"):
        figures = measure(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                          torch.zeros(4, 8))
    # The first Linear saves its input (8 floats a sample), the ReLU its output (16),
    # which the second Linear saves as its input: held once, counted once.
    assert [f.activation_bytes for f in figures] == [32.0, 64.0, 0.0]


def test_a_plans_memory_is_its_simulated_peak() -> None:
    # Two layers saving 1 MB a sample, recomputed on stage 0: zero-bubble keeps the
    # graphs it rebuilt from an I to its W, two micro-batches' worth at its peak (4 MB),
    # where 1F1B rebuilds one at a time (2 MB).
    heavy = profile_of(layer("a", saved=1e6), layer("b", saved=1e6), layer("c"), layer("d"))

    def schedules(memory: float) -> set[str]:
        return {p.schedule for p in solve(heavy, two_devices(memory=memory), batch=8,
                                          replicate=False, chunk_options=[4], max_stages=2,
                                          keep=20) if len(p.stages) == 2}

    assert schedules(3e6) == {"gpipe", "1f1b"}
    assert schedules(5e6) == {"gpipe", "1f1b", "zero-bubble"}


def test_replicas_are_dealt_micro_batches_in_turn_in_the_simulation() -> None:
    from conveyor.schedules.replicas import simulate_replicas

    table = build("1f1b", 2, 4)
    # Stage 0 twice as slow as stage 1: two replicas of it keep stage 1 busy.
    costs = CostModel((2.0, 1.0), (4.0, 2.0), (0.0, 0.0), (0.0, 0.0), (0.5,),
                      serial_links=True)
    alone = simulate_replicas(table, costs, [1, 1])
    assert list(alone.events) == list(simulate(table, costs).timeline.events)
    dealt = simulate_replicas(table, costs, [2, 1])
    assert dealt.num_ranks == 3
    assert {(e.rank, e.microbatch) for e in dealt.events if e.stage == 0} == \
        {(0, 0), (1, 1), (0, 2), (1, 3)}
    assert dealt.makespan < alone.makespan


@pytest.mark.parametrize("name, mode", [("gpt2", "train"), ("llama", "eval")])
def test_a_plan_of_a_hugging_face_model_runs_exactly(name: str, mode: str) -> None:
    """Profiled by its blocks (timed), cut by name where the plan says, tied head and
    all: the plain model's gradients."""
    from tests.support.any_models import build, loss_of, plain_step, sample_of
    from tests.support.extras import require

    require("transformers")
    model, reference, _, inputs, targets = build(name)
    model.train(mode == "train")
    reference.train(mode == "train")
    profile = profile_model(model, sample_of(inputs), repeat=1)
    assert profile.split_at[-1] == "lm_head"
    plan = next(p for p in solve(profile, two_devices(), batch=10, replicate=False,
                                 chunk_options=[2, 5]) if len(p.stages) == 2)
    plain_step(name, reference, inputs, targets)
    pipe = conveyor.Pipeline(model, plan=plan, loss_fn=loss_of(name), devices=["cpu", "cpu"],
                             sample=sample_of(inputs))
    pipe.step(inputs, targets)
    # Llama's RMSNorm computes in float32 even in a float64 model.
    assert_model_grads(pipe, reference, 1e-6 if name == "llama" else 1e-10)


def test_replicated_stages_need_processes_and_a_table_of_one_stage_per_rank() -> None:
    from conveyor.schedules import build as build_schedule
    from conveyor.schedules.replicas import StageReplicas

    with pytest.raises(ConveyorError, match=r"launch 3 of them under torchrun"):
        conveyor.Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=4,
                          data_parallel=[2, 1], loss_fn=nn.functional.mse_loss)
    dealt = StageReplicas((2, 1))
    table = build_schedule("1f1b", 2, 5)
    columns = dealt.columns(dict(enumerate(table.columns)))
    assert [[str(a) for a in columns[w] if a.kind.value == "F"] for w in range(3)] == [
        ["0F0", "0F2", "0F4"], ["0F1", "0F3"], ["1F0", "1F1", "1F2", "1F3", "1F4"]]
    with pytest.raises(ScheduleError, match="not an interleaved or V schedule"):
        dealt.check(build_schedule("interleaved-1f1b", 2, 4, virtual_stages=2))


def _every_cut(profile: ModelProfile, cluster: Cluster, chunks: int,
               schedule: str) -> list[PipelinePlan]:
    """Every cut into stages and replicas per stage that fits, each as evaluate() costs
    it: what the solver must come close to the best of."""
    layers, plans = len(profile.layers), []
    for stages in range(1, min(layers, cluster.devices) + 1):
        for ends in itertools.combinations(range(1, layers), stages - 1):
            balance = [b - a for a, b in zip((0, *ends), (*ends, layers))]
            for replicas in itertools.product(range(1, cluster.devices + 1), repeat=stages):
                if sum(replicas) <= cluster.devices:
                    with contextlib.suppress(ConveyorError):
                        plans.append(evaluate(profile, cluster, batch=8, balance=balance,
                                              schedule=schedule, chunks=chunks,
                                              replicas=replicas))
    return plans


def test_the_search_finds_the_smallest_bottleneck_where_memory_decides_recomputation() -> None:
    """The dynamic program stops widening a stage once more layers cannot lower its
    load. Under a tight memory cap a stage's load can fall as it grows: ending on a
    smaller output (a pooling layer saving nothing), it fits without recomputing where
    the shorter stage recomputes. Its first version stopped at the first stage whose
    load was no better than the best cut so far, and on the first profile below cut
    after layer 0 (bottleneck 100.8) where cutting after layer 2 gives 81.6: layers 0-1
    recompute (layer 1 saves much), layers 0-2 fit without (layer 2 ends on one value).
    On it and on random profiles of such layers, the search's bottleneck is the
    smallest of every cut and replica count, and a capped search keeps under its cap."""
    from conveyor.planner.solver import _Costs, _Search

    found_first = (profile_of(layer("l0", time=0.6, out=10), layer("l1", time=9, saved=8000,
                                                                     out=10000),
                              layer("l2", time=0.6, saved=0, out=1), layer("l3", time=3, out=1)),
                   Cluster((Level("node", 2, 1e5, 0.0),), memory=1.2e5), 2, True)
    cases = [found_first]
    for seed in range(60):
        rng = random.Random(seed)
        cases.append((profile_of(*(layer(f"l{i}", time=rng.uniform(0.5, 9), params=10,
                                         saved=rng.choice([0, 100, 10000]),
                                         out=rng.choice([1, 100, 10000, 30000]))
                                   for i in range(rng.randint(2, 6)))),
                      Cluster((Level("node", rng.randint(2, 4), 1e5, 0.0),),
                              memory=rng.choice([3e4, 1e5, 3e5])),
                      rng.choice([2, 4]), rng.random() < 0.5))
    misses = []
    for seed, (profile, cluster, chunks, holds_all) in enumerate(cases):
        search = _Search(_Costs.of(profile), cluster, 8, chunks, holds_all, "adam", True,
                         False, True)
        layers = len(profile.layers)
        for stages in range(1, min(layers, cluster.devices) + 1):
            smallest = math.inf
            for ends in itertools.combinations(range(1, layers), stages - 1):
                bounds = list(zip((0, *ends), (*ends, layers)))
                for replicas in itertools.product(range(1, min(cluster.devices, chunks) + 1),
                                                  repeat=stages):
                    if sum(replicas) > cluster.devices:
                        continue
                    starts = [sum(replicas[:k]) for k in range(stages)]
                    cut = [search.stage(i, j, r, d, stages - k) for k, ((i, j), r, d)
                           in enumerate(zip(bounds, replicas, starts))]
                    if None not in cut:
                        smallest = min(smallest, search.bottleneck(cut))
            found = search.best(stages)
            got = search.bottleneck(found) if found is not None else math.inf
            if got != smallest:
                misses.append((seed, stages, got, smallest))
            for slack in (1.15, 1.4):  # a capped search keeps under its cap
                capped = search.capped(smallest * slack).best(stages) \
                    if smallest < math.inf else None
                if smallest < math.inf and (capped is None or
                                            search.bottleneck(capped) > smallest * slack):
                    misses.append((seed, stages, "capped", slack))
    assert not misses, misses


def test_the_solver_comes_close_to_the_best_of_every_cut_and_replicas() -> None:
    """On small random profiles (2-5 layers of random time, parameters and output on 2-4
    devices), the solver's plan against the fastest of every cut and replica count
    (each simulated): within 2% on average, 25% at worst. Its dynamic program minimises
    a bottleneck, then the fill under a little more; zero-bubble at M <= 4 is where it
    misses most (120 seeds: mean 0.4%, worst 18%, 6 more than 1% off)."""
    ratios = []
    for seed in range(24):
        rng = random.Random(seed)
        profile = profile_of(*(layer(f"l{i}", time=rng.uniform(0.6, 9),
                                     params=rng.choice([10, 1000, 100000]),
                                     out=rng.choice([1, 100, 10000]))
                               for i in range(rng.randint(2, 5))))
        cluster = Cluster((Level("node", rng.randint(2, 4), rng.choice([1e3, 1e5, 1e7]),
                                 0.0),), memory=1e9)
        chunks, schedule = rng.choice([2, 4, 8]), rng.choice(["1f1b", "gpipe", "zero-bubble"])
        best = min(p.step_time for p in _every_cut(profile, cluster, chunks, schedule))
        plan = solve(profile, cluster, batch=8, chunk_options=[chunks], schedules=(schedule,))[0]
        ratios.append(plan.step_time / best)
    assert min(ratios) >= 1 - 1e-9  # the solver's plans are among those cuts
    assert sum(ratios) / len(ratios) <= 1.02 and max(ratios) <= 1.25, ratios
