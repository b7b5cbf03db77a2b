"""A model built on the meta device and split with split_at: its stages get storage and
values from a plain model's weights, a user's init_fn, the model's own initialiser or
reset_parameters, the same whatever the split, and a clear error when none applies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.errors import BalanceError, ModelError
from tests.support.any_models import CHUNKS, build, gpt2, loss_of, sample_of
from tests.support.models import relative_error


class Scaled(nn.Module):
    """A module with a parameter of its own and no reset_parameters()."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Net(nn.Module):
    def __init__(self, *, scaled: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.middle = Scaled(8) if scaled else nn.Linear(8, 8)
        self.last = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def meta_net(**options: Any) -> nn.Module:
    with torch.device("meta"):
        return Net(**options).double()


def meta_gpt2() -> nn.Module:
    model, *_ = gpt2()
    with torch.device("meta"):
        return type(model)(model.config).double()


def test_a_meta_model_starts_as_initialize_gives_it_whatever_the_split() -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    states = []
    for split_at in (["middle"], ["middle", "last"]):
        torch.manual_seed(3)
        pipe = conveyor.GPipe(meta_net(), split_at=split_at, sample=x[:2],
                              devices=["cpu"] * (len(split_at) + 1), chunks=2)
        states.append(pipe.state_dict())
    torch.manual_seed(3)
    plain = conveyor.initialize(meta_net())
    for state in states:
        assert state.keys() == plain.state_dict().keys()
        for key, value in plain.state_dict().items():
            assert torch.equal(state[key], value), key
    assert not any(t.is_meta for t in plain.parameters())


def test_a_tied_meta_model_matches_initialize_and_keeps_its_tie() -> None:
    _, _, inputs, _ = gpt2()
    torch.manual_seed(3)
    pipe = conveyor.GPipe(meta_gpt2(), split_at=["transformer.h.2"], sample=sample_of(inputs),
                          devices=["cpu"] * 2, chunks=CHUNKS)
    torch.manual_seed(3)
    plain = conveyor.initialize(meta_gpt2())
    assert plain.lm_head.weight is plain.transformer.wte.weight
    for key, value in plain.state_dict().items():
        assert torch.equal(pipe.state_dict()[key], value), key


def test_initialize_depends_only_on_the_seed_and_the_module_s_name() -> None:
    torch.manual_seed(1)
    torch.randn(100)  # one generator state ...
    first = conveyor.initialize(meta_net(), seed=5).state_dict()
    torch.manual_seed(2)  # ... and another
    second = conveyor.initialize(meta_net(), seed=5).state_dict()
    other = conveyor.initialize(meta_net(), seed=6).state_dict()
    for key, value in first.items():
        assert torch.equal(second[key], value), key
        assert not torch.equal(other[key], value), key  # the seed does count
    # Without seed=: torch's seed (what manual_seed set), whatever was drawn since.
    torch.manual_seed(5)
    torch.randn(7)
    drawn = conveyor.initialize(meta_net()).state_dict()
    for key, value in first.items():
        assert torch.equal(drawn[key], value), key


class Wider(nn.Module):
    """Net's ``first`` and ``last`` under the same names, another ``middle`` and a module
    more: same names, same values, whatever else the model holds."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(3, 3)
        self.first = nn.Linear(6, 8)
        self.middle = nn.Linear(8, 5)
        self.last = nn.Linear(8, 3)


def test_a_module_name_gets_the_same_values_in_models_of_other_shapes() -> None:
    plain = conveyor.initialize(meta_net(), seed=11).state_dict()
    with torch.device("meta"):
        wider = Wider().double()
    values = conveyor.initialize(wider, seed=11).state_dict()
    for key in ("first.weight", "first.bias", "last.weight", "last.bias"):
        assert torch.equal(values[key], plain[key]), key
    assert values["middle.weight"].shape != plain["middle.weight"].shape


def test_a_pipeline_starts_as_initialize_whatever_was_drawn_before() -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.manual_seed(3)
    torch.randn(1000)  # draws before the pipeline do not change its weights
    pipe = conveyor.GPipe(meta_net(), split_at=["last"], sample=x[:2], devices=["cpu"] * 2,
                          chunks=2)
    plain = conveyor.initialize(meta_net(), seed=3).state_dict()
    for key, value in plain.items():
        assert torch.equal(pipe.state_dict()[key], value), key


@pytest.mark.parametrize("form", ["state_dict", "torch.save", "safetensors"])
def test_weights_give_the_plain_model_s_values(form: str, tmp_path: Path) -> None:
    model, reference, _, inputs, targets = build("gpt2")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    weights: Any = state
    if form == "torch.save":
        weights = tmp_path / "gpt2.pt"
        torch.save(state, weights)
    elif form == "safetensors":
        from safetensors.torch import save_file

        weights = tmp_path / "gpt2.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, weights)
    pipe = conveyor.Pipeline(meta_gpt2(), split_at=["transformer.h.2"], stages=2,
                             sample=sample_of(inputs), devices=["cpu"] * 2, chunks=CHUNKS,
                             schedule="1f1b", loss_fn=loss_of("gpt2"), weights=weights)
    for key, value in reference.state_dict().items():
        assert torch.equal(pipe.state_dict()[key], value), key
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        assert relative_error(pipe.eval_step(inputs)["logits"],
                              reference(**inputs)["logits"]) <= 1e-12


def test_init_fn_initialises_each_module() -> None:
    def init_fn(module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            param.fill_(0.5)

    pipe = conveyor.GPipe(meta_net(scaled=True), split_at=["middle"],
                          sample=torch.randn(2, 6, dtype=torch.float64),
                          devices=["cpu"] * 2, chunks=2, init_fn=init_fn)
    assert all(torch.all(p == 0.5) for p in pipe.parameters())


def test_a_meta_model_without_a_way_to_initialise_says_how() -> None:
    sample = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(ModelError, match=r"middle \(Scaled\) was built on the meta device .* "
                                         r"pass init_fn="):
        conveyor.GPipe(meta_net(scaled=True), split_at=["middle"], sample=sample,
                       devices=["cpu"] * 2)
    with pytest.raises(ModelError, match=r"weights= has no tensor 'last.bias'"):
        partial = {k: v for k, v in Net().double().state_dict().items() if k != "last.bias"}
        conveyor.GPipe(meta_net(), split_at=["middle"], sample=sample, devices=["cpu"] * 2,
                       weights=partial)
    with pytest.raises(ModelError, match=r"weights= gives 'first.weight' shape \(8, 5\)"):
        wrong = {**Net().double().state_dict(), "first.weight": torch.zeros(8, 5)}
        conveyor.GPipe(meta_net(), split_at=["middle"], sample=sample, devices=["cpu"] * 2,
                       weights=wrong)
    with pytest.raises(BalanceError, match=r"init_fn= and weights= initialise a model split "
                                           r"with split_at="):
        conveyor.Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), stages=2,
                          devices=["cpu"] * 2, chunks=2, loss_fn=F.mse_loss, weights={})
