"""Tensor parallelism inside the stages: a plan split over a stage's tensor group gives
the plain model's gradients (4 processes: 2 stages x 2 tensor ranks, float64), and the
plans conveyor cannot honour are refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conveyor.errors import ConfigError, TensorParallelError
from conveyor.tensor.apply import Group, apply_plan
from conveyor.tensor.plan import resolve_plan
from tests.support.launch import launch
from tests.support.scenarios.tensor import CHUNKS, SCHEDULES, SCHEDULES_ON_3

#: The shared launch's tests wait for it (4 minutes on 2 cores shared by a few jobs; more when they are busier).
LAUNCH = pytest.mark.timeout(1000)
#: A group of 2 that no collective ever uses: plans are checked before anything runs.
GROUP = Group("unused", 2, 0, 1.0)


def _launched(scenario: str, prefix: str, out: Path,
              processes: int = 4) -> list[dict[str, Any]]:
    """Each rank's findings of ``scenario`` (written as ``<prefix><rank>.json``)."""
    outcome = launch(scenario, processes, out, timeout=900)
    assert outcome.returncodes == [0] * processes, "\n".join(outcome.outputs)
    return [json.loads((out / f"{prefix}{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launched("tensor_parallel", "rank", tmp_path_factory.mktemp("tensor"))


@LAUNCH
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_llama_stages_2_tensor_2_give_the_plain_gradients(
        results: list[dict[str, Any]], schedule: str) -> None:
    """Llama's own plan (embedding, attention, MLP, head split), float64 norms."""
    for rank in results:
        worst, count = rank[f"llama-{schedule}"]
        assert count >= 10 and worst <= 1e-10, (worst, count)
        assert rank[f"llama-{schedule}-loss"] <= 1e-12
        assert rank[f"llama-{schedule}-recompute"] == "except_last"
        assert rank[f"llama-{schedule}-full"][1] is True


@LAUNCH
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_what_the_tensor_group_holds_alike_crosses_a_boundary_as_pieces(
        results: list[dict[str, Any]], schedule: str) -> None:
    """Llama's hidden states (and the position embeddings beside them; not its boolean
    mask, which the group does not gather) go 1/2 per tensor rank, activations and
    gradients alike: each rank sends half the bytes it would send whole (the 2 x 6 x 32
    hidden states of a micro-batch: 3072 bytes)."""
    for rank in results:
        crossing = rank[f"llama-{schedule}-crossing"]
        if rank["stage"] == 0:
            assert crossing["alike"]["activation-0-1"], crossing
            sent = crossing["bytes"]["activation-0-1"]
        else:
            assert crossing["alike"]["gradient-1-0"] == [0], crossing
            sent = crossing["bytes"]["gradient-1-0"]
            assert sent == CHUNKS * 3072 // 2, crossing  # the hidden states' gradient
        assert sent < CHUNKS * 3072, crossing


@LAUNCH
def test_a_cut_between_column_and_row_parallel_layers_sends_each_ranks_own_part(
        results: list[dict[str, Any]]) -> None:
    for rank in results:
        worst, count, crossing = rank["sharded-cut"]
        assert count >= 2 and worst <= 1e-10, (worst, count)
        assert all(places == [] for places in crossing["alike"].values()), crossing
        assert crossing["alike"], crossing


@LAUNCH
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_qwen3_with_its_float32_norms_is_within_its_own_floor(
        results: list[dict[str, Any]], schedule: str) -> None:
    """Qwen3 built on meta and read from weights=; its q/k norms' gradients summed over
    the tensor group (without the sum they are 1% off). Its RMSNorms compute in float32,
    so its own gradients are only float32-exact: the floor is how far they are from the
    same model's in float64 norms (measured: about 1e-7)."""
    for rank in results:
        worst, count = rank[f"qwen3-{schedule}"]
        floor = rank["qwen3-floor"]
        assert 1e-9 < floor < 1e-5
        assert count >= 12 and worst <= 10 * floor, (worst, floor)
        assert rank[f"qwen3-{schedule}-full"][1] is True


@LAUNCH
def test_a_vocabulary_parallel_head_splits_over_the_tensor_group(
        results: list[dict[str, Any]]) -> None:
    """The head column-wise over the last stage's tensor ranks, the cross-entropy from
    their parts (tied to the embedding of stage 0, too): the plain model's loss and
    gradients, and eval_step's logits whole."""
    for rank in results:
        for case, (loss, worst, count, logits) in rank["vocabulary"].items():
            assert loss <= 1e-12 and worst <= 1e-10 and count >= 10, (case, loss, worst)
            if rank["stage"] == 1:
                assert logits is not None and logits <= 1e-12, (case, logits)


@LAUNCH
def test_micro_batches_of_their_own_lengths_cross_the_tensor_ranks(
        results: list[dict[str, Any]]) -> None:
    for rank in results:
        loss, worst, count = rank["lengths"]
        assert loss <= 1e-12 and worst <= 1e-10 and count >= 10, (loss, worst)


@LAUNCH
def test_a_users_block_with_a_dict_plan_on_a_sequential(results: list[dict[str, Any]]) -> None:
    for rank in results:
        worst, count = rank["block"]
        assert count >= 8 and worst <= 1e-10, (worst, count)


@LAUNCH
def test_check_compares_a_pipeline_split_over_tensor_ranks_with_the_plain_model(
        results: list[dict[str, Any]]) -> None:
    """``conveyor.check(..., tensor_parallel=2)`` under torchrun: every rank gets rank 0's
    report. A Llama matches; a softmax between a column-parallel layer and its partner
    is the first layer named, with the split as its cause; Qwen3 without its q/k norms'
    gradients summed is named by the gradient its tensor ranks hold differently."""
    for rank in results:
        checks = rank["check"]
        ok, setup, *_ = checks["llama"]
        assert ok and "2 stages x 2 tensor ranks" in setup and "zero-bubble" in setup, setup
        ok, _, kind, layer, cause = checks["softmax"]
        assert not ok and (kind, layer) == ("forward", "1"), checks["softmax"]
        assert "layer 0 (Linear, colwise)" in cause and "splits over the tensor group" in cause
        ok, _, kind, name, cause = checks["qwen3-unsummed"]
        assert not ok and kind == "gradient" and name.endswith("_norm.weight"), name
        assert "replicated_with_grad_allreduce" in cause, cause
    assert len({json.dumps(rank["check"]) for rank in results}) == 1


def test_check_with_tensor_parallel_in_one_process_names_the_torchrun_command() -> None:
    import conveyor

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with pytest.raises(ConfigError, match=r"launch 4 of them \(2 pipeline ranks x 2 tensor "
                                          r"ranks\) under torchrun.*--nproc-per-node 4"):
        conveyor.check(model, torch.randn(4, 4), torch.randn(4, 4), loss_fn=nn.MSELoss(),
                       balance=[1, 1], chunks=2, tensor_parallel=2, tp_plan={"0": "colwise"})
    with pytest.raises(ConfigError, match=r"tp_plan= splits modules over tensor_parallel"):
        conveyor.check(model, torch.randn(4, 4), torch.randn(4, 4), loss_fn=nn.MSELoss(),
                       balance=[1, 1], chunks=2, tp_plan={"0": "colwise"})


@LAUNCH
def test_a_tensor_size_that_does_not_divide_the_heads_is_refused_when_built(
        results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert "config.num_attention_heads=3" in rank["refused"]
        assert "use tensor_parallel in [1, 3]" in rank["refused"]


@pytest.fixture(scope="module")
def schedules(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launched("tensor_schedules", "schedules", tmp_path_factory.mktemp("schedules"))


@LAUNCH
@pytest.mark.long
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_family_under_tensor_parallelism_gives_the_plain_gradients(
        schedules: list[dict[str, Any]], name: str) -> None:
    """Interleaved and the V shapes put two stages on each pipeline rank (4 stages, 2
    ranks, 2 tensor ranks each); GPipe and 1F1B with recomputation's other modes."""
    for rank in schedules:
        worst, count, loss, recompute = rank[name]
        assert count >= 5 and worst <= 1e-10, (worst, count)
        assert loss <= 1e-12
        assert recompute == SCHEDULES[name].get("recompute", recompute)


@pytest.fixture(scope="module")
def schedules_on_3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launched("tensor_schedules", "schedules", tmp_path_factory.mktemp("on3"), 6)


@LAUNCH
@pytest.mark.long
@pytest.mark.parametrize("name", list(SCHEDULES_ON_3))
def test_v_min_on_3_pipeline_ranks_under_tensor_parallelism_gives_the_plain_gradients(
        schedules_on_3: list[dict[str, Any]], name: str) -> None:
    """6 processes: 3 pipeline ranks x 2 tensor ranks, 6 stages of a 6-layer Llama."""
    for rank in schedules_on_3:
        worst, count, loss, _ = rank[name]
        assert count >= 5 and worst <= 1e-10, (worst, count)
        assert loss <= 1e-12


@pytest.mark.timeout(200)
def test_a_frozen_tensor_rank_ends_the_step_with_an_error_naming_the_all_reduce(
        tmp_path: Path) -> None:
    """TP's all-reduces wait on the rank's own thread (no watcher on gloo): a peer that
    never joins still ends the wait at the pipeline's timeout, with the collective
    named, and the run ends (the frozen rank fails once it wakes)."""
    outcome = launch("tensor_frozen", 2, tmp_path, timeout=150)
    assert None not in outcome.returncodes, "\n".join(outcome.outputs)
    assert outcome.returncodes[0] not in (0, None), "\n".join(outcome.outputs)
    found = json.loads((tmp_path / "frozen0.json").read_text())
    assert found["error"] == "PeerFailure", found
    assert "waited 3 s in the tensor group's sum of a row-parallel output" in \
        found["message"]
    assert found["seconds"] < 30


def _quiet() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    return transformers


def test_gpt2_without_a_plan_is_refused_naming_its_conv1d() -> None:
    t = _quiet()
    model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                           n_positions=8, bos_token_id=0, eos_token_id=0))
    with pytest.raises(TensorParallelError, match=r"GPT2LMHeadModel carries no tensor-parallel "
                                                  r"plan.*transformer\.h\.0\.attn\.c_attn.* "
                                                  r"are Conv1D"):
        apply_plan(model, "auto", group=GROUP)
    with pytest.raises(TensorParallelError, match=r"transformer\.h\.0\.mlp\.c_fc is a Conv1D, "
                                                  r"but 'colwise' splits an Linear"):
        apply_plan(model, {"transformer.h.*.mlp.c_fc": "colwise"}, group=GROUP)


#: Mixtral's own plan for its experts up to transformers 5.24 (5.25 dropped it: its
#: experts stay whole on every rank, as any module a plan does not name).
MIXTRAL_EXPERTS = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                   "model.layers.*.mlp.experts.down_proj": "rowwise",
                   "model.layers.*.mlp.experts": "moe_tp_experts"}


def test_mixtral_plan_styles_are_refused_by_name() -> None:
    """Mixtral's expert styles are refused by name: from its own plan where the
    installed transformers gives them, else as given; its own plan without them splits
    the attention and keeps the experts whole."""
    t = _quiet()
    config = t.MixtralConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=8,
                             num_attention_heads=2, num_key_value_heads=2, vocab_size=16,
                             num_local_experts=2)
    refused = r"'packed_colwise' \(a fused gate/up weight.*is not supported"
    try:
        own: dict[str, Any] | None = resolve_plan(t.MixtralForCausalLM(config), "auto")
    except TensorParallelError:  # its own plan names the expert styles (<= 5.24)
        own = None
    plan: Any = "auto" if own is None else {**own, **MIXTRAL_EXPERTS}
    with pytest.raises(TensorParallelError, match=refused):
        apply_plan(t.MixtralForCausalLM(config), plan, group=GROUP)
    if own is not None:  # transformers >= 5.25: attention split, experts whole
        model = t.MixtralForCausalLM(config)
        experts = [p.shape for p in model.model.layers[0].mlp.experts.parameters()]
        styles = apply_plan(model, "auto", group=GROUP)
        assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
        assert not any(".mlp." in name for name in styles)
        assert [p.shape for p in model.model.layers[0].mlp.experts.parameters()] == experts


def test_unknown_styles_and_patterns_are_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    with pytest.raises(TensorParallelError, match=r"tp_plan\['0'\] = 'columnwise' is not a "
                                                  r"style conveyor knows"):
        apply_plan(model, {"0": "columnwise"}, group=GROUP)
    with pytest.raises(TensorParallelError, match=r"'sequence_parallel' \(activations split "
                                                  r"along the sequence\) is not supported"):
        apply_plan(model, {"0": "sequence_parallel"}, group=GROUP)
    with pytest.raises(TensorParallelError, match=r"pattern\(s\) \['\*\.up'\] name no module"):
        apply_plan(model, {"*.up": "colwise"}, group=GROUP)


def test_sizes_the_group_does_not_divide_are_refused_naming_what_would() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4), nn.Embedding(7, 4))
    with pytest.raises(TensorParallelError, match=r"tensor_parallel=4 does not divide 0's "
                                                  r"output features \(out_features=6"
                                                  r".*use tensor_parallel in \[1, 2, 3, 6\]"):
        apply_plan(model, {"0": "colwise"}, group=Group("unused", 4, 0, 1.0))
    with pytest.raises(TensorParallelError, match=r"2's vocabulary \(num_embeddings=7"):
        apply_plan(model, {"2": "embedding_rowwise"}, group=GROUP)


def test_a_split_linear_holds_its_shard_and_a_torch_style_maps_to_its_name() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    whole = [p.detach().clone() for p in model.parameters()]
    styles = apply_plan(model, {"0": ColwiseParallel(), "1": RowwiseParallel()},
                        group=Group("unused", 2, 1, 1.0))
    assert styles == {"0": "colwise", "1": "rowwise"}
    assert torch.equal(model[0].weight, whole[0][3:]) and torch.equal(model[0].bias, whole[1][3:])
    assert torch.equal(model[1].weight, whole[2][:, 3:]) and torch.equal(model[1].bias, whole[3])
    assert model[0].out_features == 3 and model[1].in_features == 3
    with pytest.raises(TensorParallelError, match=r"RowwiseParallel\(\.\.\.\) with "
                                                  r"output_layouts=\(Shard"):
        from torch.distributed.tensor import Shard
        apply_plan(nn.Sequential(nn.Linear(4, 4)),
                   {"0": RowwiseParallel(output_layouts=Shard(1))}, group=GROUP)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(os.environ.get("CONVEYOR_MESH_8") != "1",
                    reason="8 processes: make mesh (CONVEYOR_MESH_8=1) runs it")
def test_pipeline_data_and_tensor_dimensions_on_8_processes(tmp_path: Path) -> None:
    """2 stages x 2 replicas x 2 tensor ranks, each global rank (k·D + d)·T + t, with
    replicated and FSDP-sharded replicas: the plain model's gradients on the whole
    batch; so do Llama and Qwen3 (traced, their own plans, FSDP) under 1F1B and
    zero-bubble (Qwen3 to its own float32 floor)."""
    outcome = launch("tensor_mesh", 8, tmp_path, timeout=1100)
    assert outcome.returncodes == [0] * 8, "\n".join(outcome.outputs)
    for rank in range(8):
        found = json.loads((tmp_path / f"mesh{rank}.json").read_text())
        for sharding in ("replicate", "fsdp"):
            worst, count, place = found[sharding]
            assert count >= 6 and worst <= 1e-10, (sharding, rank, worst)
            assert (place[0] * 2 + place[1]) * 2 + place[2] == rank
        for family in ("llama", "qwen3"):
            for schedule in ("1f1b", "zero-bubble"):
                worst, count, own = found[f"{family}-{schedule}"]
                assert count >= 10 and worst <= max(1e-10, 10 * own), (family, schedule, worst)


def test_options_tensor_parallelism_does_not_take_yet_are_refused_by_name() -> None:
    from conveyor.distributed.topology import Topology
    from conveyor.tensor.mesh import split_model

    topology = Topology(pipeline_size=1, tensor_size=2)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel=2 does not take "
                                                  r"rebalance= yet"):
        split_model(nn.Linear(2, 2), topology, "auto", 1.0, untried={"rebalance=": True})
    with pytest.raises(TensorParallelError, match=r"give the nn.Module"):
        split_model(lambda i: nn.Linear(2, 2), topology, "auto", 1.0)


def test_pieces_put_back_together_equal_what_was_sent_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """conveyor.tensor.boundary in one process, a group of 2 played by two Boundary
    objects whose collectives answer with both ranks' parts: a transposed tensor (sent
    in its memory order, put back in its layout), a length the group does not divide
    (the last piece padded), the requires_grad flag, integer ids; whole: a boolean mask
    (not gathered), a tensor under the threshold, and one the ranks hold apart."""
    import conveyor.tensor
    from conveyor.distributed.faults import collective
    from conveyor.tensor import boundary
    from conveyor.torchprivate import pytree

    monkeypatch.setattr(conveyor.tensor, "SLICED_FROM", 64)
    torch.manual_seed(0)
    alike = torch.randn(7, 5, dtype=torch.float64).t().requires_grad_()  # 35 elements
    shared = {"h": alike, "mask": torch.ones(40, dtype=torch.bool), "small": torch.randn(3),
              "ids": torch.arange(30)}
    values = [{**shared, "own": torch.randn(40)} for _ in range(2)]
    prints = [[boundary._fingerprint(t) for t in pytree.tree_leaves(v)] for v in values]
    sent: list[torch.Tensor] = []

    def all_gather(pieces: list[torch.Tensor], piece: torch.Tensor, **_: Any) -> None:
        for whole, part in zip(pieces, sent):
            whole.copy_(part)

    monkeypatch.setattr(collective, "exchange", lambda value, **_: prints)
    monkeypatch.setattr(collective, "all_gather", all_gather)
    ranks = [boundary.Boundary(None, 2, r, 1.0) for r in range(2)]
    cut = [ranks[r].cut("activation", 0, 1, values[r]) for r in range(2)]
    for name in ("h", "ids"):
        assert isinstance(cut[0][name], boundary.Piece), name
    for name in ("mask", "small", "own"):
        assert cut[0][name] is values[0][name], name
    assert cut[1]["h"].data.numel() == 18 and cut[1]["h"].data.requires_grad  # 17 + padding
    sent[:] = [part["h"].data.detach() for part in cut]
    joined = ranks[0].join({"h": cut[0]["h"], "mask": cut[0]["mask"]})
    assert torch.equal(joined["h"], alike) and joined["h"].stride() == alike.stride()
    assert joined["h"].requires_grad and joined["h"].is_leaf
    assert joined["mask"] is values[0]["mask"]
    sent[:] = [part["ids"].data for part in cut]
    assert torch.equal(ranks[1].join(cut[1]["ids"]), shared["ids"])
