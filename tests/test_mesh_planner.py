"""conveyor plan's mesh: PP x TP x DP x sharding, the verdict on pipelining, and the
planner's defects a new user found (flags beside a file, a plan with replicas in one
process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor.cli import main
from conveyor.errors import ConveyorError
from conveyor.planner import (Cluster, LayerCost, Level, ModelProfile, PipelinePlan,
                              StageChoice)
from conveyor.planner.mesh import Shape, agreements, evaluate_shape
from conveyor.planner.meshsearch import search_mesh
from conveyor.planner.verdict import decide

ROOT = Path(__file__).resolve().parent.parent
TWO_NODES = str(ROOT / "examples" / "two_nodes.toml")
SMALL = ["plan", "--model", "transformer", "--layers", "4", "--d-model", "256", "--d-ff",
         "1024", "--heads", "4", "--vocab", "1000", "--length", "64", "--batch", "8",
         "--no-replicas"]


# ------------------------------------------------------------------ the defects

def test_memory_beside_a_topology_file_overrides_it_and_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--topology", TWO_NODES, "--memory", "1GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["memory"] == 1e9  # not the file's 80 GB
    assert result["overrides"] == [f"--memory 1GB (1 GB per device) overrides the memory "
                                   f"of --topology {TWO_NODES}"]
    assert result["best"]["memory_cap"] == 1e9
    assert main([*SMALL, "--topology", TWO_NODES, "--memory", "1GB"]) == 0
    assert "--memory 1GB (1 GB per device) overrides" in capsys.readouterr().out
    # Without the flag: the file's memory, no note.
    assert main([*SMALL, "--topology", TWO_NODES, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["memory"] == 80e9 and result["overrides"] == []


def test_a_shape_flag_beside_a_topology_file_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--topology", TWO_NODES, "--per-node", "4",
                 "--inter-bandwidth", "10Gbps"]) == 2
    err = capsys.readouterr().err
    assert f"--per-node, --inter-bandwidth given beside --topology {TWO_NODES}" in err
    assert "edit the file, or drop --topology" in err


def _replicated_plan(replicas: int) -> PipelinePlan:
    stage = StageChoice((0, 0), tuple(range(replicas)), False, 1.0, 3.0, 0.0, 0.0, 1.0)
    last = StageChoice((1, 1), tuple(range(replicas, 2 * replicas)), False, 1.0, 3.0, 0.0,
                       0.0, 1.0)
    return PipelinePlan("toy", 8, "1f1b", 4, "sgd", (stage, last), 1.0, "", 1e9)


def test_a_plan_with_replicas_in_one_process_names_the_torchrun_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ConveyorError, match=r"the plan \(replicas per stage \[2, 2\]\) runs "
                       r"one process per device.*torchrun --nproc-per-node 4 your_script"):
        conveyor.Pipeline(model, plan=_replicated_plan(2), loss_fn=nn.functional.mse_loss)
    with pytest.raises(ConveyorError, match=r"data_parallel=3 runs one process per device.*"
                       r"launch 6 of them under torchrun"):
        conveyor.Pipeline(model, stages=2, chunks=3, data_parallel=3,
                          loss_fn=nn.functional.mse_loss)
    # A plan without replicas still runs in one process.
    pipe = conveyor.Pipeline(model, plan=_replicated_plan(1), loss_fn=nn.functional.mse_loss,
                             devices=["cpu", "cpu"])
    loss = pipe.step(torch.randn(8, 2), torch.randn(8, 2))
    assert torch.isfinite(torch.as_tensor(loss)).all()


# ------------------------------------------------------------------ the mesh and the verdict

def _profile() -> ModelProfile:
    """Eight equal blocks of 25M parameters: 1 ms forward, 2 ms backward per sample."""
    layers = tuple(LayerCost(f"block{i}", 1e-3, 2e-3, 25_000_000, 1e8, 1e6, 1e5)
                   for i in range(8))
    return ModelProfile("toy", layers, 1e5, "written by hand")


def _two_nodes(network: float) -> Cluster:
    return Cluster((Level("node", 4, 1e11, 1e-6), Level("network", 2, network, 1e-5)),
                   memory=8e9)


def test_the_verdict_turns_at_the_crossover_bandwidth_it_names() -> None:
    profile = _profile()
    slow = decide(profile, _two_nodes(1e9), search_mesh(profile, _two_nodes(1e9), batch=32),
                  batch=32)
    assert slow is not None and slow.pipeline and slow.crossover is not None
    assert slow.speedup is not None and slow.speedup > 2  # gradients crossing 1 GB/s
    assert "do not pipeline when they are above" in slow.reasons[0]
    crossover = slow.crossover
    assert 1e9 < crossover < 1e12
    for factor, pipelined in ((0.8, True), (1.25, False)):
        there = _two_nodes(crossover * factor)
        verdict = decide(profile, there, search_mesh(profile, there, batch=32), batch=32)
        assert verdict is not None and verdict.pipeline is pipelined, (factor, verdict)
    fast = decide(profile, _two_nodes(1e12), search_mesh(profile, _two_nodes(1e12), batch=32),
                  batch=32)
    assert fast is not None and not fast.pipeline
    assert fast.reasons[0].startswith(f"{fast.best.shape.kind} is ")
    assert "pipeline when they are below" in fast.reasons[0]


def test_tp_stays_in_a_node_and_divides_compute_and_parameters() -> None:
    profile, cluster = _profile(), _two_nodes(1e10)
    found = search_mesh(profile, cluster, batch=32, keep=1000)
    assert {c.shape.tp for c in found} <= {1, 2, 4} and any(c.shape.tp == 4 for c in found)
    one = evaluate_shape(profile, cluster, Shape(1, 1, 1), "1f1b", 32, batch=32)
    four = evaluate_shape(profile, cluster, Shape(1, 4, 1), "1f1b", 32, batch=32)
    assert one is not None and four is not None
    # 8 blocks x 32 samples x 3 ms; over TP=4 a quarter, plus per block and micro-batch
    # four all-reduces of 1e5 bytes in a ring of 4 at 1e11 B/s and 1 us.
    assert one.compute_s == pytest.approx(0.768)
    ring = 2 * 3 * (1e-6 + 1e5 / 4 / 1e11)
    assert four.tp_comm_s == pytest.approx(32 * 8 * 4 * ring)
    assert four.compute_s == pytest.approx(0.768 / 4 + four.tp_comm_s)
    assert four.peak_memory_bytes < one.peak_memory_bytes / 3.5


def test_a_boundary_between_nodes_sends_pieces_from_the_size_the_runtime_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PP=2 x TP=4 over two nodes: each tensor rank sends 1/4 of the 1e5-byte activation
    over the network and the receiving node gathers the rest, once it is at least
    conveyor.tensor.SLICED_FROM bytes (1 MiB by default: this one goes whole). The
    gather is the receiving stage's own work (its rank runs it as it takes the
    message): in stage 1's forward for the activation, stage 0's backward for its
    gradient."""
    import conveyor.tensor

    profile, cluster = _profile(), _two_nodes(1e9)
    whole = evaluate_shape(profile, cluster, Shape(2, 4, 1), "1f1b", 32, batch=32)
    monkeypatch.setattr(conveyor.tensor, "SLICED_FROM", 0)
    pieces = evaluate_shape(profile, cluster, Shape(2, 4, 1), "1f1b", 32, batch=32)
    assert whole is not None and pieces is not None
    assert whole.p2p_s == pytest.approx(1e-5 + 1e5 / 1e9)
    assert pieces.p2p_s == pytest.approx(1e-5 + 2.5e4 / 1e9)
    gather = 3 * (1e-6 + 1e5 / 4 / 1e11)  # a ring of 4: 3 steps of a quarter each
    assert pieces.tp_comm_s == pytest.approx(whole.tp_comm_s + 32 * gather)
    assert pieces.compute_s == pytest.approx(whole.compute_s + 32 * gather)
    assert pieces.predicted_step_s < whole.predicted_step_s


def test_the_hosts_seconds_per_action_count_per_forward_and_backward() -> None:
    """A cluster's ``action`` (read from a file as "300us") adds to every micro-batch's
    forward and backward on every stage; a negative one is refused."""
    profile = _profile()
    cluster = Cluster.from_dict({**_two_nodes(1e10).to_dict(), "action": "300us"})
    assert cluster.action_s == pytest.approx(3e-4)
    assert Cluster.from_dict(cluster.to_dict()).action_s == pytest.approx(3e-4)
    plain = evaluate_shape(profile, _two_nodes(1e10), Shape(1, 1, 1), "1f1b", 32, batch=32)
    hosted = evaluate_shape(profile, cluster, Shape(1, 1, 1), "1f1b", 32, batch=32)
    assert plain is not None and hosted is not None
    assert hosted.predicted_step_s == pytest.approx(plain.predicted_step_s + 32 * 2 * 3e-4)
    with pytest.raises(ConveyorError, match="action, step and fsdp_unit at least 0"):
        Cluster.from_dict({**cluster.to_dict(), "action": -1.0})


def test_the_hosts_seconds_per_step_count_once_a_step_on_the_busiest_rank() -> None:
    """A cluster's ``step`` ("2ms" in a file) adds once to every shape's step, pipelined
    or not, and is reported as the candidate's ``runtime_s``; a negative one is refused."""
    profile = _profile()
    cluster = Cluster.from_dict({**_two_nodes(1e10).to_dict(), "step": "2ms"})
    assert cluster.step_s == pytest.approx(2e-3)
    assert Cluster.from_dict(cluster.to_dict()).step_s == pytest.approx(2e-3)
    for shape in (Shape(1, 1, 1), Shape(2, 1, 1), Shape(2, 2, 2, "fsdp")):
        plain = evaluate_shape(profile, _two_nodes(1e10), shape, "1f1b", 4, batch=32)
        stepped = evaluate_shape(profile, cluster, shape, "1f1b", 4, batch=32)
        assert plain is not None and stepped is not None
        assert stepped.predicted_step_s == pytest.approx(plain.predicted_step_s + 2e-3)
        assert plain.runtime_s == pytest.approx(agreements(_two_nodes(1e10), shape))
        assert stepped.runtime_s == pytest.approx(plain.runtime_s + 2e-3)
        assert stepped.idle_s == pytest.approx(plain.idle_s)
    with pytest.raises(ConveyorError, match="action, step and fsdp_unit at least 0"):
        Cluster.from_dict({**cluster.to_dict(), "step": -1.0})


def test_a_steps_agreements_cost_each_groups_latencies_on_every_rank() -> None:
    """The small all-reduces that end every step (the loss from the last stage over the
    pipeline, the replicas' loss total, the agreement over all ranks that the gradients
    are finite, which rides in the loss's where the pipeline is every rank) cost their
    groups' latencies, ring by ring up the levels; one device has none."""
    cluster = _two_nodes(1e10)  # nodes of 4 at 1 us a message, 2 of them at 10 us
    assert agreements(cluster, Shape(1, 1, 1)) == 0.0
    # Two stages in a node: a ring of 2 for the loss, the agreement riding in it.
    assert agreements(cluster, Shape(2, 1, 1)) == pytest.approx(2e-6)
    # PP=2 x DP=2 x TP=2, the stages a node apart: the loss's ring crosses the network
    # (2 x 10 us), the replicas' within a node (2 x 1 us), all 8 ranks' both levels
    # (6 x 1 us, then 2 x 10 us).
    assert agreements(cluster, Shape(2, 2, 2, "fsdp")) == pytest.approx(4.8e-5)
    flat = evaluate_shape(_profile(), cluster, Shape(1, 1, 8, "replicate"), "1f1b", 4, batch=32)
    assert flat is not None and flat.runtime_s == pytest.approx(
        agreements(cluster, Shape(1, 1, 8, "replicate")))


def test_fsdp_shards_optimizer_state_but_gathers_within_the_step() -> None:
    profile, cluster = _profile(), _two_nodes(1e10)
    replicated = evaluate_shape(profile, cluster, Shape(1, 1, 8, "replicate"), "1f1b", 4,
                                batch=32, optimizer="adam")
    sharded = evaluate_shape(profile, cluster, Shape(1, 1, 8, "fsdp"), "1f1b", 4, batch=32,
                             optimizer="adam")
    assert replicated is not None and sharded is not None
    weights = 2e8  # parameters
    activations = replicated.peak_memory_bytes - 16 * weights
    assert sharded.peak_memory_bytes == pytest.approx(weights * (16 / 8 + 8) + activations)
    # One all-gather and one reduce-scatter per layer: an all-reduce's bytes, 8 latencies.
    assert sharded.dp_comm_s > replicated.dp_comm_s
    # gloo's all-gather takes as long as its all-reduce and its reduce-scatter longer:
    # a cluster that says so (in its file) weighs FSDP's collectives by those shares.
    gloo = Cluster.from_dict({**cluster.to_dict(), "all_gather_share": 1.0,
                              "reduce_scatter_share": 1.5})
    assert Cluster.from_dict(gloo.to_dict()) == gloo
    slow = evaluate_shape(profile, gloo, Shape(1, 1, 8, "fsdp"), "1f1b", 4, batch=32,
                          optimizer="adam")
    assert slow is not None and slow.dp_comm_s == pytest.approx(2.5 * sharded.dp_comm_s)
    with pytest.raises(ConveyorError, match="shares must be above 0"):
        Cluster.from_dict({**cluster.to_dict(), "reduce_scatter_share": 0})
    # FSDP's hooks (a file's "fsdp_unit"): each of the 8 blocks' forward and backward of
    # each of the 4 micro-batches a millisecond longer, on the one rank's critical path.
    hooked = Cluster.from_dict({**cluster.to_dict(), "fsdp_unit": "1ms"})
    assert hooked.fsdp_unit_s == pytest.approx(1e-3)
    assert Cluster.from_dict(hooked.to_dict()) == hooked
    longer = evaluate_shape(profile, hooked, Shape(1, 1, 8, "fsdp"), "1f1b", 4, batch=32,
                            optimizer="adam")
    assert longer is not None and longer.predicted_step_s == pytest.approx(
        sharded.predicted_step_s + 4 * 8 * 1e-3)
    same = evaluate_shape(profile, hooked, Shape(1, 1, 8, "replicate"), "1f1b", 4,
                          batch=32, optimizer="adam")  # no FSDP, no hooks
    assert same is not None and same.predicted_step_s == pytest.approx(
        replicated.predicted_step_s)
    with pytest.raises(ConveyorError, match="fsdp_unit at least 0"):
        Cluster.from_dict({**cluster.to_dict(), "fsdp_unit": -1.0})
    # Split backwards run sharded as the others do (the W's gradients reduce-scattered
    # with the B's): the search weighs zero-bubble with FSDP too.
    assert "zero-bubble" in {c.schedule for c in search_mesh(
        profile, cluster, batch=32, keep=1000) if c.shape.sharding == "fsdp" and c.shape.pp > 1}


def test_plan_json_gives_the_verdict_and_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--topology", TWO_NODES, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    verdict, candidates = result["verdict"], result["candidates"]
    assert verdict["pipeline"] == (verdict["best"]["pp"] > 1)
    assert verdict["reasons"] and verdict["kind"] == verdict["best"]["kind"]
    first = candidates[0]
    assert {"pp", "tp", "dp", "sharding", "schedule", "chunks", "predicted_step_s",
            "peak_memory_bytes"} <= set(first)
    assert first["pp"] * first["tp"] * first["dp"] == 16 and first["tp"] <= 8
    steps = [c["predicted_step_s"] for c in candidates]
    assert steps == sorted(steps) and len(steps) > 3
    assert main([*SMALL, "--topology", TWO_NODES]) == 0
    out = capsys.readouterr().out
    assert "verdict: " in out and "the fastest meshes" in out


# ------------------------------------------------------------------ TP's collectives, counted

def test_the_planner_counts_the_all_reduces_a_plan_runs(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 split by its own plan over a group of one: every all-reduce its forward
    and backward run (colwise inputs' gradients, rowwise and embedding outputs, the
    gathered head, the per-head norms' gradients) is one the profile counts, of the
    bytes it counts; a decoder layer runs 2 in forward and 5 + 2 norms in backward."""
    import copy

    import torch.distributed as dist

    from conveyor.distributed.faults import collective
    from conveyor.planner.profiles import _blocks_and_head
    from conveyor.tensor import regions
    from conveyor.tensor.apply import Group, apply_plan, summed_parameters
    from conveyor.tensor.costs import Collectives, collectives

    t = pytest.importorskip("transformers")
    t.utils.logging.set_verbosity_error()
    config = t.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, max_position_embeddings=16)
    torch.manual_seed(0)
    model = t.Qwen3ForCausalLM(config)
    ids = torch.randint(0, 64, (2, 6))
    names = _blocks_and_head(model)
    counted = collectives(copy.deepcopy(model), ids, "auto", names)
    per_layer = counted[1]
    norms = 2 * 8 * 4  # q_norm and k_norm weights, 8 floats each
    assert per_layer == Collectives(2, 2 * 6 * 32 * 4, 7, 5 * 6 * 32 * 4, norms)
    total = sum(counted, Collectives())

    ran: list[tuple[str, int]] = []
    real = collective.all_reduce
    phase = ["forward"]
    monkeypatch.setattr(collective, "all_reduce", lambda tensor, **kw: (
        ran.append((phase[0], tensor.numel() * tensor.element_size())), real(tensor, **kw)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        group = Group(dist.group.WORLD.group_name, 1, 0, 30.0)
        styles = apply_plan(model, "auto", group=group)
        for param in summed_parameters(model, styles):
            regions.grad_sum(param, group.name, group.seconds)
        logits = model(ids).logits
        phase[0] = "backward"
        logits.sum().backward()
    finally:
        dist.destroy_process_group()
    forward = [nbytes for when, nbytes in ran if when == "forward"]
    backward = [nbytes for when, nbytes in ran if when == "backward"]
    assert (len(forward), len(backward)) == (total.forward, total.backward)
    assert sum(forward) == total.forward_bytes * 2  # per sample: 2 samples
    assert sum(backward) == total.backward_bytes * 2 + total.weight_bytes


def test_counted_collectives_replace_megatrons_and_survive_the_profiles_json() -> None:
    """A layer whose plan all-reduces once each way (a block of colwise then rowwise)
    costs half the TP communication of Megatron's two and two, which an uncounted
    profile assumes; the counts are saved with the profile and read back."""
    from dataclasses import replace

    from conveyor.tensor.costs import Collectives

    plain, cluster = _profile(), _two_nodes(1e10)
    once = replace(plain, layers=tuple(replace(layer, tp=Collectives(1, 1e5, 1, 1e5))
                                       for layer in plain.layers))
    assert ModelProfile.from_dict(json.loads(json.dumps(once.to_dict()))) == once
    megatron = evaluate_shape(plain, cluster, Shape(1, 4, 1), "1f1b", 32, batch=32)
    counted = evaluate_shape(once, cluster, Shape(1, 4, 1), "1f1b", 32, batch=32)
    assert megatron is not None and counted is not None
    assert counted.tp_comm_s == pytest.approx(megatron.tp_comm_s / 2)
