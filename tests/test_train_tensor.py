"""``conveyor train --tensor-parallel``: 2 stages x 2 tensor ranks (4 processes, one
torchrun launch running every run of tests/support/tensor_train.py) train a Hugging
Face Llama (tied embedding and head, its own plan) and the bundled Transformer (its
feed-forward plan) with the losses and gradient norms of one process without tensor
parallelism; a stopped run resumes bit for bit; its checkpoint holds whole tensors by
plain names (and its export too) and resumes as 2 stages x 2 replicas. What it cannot do
is refused in one line."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.cli import main
from conveyor.distributed.faults.explain import mesh_place
from conveyor.distributed.topology import Topology
from conveyor.errors import ConfigError
from conveyor.pipeline import Pipeline
from conveyor.tensor.apply import Group, apply_plan
from conveyor.train import saving
from conveyor.train.elastic import describe_replan, plan_layout
from conveyor.train.options import TrainConfig
from tests.support import tensor_train
from tests.support.extras import require
from tests.support.launch import launch
from tests.support.training import TINY, one_error_line
from tests.support.user_data import corpus_folder, llama_folder

#: The shared launch's tests wait for it (five runs in 4 processes on 2 busy cores).
LAUNCH = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The launch's runs, and the same Llama and bundled Transformer in one process."""
    require("transformers")
    root = tmp_path_factory.mktemp("tensor-train")
    model, data = llama_folder(root / "llama"), corpus_folder(root / "corpus")
    out = root / "out"
    out.mkdir()
    outcome = launch("", 4, out, launcher="torchrun", timeout=1100,
                     module="tests.support.tensor_train",
                     args=[str(out), str(model), str(data)])
    assert outcome.returncodes == [0], "\n".join(outcome.outputs)
    clip, tensor_train.norms = Pipeline.clip_grad_norm_, {}
    Pipeline.clip_grad_norm_ = tensor_train._noting(clip)  # type: ignore[method-assign]
    try:
        codes = [tensor_train.train("one", root / "one", "--model", str(model), "--data",
                                    str(data), *tensor_train.USER, "--steps", "6"),
                 tensor_train.train("bundled-one", root / "bundled-one", *TINY, "--steps", "3")]
    finally:
        Pipeline.clip_grad_norm_ = clip  # type: ignore[method-assign]
    assert codes == [0, 0]
    ranks = [json.loads((out / f"norms-rank{r}.json").read_text()) for r in range(4)]
    return {"out": out, "root": root, "said": outcome.outputs[0], "ranks": ranks,
            "one": dict(tensor_train.norms)}


def _losses(out: Path) -> list[float]:
    return [e["loss"] for e in json.loads((out / "summary.json").read_text())["history"]]


@pytest.mark.long  # one 4-process launch of five runs (~4 min): make test-all
@LAUNCH
def test_each_run_ends_as_it_should(runs: dict[str, Any]) -> None:
    # whole, split (stopped by SIGINT), resumed, reshaped, bundled
    assert [r["codes"] for r in runs["ranks"]] == [[0, 130, 0, 0, 0]] * 4
    assert "2 stages x 2 tensor ranks" in runs["said"]


@pytest.mark.long  # one 4-process launch of five runs (~4 min): make test-all
@LAUNCH
@pytest.mark.parametrize(("run", "one"), [("whole", "one"), ("bundled", "bundled-one")])
def test_two_stages_by_two_tensor_ranks_match_one_process(runs: dict[str, Any], run: str,
                                                          one: str) -> None:
    """The same losses, and the same gradient norm on every rank (a shard's part counted
    over the tensor group, a weight kept whole once): clipping scales alike."""
    assert _losses(runs["out"] / run) == pytest.approx(_losses(runs["root"] / one), rel=1e-5)
    for rank in runs["ranks"]:
        assert rank["norms"][run] == pytest.approx(runs["one"][one], rel=1e-5)
    assert max(runs["one"][one]) > 1.0  # the clipping at 1.0 did scale


@pytest.mark.long  # one 4-process launch of five runs (~4 min): make test-all
@LAUNCH
def test_a_stopped_run_resumes_bit_for_bit_at_the_same_shape(runs: dict[str, Any]) -> None:
    out = runs["out"]
    whole, split = saving.load_weights(out / "whole"), saving.load_weights(out / "split")
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[name], split[name]) for name in whole)
    assert _losses(out / "whole") == _losses(out / "split")
    assert len(runs["ranks"][0]["norms"]["resumed"]) == 2  # steps 5 and 6 only


@pytest.mark.long  # one 4-process launch of five runs (~4 min): make test-all
@LAUNCH
def test_the_checkpoint_holds_whole_tensors_by_plain_names(runs: dict[str, Any]) -> None:
    trained = saving.load_weights(runs["out"] / "whole")
    one = saving.load_weights(runs["root"] / "one")
    assert {n: t.shape for n, t in trained.items()} == {n: t.shape for n, t in one.items()}
    assert trained["model.layers.0.mlp.up_proj.weight"].shape == (64, 32)  # split in two
    for name, value in trained.items():
        assert torch.allclose(value, one[name], atol=1e-4), name
    bundled = saving.load_weights(runs["out"] / "bundled")
    assert bundled["1.feed_forward.0.weight"].shape == (32, 16)


@pytest.mark.long  # one 4-process launch of five runs (~4 min): make test-all
@LAUNCH
def test_the_export_holds_whole_tensors_from_pretrained_reads(runs: dict[str, Any]) -> None:
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(runs["out"] / "exported")
    state = loaded.state_dict()
    trained = saving.load_weights(runs["out"] / "whole")
    assert set(trained) <= set(state)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name


@pytest.mark.long  # one 4-process launch of five runs (~4 min): make test-all
@LAUNCH
def test_a_checkpoint_resumes_without_tensor_parallelism(runs: dict[str, Any]) -> None:
    """Stopped at step 4 as 2 stages x 2 tensor ranks, resumed as 2 stages x 2 replicas:
    each rank reads the whole tensors, and steps 5 and 6 are those of the whole run."""
    assert "2 tensor ranks -> 1" in runs["said"]
    assert _losses(runs["out"] / "reshaped") == pytest.approx(_losses(runs["out"] / "whole"),
                                                              rel=1e-5)


@pytest.mark.long  # one 4-process launch of five runs (~4 min): make test-all
@LAUNCH
def test_a_resume_at_another_shape_reads_the_saved_state_bit_for_bit(
        runs: dict[str, Any]) -> None:
    """Saved by 2 stages x 2 tensor ranks, read by 2 stages x 2 replicas: each rank's
    pipeline holds its stage's weights whole, and its optimizer their AdamW moments and
    step, equal to the checkpoint's (read whole in one process) to the bit."""
    saved = torch.load(runs["out"] / "step4.pt")
    seen: dict[str, set[str]] = {"model": set(), "optimizer": set()}
    for rank in range(4):
        loaded = torch.load(runs["out"] / f"loaded-rank{rank}.pt")
        assert loaded["model"], rank
        for name, tensor in loaded["model"].items():
            assert torch.equal(tensor, saved["model"][name]), (rank, name)
            seen["model"].add(name)
        for name, state in loaded["optimizer"].items():
            assert state.keys() == saved["optimizer"][name].keys(), (rank, name)
            assert {"exp_avg", "exp_avg_sq"} <= state.keys(), (rank, name)
            for key, value in state.items():
                assert torch.equal(value, saved["optimizer"][name][key]), (rank, name, key)
            seen["optimizer"].add(name)
    assert seen["model"] == set(saved["model"])  # every weight, on some rank
    assert seen["optimizer"] == set(saved["optimizer"])  # and every moment
    split = saved["model"]["model.layers.0.mlp.up_proj.weight"]
    assert saved["optimizer"]["model.layers.0.mlp.up_proj.weight"]["exp_avg"].shape == \
        split.shape  # a split weight's moments, whole too


# -- without processes ----------------------------------------------------------------


@pytest.mark.parametrize(("flags", "said"), [
    (["--tensor-parallel", "2"], "--tensor-parallel 2 needs processes: launch 4 with torchrun"),
    (["--tensor-parallel", "2", "--data-parallel", "2"],
     "--data-parallel 2 --tensor-parallel 2 needs processes: launch 8 with torchrun"),
    (["--tensor-parallel", "2", "--shard"], "--shard beside --tensor-parallel 2 is not in "
                                            "conveyor train yet"),
    (["--tensor-parallel", "2", "--rebalance"], "--rebalance cannot move tensor-parallel"),
    (["--tensor-parallel", "3"], "--hidden 32 is not divisible by 3"),
    (["--tensor-parallel", "0"], "--tensor-parallel must be at least 1, got 0"),
])
def test_what_cannot_run_is_refused_in_one_line(tmp_path: Path, flags: list[str], said: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "run"), *flags]) == 2
    assert said in one_error_line(capsys)
    out = tmp_path / "run"
    assert not out.exists() or not any(out.iterdir())


def test_the_layout_counts_the_tensor_ranks() -> None:
    def planned(world: int, given: set[str], **values: Any) -> tuple[int, int, int]:
        layout = plan_layout({**asdict(TrainConfig()), **values}, given=given, world=world)
        return layout["stages"], layout["data_parallel"], layout["tensor_parallel"]

    assert planned(8, {"tensor_parallel"}, tensor_parallel=2) == (4, 1, 2)
    assert planned(8, set(), tensor_parallel=2, data_parallel=2) == (2, 2, 2)
    assert planned(3, set(), tensor_parallel=2) == (3, 1, 1)  # a resumed run's gives way
    with pytest.raises(ConfigError, match=r"--tensor-parallel 3 does not divide the 4 "
                                          r"processes torchrun started"):
        planned(4, {"tensor_parallel"}, tensor_parallel=3)
    with pytest.raises(ConfigError, match=r"--stages 3 x --data-parallel 1 x "
                                          r"--tensor-parallel 2 needs 6 processes"):
        planned(4, {"stages", "tensor_parallel"}, stages=3, tensor_parallel=2)
    saved = {"config": asdict(TrainConfig(stages=2, tensor_parallel=2)), "world": 4}
    assert describe_replan(saved, TrainConfig(stages=2, data_parallel=2), balance=[3, 4]) == (
        "world 4 -> 1: 2 stages -> 2, 1 replica -> 2, 2 tensor ranks -> 1")  # (no group here)


def test_a_tied_embedding_and_head_keep_one_shard() -> None:
    """Llama's plan splits the embedding's vocabulary and the head's outputs: the same
    rows of the one tied weight, so both modules hold one shard."""
    t = require("transformers")
    config = t.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True)
    model = t.LlamaForCausalLM(config)
    whole = model.lm_head.weight.detach().clone()
    apply_plan(model, "auto", group=Group("unused", 2, 1, 1.0))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, whole[150:])


def test_a_hang_report_names_the_pipeline_in_the_mesh() -> None:
    topology = Topology(pipeline_size=2, data_size=2, data_rank=1, tensor_size=2,
                        tensor_rank=0, pipeline_ranks=(2, 6))
    assert mesh_place(topology) == "; data replica 1, tensor rank 0: global ranks 2, 6"
    assert mesh_place(Topology(pipeline_size=2, pipeline_ranks=(0, 1))) == ""
