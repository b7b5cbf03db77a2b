"""Dropout draws depend only on the seed, the layer and the micro-batch."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.recompute.rng import draw_step_seed
from tests.support.models import (
    assert_same_grads,
    build,
    even_balance,
    paired,
    sample,
    seeded_per_layer,
    weighted_loss,
)


def seeded_reference(model: nn.Sequential, x: torch.Tensor, chunks: int, seed: int) -> torch.Tensor:
    """The plain model, run micro-batch by micro-batch with the pipeline's seeds."""
    torch.manual_seed(seed)
    return seeded_per_layer(model, x, chunks, draw_step_seed())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_dropout_gradients_equal_seeded_plain_model(name: str, stages: int, checkpoint: str) -> None:
    model, reference = build(name, dropout=0.3)
    pipe = conveyor.GPipe(model, even_balance(model, stages), devices=["cpu"] * stages,
                          chunks=4, checkpoint=checkpoint)
    x = sample(name, batch=10)
    torch.manual_seed(7)
    output = pipe(x)
    weighted_loss(output).backward()
    expected = seeded_reference(reference, x, chunks=4, seed=7)
    weighted_loss(expected).backward()

    assert torch.allclose(output, expected, rtol=1e-12, atol=0)
    assert_same_grads(pipe.named_parameters(), reference.named_parameters(), rtol=1e-12)


def test_dropout_is_active_and_differs_between_micro_batches_and_steps() -> None:
    model = nn.Sequential(nn.Identity(), nn.Dropout(0.5), nn.Identity())
    pipe = conveyor.GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2)
    x = torch.ones(4, 64)
    torch.manual_seed(0)
    first = pipe(x)
    second = pipe(x)
    assert 0 < int((first == 0).sum()) < first.numel()  # some dropped, some kept
    assert not torch.equal(first[:2], first[2:])  # micro-batches draw different masks
    assert not torch.equal(first, second)  # steps draw different masks
    torch.manual_seed(0)
    assert torch.equal(pipe(x), first)  # the seed reproduces the step


def test_repeated_runs_are_identical() -> None:
    results = []
    for _ in range(3):
        model, _ = build("transformer", dropout=0.2)
        pipe = conveyor.GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=3)
        torch.manual_seed(3)
        weighted_loss(pipe(sample("transformer"))).backward()
        results.append([p.grad.clone() for p in pipe.parameters()])
    for later in results[1:]:
        assert all(torch.equal(a, b) for a, b in paired(results[0], later))


def test_pipeline_leaves_the_global_generator_as_one_draw_moves_it() -> None:
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 4))
    for devices in (["cpu"], ["cpu", "cpu"]):
        pipe = conveyor.GPipe(nn.Sequential(*model), even_balance(model, len(devices)),
                              devices=devices, chunks=2)
        torch.manual_seed(0)
        pipe(torch.ones(4, 4)).sum().backward()
        after_pipe = torch.rand(3)
        torch.manual_seed(0)
        draw_step_seed()
        assert torch.equal(torch.rand(3), after_pipe), devices


def test_random_ops_without_generator_argument_are_seeded_too() -> None:
    class Noise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # randn.default has no generator argument: it borrows the default generator
            return x + torch.randn(x.shape, dtype=x.dtype)

    def run(stages: int) -> torch.Tensor:
        model = nn.Sequential(Noise(), nn.Identity(), Noise(), Noise())
        pipe = conveyor.GPipe(model, even_balance(model, stages), devices=["cpu"] * stages,
                              chunks=2)
        torch.manual_seed(11)
        return pipe(torch.zeros(4, 3))

    assert torch.equal(run(1), run(4))


def test_is_recomputing_is_true_only_in_recomputation() -> None:
    seen: list[tuple[str, bool]] = []
    lock = threading.Lock()

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                seen.append((threading.current_thread().name, conveyor.is_recomputing()))
            return x * x  # saves x, so backward needs the recomputation

    model = nn.Sequential(nn.Linear(2, 2), Spy())
    pipe = conveyor.GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=3, checkpoint="except_last")
    pipe(torch.ones(3, 2)).sum().backward()
    flags = [flag for _, flag in seen]
    assert flags.count(False) == 3  # one forward per micro-batch
    assert flags.count(True) == 2  # every micro-batch but the last is recomputed
    assert not conveyor.is_recomputing()


def dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(4)]).double()


def test_a_step_in_eval_mode_first_leaves_training_dropout_seeded() -> None:
    """Threads sharing the CPU find out in a layer's first call which parts draw
    random numbers: a first call in eval mode, where dropout draws nothing, must not
    leave training's dropout drawing from the shared generator."""
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    grads = []
    for eval_first in (False, True):
        pipe = conveyor.Pipeline(dropout_mlp(), stages=2, chunks=4,
                                 loss_fn=nn.functional.mse_loss, devices=["cpu", "cpu"])
        if eval_first:
            pipe.eval()
            pipe.step(x, y)
            pipe.train()
            pipe.zero_grad()
        torch.manual_seed(1)
        pipe.step(x, y)
        grads.append([p.grad for p in pipe.parameters()])
    assert len(grads[0]) == len(grads[1]) == 8  # 4 weights, 4 biases: none skipped
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class Attention(nn.Module):
    """Self-attention that calls the fused kernel in its own forward, as Hugging Face's
    attention modules do: a random op outside any Dropout module."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv, self.dropout = nn.Linear(8, 24), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, tokens, 8)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return attended.transpose(1, 2).flatten(2)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_attention_is_routed_to_the_layers_stream_only_when_it_drops(dropout: float) -> None:
    """On threads sharing the CPU, a layer whose attention draws random numbers runs
    under the dispatch mode (about 15 us of Python per op); without dropout it does not
    draw and runs as it is. Either way, one stage and two give the same result."""
    x, y = torch.randn(4, 5, 8, dtype=torch.float64), torch.zeros(4, 5, 8, dtype=torch.float64)
    results = []
    for balance in ([3], [2, 1]):
        torch.manual_seed(0)
        model = nn.Sequential(Attention(dropout), nn.Linear(8, 8), Attention(dropout)).double()
        pipe = conveyor.Pipeline(model, balance=balance, chunks=2, loss_fn=nn.functional.mse_loss,
                                 devices=["cpu"] * len(balance))
        torch.manual_seed(5)
        pipe.step(x, y)
        results.append([p.grad for p in pipe.parameters()])
    stages = pipe.runtime.stages
    routed = [stages[0].randomness._random_parts[(0, True)],
              stages[1].randomness._random_parts[(2, True)]]
    assert [bool(parts) for parts in routed] == [dropout > 0] * 2
    assert len(results[0]) == len(results[1]) == 6
    assert all(torch.equal(a, b) for a, b in zip(*results))
