"""A training run guards its data: a step that is not finite never reaches the weights
or a checkpoint, a damaged checkpoint is refused naming what changed, and loading one
never runs code from it."""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conveyor.pipeline import Pipeline
from conveyor.train import saving
from conveyor.train.user import model as built_model
from conveyor.train.checkpoints import manifest
from conveyor.train.errors import CheckpointError, SaveError
from tests.support.training import latest_checkpoint, one_error_line, train

# -- a step that is not finite ----------------------------------------------------------

POISON: dict[str, Any] = {"steps": (), "step": 0, "where": "forward"}


class _InfiniteGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf


class Poison(nn.Module):
    """NaN in the activations (or an infinite gradient) on the steps POISON names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if POISON["step"] not in POISON["steps"]:
            return x
        if POISON["where"] == "forward":
            return x * math.nan
        return _InfiniteGradient.apply(x)


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``conveyor train``'s model with a Poison layer after its first block."""
    build = built_model.transformer_lm

    def with_poison(*args: Any, **kwargs: Any) -> nn.Sequential:
        model = build(*args, **kwargs)
        return nn.Sequential(*model[:2], Poison(), *model[2:])

    stepping = Pipeline.step

    def step(self: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        POISON["step"] += 1
        return stepping(self, inputs, targets)

    monkeypatch.setattr(built_model, "transformer_lm", with_poison)
    monkeypatch.setattr(Pipeline, "step", step)
    monkeypatch.setitem(POISON, "step", 0)
    return POISON


def finite_weights(out: Path) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in saving.load_weights(out).values()
               if t.is_floating_point())


FLAGS = ["--steps", "12", "--save-every", "4", "--eval-every", "12", "--sample-bytes", "0"]


def test_a_nan_in_a_stage_stops_the_run_and_keeps_the_last_good_checkpoint(
        tmp_path: Path, poisoned: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    poisoned["steps"] = range(5, 13)  # NaN from step 5 on
    assert train(tmp_path, *FLAGS) == 1
    line = capsys.readouterr().err.strip().splitlines()[0]
    assert re.fullmatch(
        r"conveyor train: error: step 5: the loss of micro-batch 0 is nan \(stage 1\); the "
        r"run stopped before it reached the weights, which are those of step 4 \(the "
        rf"checkpoint of step 4 in {re.escape(str(tmp_path))} holds them\); --on-nonfinite "
        r"skip skips such steps", line), line
    assert latest_checkpoint(tmp_path).name == "step-00000004"
    assert finite_weights(tmp_path)


def test_a_nan_after_the_last_save_saves_the_good_weights_before_stopping(
        tmp_path: Path, poisoned: dict[str, Any]) -> None:
    poisoned["steps"] = (7,)
    assert train(tmp_path, *FLAGS) == 1
    assert latest_checkpoint(tmp_path).name == "step-00000006"  # saved on the way out
    assert finite_weights(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == [
        "step-00000004", "step-00000006"]


def test_skipping_steps_that_are_not_finite_counts_them_and_trains_on(
        tmp_path: Path, poisoned: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    poisoned["steps"] = (5, 9)
    assert train(tmp_path, *FLAGS, "--on-nonfinite", "skip") == 0
    out = capsys.readouterr().out
    assert "step 5 skipped: the loss of micro-batch 0 is nan (stage 1) (1 skipped so far)" in out
    assert "step 9 skipped" in out and "(2 skipped so far)" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [e["step"] for e in summary["history"] if e.get("skipped")] == [5, 9]
    assert summary["skipped_steps"] == 2
    assert latest_checkpoint(tmp_path).name == "step-00000012"
    assert finite_weights(tmp_path)


def test_an_infinite_gradient_with_a_finite_loss_names_the_stages(
        tmp_path: Path, poisoned: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    poisoned.update(steps=(2,), where="backward")
    assert train(tmp_path, *FLAGS, "--stages", "3") == 1
    line = capsys.readouterr().err.strip().splitlines()[0]
    # Upstream of the poison, and the head: a copy of the embedding, its gradient summed.
    assert "step 2: the gradients of stage 0 (" in line and "stage 2 (" in line
    assert "are not finite (the loss of every micro-batch was finite); the run " \
        "stopped before it reached the weights, which are those of step 1" in line, line
    assert finite_weights(tmp_path)


# -- checkpoints: damage, forgery, poison ------------------------------------------------


def tiny_run(tmp_path: Path, steps: int = 3) -> Path:
    assert train(tmp_path, "--steps", str(steps), "--sample-bytes", "0") == 0
    return latest_checkpoint(tmp_path)


def flip_inside(path: Path, tensor: torch.Tensor) -> None:
    """Flips 64 bytes in the middle of ``tensor``'s data where it lies in ``path``."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at >= 0, "the tensor's bytes are not in the file"
    middle = at + len(raw) // 2 - 32
    for i in range(middle, middle + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_tensor_is_refused_naming_the_file_and_tensor(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tiny_run(tmp_path)
    weights = saving.load_weights(tmp_path)
    flip_inside(target / "state.pt", weights["1.feed_forward.0.weight"])
    with pytest.raises(CheckpointError, match=r"is damaged: state.pt changed since it was "
                       r"written .*the tensor model/1.feed_forward.0.weight differs from what was saved"):
        saving.load_weights(tmp_path)
    capsys.readouterr()
    assert train(tmp_path, "--steps", "6", "--resume") == 2
    assert "model/1.feed_forward.0.weight differs" in one_error_line(capsys)


def test_a_changed_manifest_is_refused(tmp_path: Path) -> None:
    target = tiny_run(tmp_path)
    path = target / manifest.MANIFEST
    path.write_text(path.read_text().replace('"step": 3', '"step": 30'))
    with pytest.raises(CheckpointError, match="manifest.json is damaged: its checksum does "
                       "not match its content"):
        saving.load_weights(tmp_path)


class _RunsCode:
    """Unpickling this writes a file: what a forged checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.write_text, (self.marker, "code ran"))


def test_a_checkpoint_forged_to_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    target = tiny_run(tmp_path)
    marker = tmp_path / "ran"
    state = torch.load(target / "state.pt", weights_only=True)
    state["model"]["trap"] = _RunsCode(marker)
    torch.save(state, target / "state.pt")
    found = manifest.read(target)  # the forger fixes the checksums too
    manifest.write(target, step=3, finite=True, meta=found["meta"],
                   tensors=manifest.digests({k: v for k, v in state.items()}))
    with pytest.raises(CheckpointError, match="cannot read the checkpoint"):
        saving.load_weights(tmp_path)
    assert not marker.exists()


def test_a_checkpoint_of_the_first_format_is_refused_without_unpickling(
        tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with open(tmp_path / "checkpoint.pt", "wb") as file:
        pickle.dump({"model": _RunsCode(marker)}, file)
    with pytest.raises(CheckpointError, match="has no manifest.json: it is not a checkpoint of "
                       "this conveyor"):
        saving.load_weights(tmp_path)
    assert not marker.exists()


def test_weights_that_are_not_finite_are_never_saved(tmp_path: Path) -> None:
    tiny_run(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    with pytest.raises(SaveError, match=r"refusing to save the checkpoint of step 4: "
                       r"model/weight not finite; the previous checkpoint is intact"):
        saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": 4})
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_buffer_may_hold_infinities_but_not_nan(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("mask", torch.tensor([0.0, -math.inf]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": 1})
    model.mask[0] = math.nan
    with pytest.raises(SaveError, match="model/mask not finite"):
        saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": 2})


def test_retention_keeps_the_newest_two_and_never_overwrites(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3, 3, 4):  # step 3 saved twice: a new name, never overwritten
        saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": step})
    root = tmp_path / "checkpoint"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000003.1", "step-00000004"]
    assert manifest.latest(root) == "step-00000004"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert sorted(p.name for p in (root / "step-00000004").iterdir()) == [
        "manifest.json", "state.pt"]


def test_retention_keeps_the_newest_finite_checkpoint(tmp_path: Path) -> None:
    # save() writes no state that is not finite; a folder may still hold one that an
    # older conveyor wrote, or one marked so by hand: the newest finite one stays.
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    root = tmp_path / "checkpoint"
    for step in (1, 2, 3):
        saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": step})
    saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": 4})
    for name in ("step-00000003", "step-00000004"):
        found = manifest.read(root / name)
        manifest.write(root / name, step=found["step"], finite=False, meta=found["meta"],
                       tensors=found["tensors"])
    saving.save(tmp_path, model=model, optimizer=optimizer, extra={"step": 5})
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000005"]
    for name in ("step-00000004", "step-00000005"):  # 5 is finite: 3 may go
        found = manifest.read(root / name)
        manifest.write(root / name, step=found["step"], finite=False, meta=found["meta"],
                       tensors=found["tensors"])
    saving._retain(root)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000005"]


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    """A process group of this process alone: saves and loads go through DCP."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dcp_run(tmp_path: Path) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    saving.save(tmp_path / "run", model=model, optimizer=optimizer, extra={"step": 1})
    return model, latest_checkpoint(tmp_path / "run")


def test_under_torchrun_a_flipped_bit_is_refused_naming_file_and_tensor(
        tmp_path: Path, one_rank_group: Any) -> None:
    model, target = dcp_run(tmp_path)
    assert sorted(p.name for p in target.iterdir()) == [
        ".metadata", "__0_0.distcp", "manifest.json", "rank-0.json"]
    flip_inside(target / "__0_0.distcp", model.weight.detach())
    with pytest.raises(CheckpointError, match=r"is damaged: __0_0.distcp changed since it "
                       r"was written .*the tensor model/weight differs from what was saved"):
        saving.load(tmp_path / "run", model=nn.Linear(64, 64))


def test_under_torchrun_a_forged_index_is_refused_and_runs_nothing(
        tmp_path: Path, one_rank_group: Any) -> None:
    _, target = dcp_run(tmp_path)
    marker = tmp_path / "ran"
    index = target / ".metadata"
    index.write_bytes(pickle.dumps(_RunsCode(marker)))
    found = manifest.read(target)
    manifest.write(target, step=1, finite=True, meta=found["meta"], tensors={})
    with pytest.raises(CheckpointError, match=r"the checkpoint's index asks for "
                       r"pathlib.Path.write_text, which a checkpoint's index never holds"):
        saving.load(tmp_path / "run", model=nn.Linear(64, 64))
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="never holds"):
        saving.load_weights(tmp_path / "run")
    assert not marker.exists()


def test_under_torchrun_a_checkpoint_resumes_exactly(tmp_path: Path,
                                                     one_rank_group: Any) -> None:
    model, _ = dcp_run(tmp_path)
    fresh = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(fresh.parameters())
    assert saving.load(tmp_path / "run", model=fresh, optimizer=optimizer) == {"step": 1}
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert float(optimizer.state[fresh.weight]["step"]) == 1.0
