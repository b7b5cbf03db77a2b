"""A model directory as stored (sharded safetensors and their index, pytorch_model.bin
shards) read by ``weights=`` into a model built on the meta device, equal to
``from_pretrained``; each shard opened only for the tensors asked of it; a missing or
mismatched tensor named with the file it was expected in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import ModelError
from conveyor.graph.modeldir import StoredWeights
from tests.support.any_models import CHUNKS, llama, loss_of, sample_of


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama saved by save_pretrained in many safetensors shards."""
    model, *_ = llama()
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 4
    return folder


def meta_llama(folder: Path) -> nn.Module:
    model, *_ = llama()
    with torch.device("meta"):
        return type(model)(model.config)


def pipeline_of(folder: Path, weights: Any) -> conveyor.Pipeline:
    _, _, inputs, _ = llama()
    return conveyor.Pipeline(meta_llama(folder), stages=2, sample=sample_of(inputs),
                             devices=["cpu"] * 2, chunks=CHUNKS, loss_fn=loss_of("llama"),
                             weights=weights)


def assert_equals_from_pretrained(pipe: nn.Module, folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder)
    state = pipe.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key


@pytest.mark.timeout(300)  # one traced Llama, slow on a busy machine
def test_a_sharded_directory_gives_from_pretrained_s_weights_and_saves_them_back(
        sharded: Path, tmp_path: Path) -> None:
    pipe = pipeline_of(sharded, sharded)
    assert_equals_from_pretrained(pipe, sharded)
    # Trained a step, then handed back: from_pretrained reads the trained weights.
    _, _, inputs, targets = llama()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.step(inputs, targets)
    optimizer.step()
    trained = tmp_path / "trained"
    assert pipe.save_pretrained(trained) == trained
    assert sorted(p.name for p in trained.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert_equals_from_pretrained(pipe, trained)
    before = sorted(trained.iterdir())
    with pytest.raises(conveyor.SaveError, match=r"^cannot export into .*trained: the folder "
                                                 r"exists and is not empty \(nothing was "
                                                 r"written\); name a new or empty folder$"):
        pipe.save_pretrained(trained)
    assert sorted(trained.iterdir()) == before
    index = sharded / "model.safetensors.index.json"  # the index file, named itself
    assert_equals_from_pretrained(conveyor.initialize(meta_llama(sharded), weights=index),
                                  sharded)


def test_pytorch_model_bin_shards_are_read_without_running_code(sharded: Path,
                                                               tmp_path: Path) -> None:
    from safetensors.torch import load_file

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, file in index["weight_map"].items():
        shard = file.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
        shards.setdefault(shard, {})[name] = load_file(sharded / file)[name]
    for shard, tensors in shards.items():
        torch.save(tensors, tmp_path / shard)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {n: s for s, ts in shards.items() for n in ts}}))
    (tmp_path / "config.json").write_text((sharded / "config.json").read_text())
    assert_equals_from_pretrained(conveyor.initialize(meta_llama(sharded), weights=tmp_path),
                                  sharded)


def test_a_tensor_is_read_from_its_own_shard_alone(sharded: Path) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    reader = StoredWeights(sharded)
    try:
        value = reader.get("model.layers.3.mlp.up_proj.weight")
        assert value is not None and value.shape == (64, 32)
        assert [p.name for p in reader.opened] == [index["model.layers.3.mlp.up_proj.weight"]]
        assert reader.get("no.such.tensor") is None
        assert len(reader.opened) == 1
    finally:
        reader.close()


def test_a_missing_or_mismatched_tensor_is_named_with_its_file(sharded: Path,
                                                               tmp_path: Path) -> None:
    for file in sharded.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop("model.layers.2.self_attn.q_proj.weight")
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"weights= has no tensor "
                                         r"'model.layers.2.self_attn.q_proj.weight' \(looked "
                                         r"for in .*model.safetensors.index.json \(whose "
                                         r"weight_map has no such name\)\)"):
        conveyor.initialize(meta_llama(sharded), weights=tmp_path)
    index["weight_map"]["model.layers.2.self_attn.q_proj.weight"] = "model-00001-of-00012." \
        "safetensors" if shard != "model-00001-of-00012.safetensors" else "model-00002-of-00012." \
        "safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"model-0000[12]-of-00012.safetensors has no tensor "
                                         r"'model.layers.2.self_attn.q_proj.weight', though "
                                         r"model.safetensors.index.json maps it there"):
        conveyor.initialize(meta_llama(sharded), weights=tmp_path)
    index["weight_map"]["model.layers.2.self_attn.q_proj.weight"] = shard
    index_path.write_text(json.dumps(index))
    (tmp_path / shard).unlink()
    with pytest.raises(ModelError, match=rf"{shard} does not exist, though .*model.safetensors"
                                         r".index.json names it for 'model.layers.\d"):
        conveyor.initialize(meta_llama(sharded), weights=tmp_path)
    model, *_ = llama()
    model.config.intermediate_size = 48  # another model's weights: shapes differ
    with torch.device("meta"):
        narrower = type(model)(model.config)
    with pytest.raises(ModelError, match=r"weights= gives 'model.layers.0.mlp.gate_proj.weight'"
                                         r" shape \(64, 32\) in .*model-000\d\d-of-00012."
                                         r"safetensors, but the model's is \(48, 32\)"):
        conveyor.initialize(narrower, weights=sharded)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match=r"is a folder with none of model.safetensors.index.json"
                                         r", .* \(it holds nothing\)"):
        conveyor.initialize(meta_llama(sharded), weights=empty)
    with pytest.raises(ModelError, match=r"weights='.*nowhere' does not exist"):
        conveyor.initialize(meta_llama(sharded), weights=tmp_path / "nowhere")


def test_a_user_model_is_saved_as_a_state_dict_by_plain_names(tmp_path: Path) -> None:
    """No config: one safetensors file per stage by the plain model's names, and the
    index, which ``weights=`` reads back."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = conveyor.GPipe(model, balance=[2, 2], devices=["cpu"] * 2, chunks=2)
    pipe.save_pretrained(tmp_path / "mine")
    files = sorted(p.name for p in (tmp_path / "mine").iterdir())
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    saved = {**load_file(tmp_path / "mine" / files[0]), **load_file(tmp_path / "mine" / files[1])}
    assert set(load_file(tmp_path / "mine" / files[0])) == {"0.weight", "0.bias"}
    assert saved.keys() == plain.keys()
    assert all(torch.equal(saved[k], v) for k, v in plain.items())
    with torch.device("meta"):
        again = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    conveyor.initialize(again, weights=tmp_path / "mine")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in plain.items())
    (tmp_path / "file").write_text("x")
    with pytest.raises(conveyor.SaveError, match=r"cannot export into .*file: it is a file"):
        pipe.save_pretrained(tmp_path / "file")


@pytest.mark.timeout(600)
def test_under_torchrun_each_rank_reads_its_shards_and_both_save_the_model(
        tmp_path: Path) -> None:
    """Two processes, one stage each, of a Llama whose head is tied to its embedding:
    each rank opens only the shards holding its stage's tensors (the head's value found
    under the embedding's name), equal to from_pretrained; trained a step and saved by
    both, from_pretrained reads the trained weights bit-exact, the tie written once."""
    from transformers import AutoModelForCausalLM

    from tests.support.any_models import tied_llama
    from tests.support.launch import launch

    tied_llama().save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    outcome = launch("model_directories", 2, tmp_path, timeout=540)
    assert outcome.returncodes == [0, 0], "\n".join(outcome.outputs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").state_dict()
    weight_map = index["weight_map"]
    assert "lm_head.weight" not in weight_map and "lm_head.weight" in results[1]["loaded"]
    for result in results:
        stored = {weight_map.get(name, weight_map["model.embed_tokens.weight"])
                  for name in result["loaded"]}
        assert set(result["opened"]) == stored
        assert len(stored) < len(set(weight_map.values()))
        for key, value in result["loaded"].items():
            assert torch.equal(value, reference[key]), key
    saved_index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in saved_index["weight_map"]
    assert set(saved_index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"}
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    trained = {**results[1]["trained"], **results[0]["trained"]}
    assert saved.keys() == trained.keys()
    for key, value in saved.items():
        assert torch.equal(value, trained[key]), key
    assert sum(not torch.equal(value, reference[key]) for key, value in saved.items()) > 20
