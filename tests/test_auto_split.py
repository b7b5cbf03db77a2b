"""stages=K without split_at: the cut chosen among the model's repeated blocks, by
parameters (embeddings and head weighed on the first and last stage) or by time, with
gradients equal to the plain model's."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.graph.autosplit import auto_cut, block_parameters, choose_split_at, find_blocks
from conveyor.errors import BalanceError, ModelError
from tests.support.any_models import (
    CHUNKS,
    assert_model_grads,
    build,
    loss_of,
    plain_run,
    sample_of,
    unet,
)
from tests.support.crossing_models import UNet
from tests.support.user_models import LadderUNet


def ladder() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = LadderUNet().double()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, 2, 8, 8, generator=generator, dtype=torch.float64)
    targets = torch.randn(8, 2, 8, 8, generator=generator, dtype=torch.float64)
    return model, copy.deepcopy(model), inputs, targets


def test_the_blocks_are_the_largest_list_of_one_kind() -> None:
    model = ladder()[0]
    assert find_blocks(model).names == [f"blocks.{i}" for i in range(6)]  # not stem's 2
    with pytest.raises(ModelError, match=r"UNet has no repeated blocks \(an nn.ModuleList "
                                         r"or nn.Sequential of modules of one class, two or "
                                         r"more with parameters\).*"
                                         r"give split_at=.*\['down1', 'down2', 'middle', "
                                         r"'up2', 'up1'\]"):
        find_blocks(UNet())  # its Sequentials are (conv, tanh): blocks, not lists of them


def test_the_stem_and_head_weigh_on_the_first_and_last_stage() -> None:
    model, _, inputs, _ = ladder()
    names, costs = block_parameters(model, find_blocks(model).names, inputs[:2])
    size = {name: sum(p.numel() for p in model.get_submodule(name).parameters())
            for name in ("stem", "head", *names)}
    assert costs == [size["stem"] + size["blocks.0"], *(size[f"blocks.{i}"] for i in (1, 2, 3, 4)),
                     size["blocks.5"] + size["head"]]  # [628, 148, 148, 148, 148, 158]
    # [628 | 148 148 148 | 148 158]: counting blocks alone would cut [2, 2, 2].
    assert choose_split_at(model, 3, inputs[:2]) == ["blocks.1", "blocks.4"]


@pytest.mark.parametrize(("name", "stages", "expected"), [
    # wte+wpe (4224) + 4 blocks of 12704 + ln_f and the tied head (3264): [2, 2].
    ("gpt2", 2, ["transformer.h.2"]),
    # embed_tokens (3200) + 4 layers of 9280 + norm and lm_head (3232): [1, 2, 1].
    ("llama", 3, ["model.layers.1", "model.layers.3"]),
])
def test_hugging_face_models_are_cut_between_their_layers(name: str, stages: int,
                                                          expected: list[str]) -> None:
    model, _, _, inputs, _ = build(name)
    assert choose_split_at(model, stages, sample_of(inputs)) == expected


def test_pipeline_chooses_the_cut_and_matches_the_plain_model(
        caplog: pytest.LogCaptureFixture) -> None:
    model, reference, _, inputs, targets = build("gpt2")
    with caplog.at_level(logging.INFO, logger="conveyor"):
        pipe = conveyor.Pipeline(model, stages=2, sample=sample_of(inputs),
                                 devices=["cpu"] * 2, chunks=CHUNKS, schedule="1f1b",
                                 loss_fn=loss_of("gpt2"))
    assert pipe.split_at == ["transformer.h.2"]
    assert ("split_at=['transformer.h.2']: 2 stages among the 4 blocks of 'transformer.h', "
            "by parameters\n"
            "  stage 0: transformer.h.0..transformer.h.1 (2 blocks): 29632 parameters (50.8%)\n"
            "  stage 1: transformer.h.2..transformer.h.3 (2 blocks): 28672 parameters (49.2%)"
            ) in caplog.text
    loss = pipe.step(inputs, targets)
    _, result = plain_run("gpt2", reference, inputs, targets)
    total, count = loss_of("gpt2")(result, targets)
    total.backward()  # as the pipeline: the summed token loss, then divided by the count
    for param in reference.parameters():
        param.grad /= count
    assert abs(loss.item() - (total / count).item()) <= 1e-10 * loss.item()
    assert_model_grads(pipe, reference)


def test_gpipe_chooses_the_cut_from_its_devices() -> None:
    model, reference, inputs, targets = ladder()
    pipe = conveyor.GPipe(model, sample=inputs[:2], devices=["cpu"] * 3, chunks=CHUNKS)
    assert pipe.split_at == ["blocks.1", "blocks.4"]
    F.mse_loss(pipe(inputs), targets).backward()
    F.mse_loss(reference(inputs), targets).backward()
    assert_model_grads(pipe, reference)
    # [628 | 148 148 148 148 158]: the stem weighs more than two blocks.
    assert conveyor.GPipe(ladder()[0], sample=inputs[:2], stages=2).split_at == ["blocks.1"]


def test_interleaving_cuts_ranks_times_virtual_stages() -> None:
    model, reference, inputs, targets = ladder()
    pipe = conveyor.Pipeline(model, stages=2, virtual_stages=2, schedule="interleaved-1f1b",
                             sample=inputs[:2], devices=["cpu"] * 2, chunks=CHUNKS,
                             loss_fn=F.mse_loss)
    assert pipe.split_at == ["blocks.1", "blocks.3", "blocks.5"]  # 4 stages of 6 blocks
    pipe.step(inputs, targets)
    F.mse_loss(reference(inputs), targets).backward()
    assert_model_grads(pipe, reference)


def test_an_nn_sequential_is_cut_by_balance_as_before() -> None:
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 4), nn.Linear(4, 4))
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2,
                             loss_fn=F.mse_loss)
    assert pipe.split_at is None and pipe.balance == [1, 2]


class Waits(nn.Module):
    """A layer that waits ``seconds`` in forward: a slow layer whose slowness does not
    depend on how busy the machine is."""

    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.tanh(self.linear(x))


class Uneven(nn.Module):
    """Eight blocks of equal parameters; the first two wait 5 ms each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Waits(32, 0.005 if i < 2 else 0.0) for i in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_balance_by_time_puts_slow_blocks_on_stages_of_their_own() -> None:
    torch.manual_seed(0)
    model = Uneven()
    # By parameters, all equal: [4 | 4]. By time, the two slow blocks go to two stages:
    # [5 ms | 5 ms + the six fast ones], whatever the fast ones take on a busy machine.
    # One thread: on a loaded machine two intra-op threads wait for each other for tens
    # of milliseconds in every tiny block, drowning the sleeps.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert choose_split_at(model, 2, torch.randn(16, 32), by="time") == ["blocks.1"]
    finally:
        torch.set_num_threads(threads)


class Backwards(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return x


def test_errors_say_what_to_give() -> None:
    model, _, inputs, _ = ladder()
    sample = inputs[:2]
    with pytest.raises(BalanceError, match=r"'blocks' holds 6 blocks, fewer than the 7 "
                                           r"stages asked of LadderUNet; use at most 6 stages, "
                                           r"or give split_at="):
        conveyor.Pipeline(model, stages=7, sample=sample, devices=["cpu"] * 7, chunks=2,
                          loss_fn=F.mse_loss)
    with pytest.raises(BalanceError, match=r"traces it: pass sample=<one micro-batch"):
        conveyor.GPipe(model, devices=["cpu"] * 2)
    with pytest.raises(BalanceError, match=r"give stages= or devices="):
        conveyor.GPipe(model, sample=sample)
    with pytest.raises(TypeError, match=r"pipelines an nn.Sequential, got LadderUNet; .* "
                                        r"give split_at=\[names\], or no balance to cut "
                                        r"among its blocks"):
        conveyor.GPipe(model, [3, 3], sample=sample, devices=["cpu"] * 2)
    with pytest.raises(ModelError, match=r"UNet has no repeated blocks"):
        conveyor.GPipe(unet()[0], sample=sample, devices=["cpu"] * 2)
    with pytest.raises(ModelError, match=r"runs 'blocks.1' after 'blocks.2': its blocks do "
                                         r"not run in their order"):
        choose_split_at(Backwards(), 2, torch.randn(2, 4))
    with torch.device("meta"):
        meta = LadderUNet()
    with pytest.raises(BalanceError, match=r"on the meta device; build it on a device, or "
                                           r"balance by parameters"):
        choose_split_at(meta, 2, torch.randn(2, 2, 8, 8, device="meta"), by="time")
    assert choose_split_at(meta, 2, torch.randn(2, 2, 8, 8, device="meta")) == ["blocks.1"]


class FeedForward(nn.Module):
    """A feed-forward whose layers are a list of mixed modules, as diffusers' (its
    UNet2DConditionModel's ``ff.net``: ``[GEGLU, Dropout, Linear]``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([nn.Linear(width, 4 * width), nn.Dropout(0.0),
                                  nn.Linear(4 * width, width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class Attended(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = FeedForward(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class DiffusersLike(nn.Module):
    """Two blocks of one kind, each with a three-layer feed-forward list inside: the
    largest list by count is a feed-forward's, whose cut into 3 leaves the dropout a
    stage with no parameters."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attended(width) for _ in range(2))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_lists_of_mixed_modules_are_not_blocks(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = DiffusersLike()
    assert find_blocks(model).owner == "blocks"  # not 'blocks.0.ff.net'
    with caplog.at_level(logging.INFO, logger="conveyor"):
        cut = auto_cut(model, 2, torch.randn(2, 8))
    assert cut.split_at == ["blocks.1"]
    # ln (16) + ff (8*32+32 + 32*8+8 = 552) per block, and the head (72) on the last stage.
    assert [(s.blocks, s.parameters) for s in cut.stages] == [
        (["blocks.0"], 568), (["blocks.1"], 640)]
    assert [round(s.share, 3) for s in cut.stages] == [0.47, 0.53]
    assert str(cut) in caplog.text and "stage 1: blocks.1 (1 blocks): 640 parameters (53.0%)" \
        in str(cut)
    with pytest.raises(BalanceError, match=r"'blocks' holds 2 blocks, fewer than the 3 "
                                           r"stages asked of DiffusersLike"):
        auto_cut(model, 3, torch.randn(2, 8))


class Gate(nn.Module):
    def __init__(self, used: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.used = used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if self.used else torch.tanh(x)


class Skipping(nn.Module):
    """Three blocks; the middle one runs but reads none of its parameters: cut into 3,
    that stage would compute with no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Gate(used=i != 1) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_stage_without_parameters_is_refused_unless_split_at_asks() -> None:
    sample = torch.randn(2, 4)
    with pytest.raises(BalanceError, match=r"leaves stage 1 \(blocks.1\) without "
                                           r"parameters:\n.*\n.*\n  stage 1: blocks.1 \(1 "
                                           r"blocks\): 0 parameters \(0.0%\)\n.*\nuse fewer "
                                           r"stages, or give split_at= to cut there anyway"):
        conveyor.GPipe(Skipping(), sample=sample, devices=["cpu"] * 3)
    assert auto_cut(Skipping(), 2, sample).split_at == ["blocks.1"]


def test_blocks_of_one_class_may_include_some_without_parameters() -> None:
    """Found by the generator: a list of one class in which some blocks hold no
    parameters (a block that only scales by a buffer) was refused as not blocks."""

    class Block(nn.Module):
        def __init__(self, weighted: bool) -> None:
            super().__init__()
            self.f = nn.Linear(4, 4) if weighted else nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.f(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(w) for w in (True, False, True, True))

    assert find_blocks(Model()).names == [f"blocks.{i}" for i in range(4)]


def test_a_funnel_model_s_lists_of_layers_are_its_blocks() -> None:
    """Funnel keeps its layers in a list of lists (``encoder.blocks.i.j``): the inner
    lists are never called, so their layers are the blocks (it was told "use at most 0
    stages"); cut by stages=2, its gradients are the plain model's."""
    from tests.support.any_models import quiet_transformers

    t = quiet_transformers()
    config = t.FunnelConfig(vocab_size=50, block_sizes=[1, 1, 1], d_model=16, n_head=2,
                            d_head=8, d_inner=32, hidden_dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0)
    torch.manual_seed(0)
    model = t.FunnelModel(config).double()
    reference = copy.deepcopy(model)
    assert find_blocks(model).names == ["encoder.blocks.0.0", "encoder.blocks.1.0",
                                        "encoder.blocks.2.0"]
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randn(4, 8, 16, dtype=torch.float64)

    def loss_fn(output: object, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(getattr(output, "last_hidden_state"), target)

    pipe = conveyor.Pipeline(model, stages=2, sample=ids[:2], devices=["cpu"] * 2, chunks=2,
                             loss_fn=loss_fn)
    loss = pipe.step(ids, targets)
    expected = loss_fn(reference(ids), targets)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item()
    assert_model_grads(pipe, reference)
