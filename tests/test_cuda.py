"""The CUDA path: devices, copies between them, seeding of CUDA generators.

Skipped without a GPU. With one GPU, stages share it (several workers on one device);
with two or more, stages sit on different devices and activations move between them.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
from tests.support.models import (
    assert_same_grads,
    build,
    even_balance,
    paired,
    sample,
    weighted_loss,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_devices(count: int) -> list[str]:
    return [f"cuda:{i % torch.cuda.device_count()}" for i in range(count)]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_gradients_equal_plain_model_on_cuda(name: str, checkpoint: str) -> None:
    model, reference = build(name)
    reference.cuda()
    pipe = conveyor.GPipe(model, even_balance(model, 3), devices=cuda_devices(3), chunks=4,
                          checkpoint=checkpoint)
    x = sample(name, batch=10)
    output = pipe(x.to(pipe.devices[0]))
    assert output.device == pipe.devices[-1]
    weighted_loss(output).backward()
    weighted_loss(reference(x.cuda())).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


def test_cpu_and_cuda_stages_mix() -> None:
    model, reference = build("mlp")
    pipe = conveyor.GPipe(model, [3, 4], devices=["cpu", "cuda:0"], chunks=3)
    x = sample("mlp")
    weighted_loss(pipe(x)).backward()
    weighted_loss(reference(x)).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_cuda_dropout_is_the_same_for_any_number_of_stages(checkpoint: str) -> None:
    """K=1 and K=3 on one GPU: each reseeds the device generator per layer call (the
    stages on one GPU share one thread); the same masks whatever the cut."""
    grads = []
    for stages in (1, 3):
        model, _ = build("transformer", dropout=0.3)
        pipe = conveyor.GPipe(model, even_balance(model, stages), devices=["cuda:0"] * stages,
                              chunks=4, checkpoint=checkpoint)
        torch.manual_seed(5)
        weighted_loss(pipe(sample("transformer").cuda())).backward()
        grads.append([p.grad.clone() for p in pipe.parameters()])
    for a, b in paired(*grads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)


def test_default_devices_are_the_cuda_devices() -> None:
    stages = torch.cuda.device_count()
    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(stages + 1)])
    pipe = conveyor.GPipe(layers, [1] * (stages - 1) + [2])
    assert pipe.devices == [torch.device("cuda", i) for i in range(stages)]
    with pytest.raises(conveyor.BalanceError,
                       match=rf"{stages + 1} stages but only {stages} CUDA devices"):
        conveyor.GPipe(layers, [1] * (stages + 1))


def test_autocast_reaches_the_stage_threads() -> None:
    model, _ = build("mlp")
    model.float()
    pipe = conveyor.GPipe(model, [3, 4], devices=cuda_devices(2), chunks=2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(sample("mlp").float().cuda())
    assert out.dtype == torch.bfloat16


def test_attention_and_dropout_that_drop_nothing_draw_nothing_on_cuda() -> None:
    """The dispatch mode leaves layers whose random ops have dropout 0 unrouted: that is
    exact only if those kernels leave the generator as it was."""
    q = torch.randn(2, 2, 16, 8, device="cuda")
    calls = {
        "efficient attention": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, q, q, dropout_p=0.0),
        "flash attention (bf16)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.bfloat16(), q.bfloat16(), q.bfloat16(), is_causal=True),
        "dropout p=0": lambda: torch.nn.functional.dropout(q, 0.0, True),
        "dropout, eval": lambda: torch.nn.functional.dropout(q, 0.5, False),
    }
    for name, call in calls.items():
        torch.cuda.manual_seed(0)
        call()
        after = torch.rand(4, device="cuda")
        torch.cuda.manual_seed(0)
        assert torch.equal(torch.rand(4, device="cuda"), after), name


def test_stages_on_one_gpu_reseed_its_generator_without_the_dispatch_mode() -> None:
    """They run on one thread: nothing draws from the device's generator at the same
    time, so each layer call reseeds it (the dispatch mode costs ~15 us per op)."""
    model, _ = build("transformer", dropout=0.3)
    pipe = conveyor.Pipeline(model, balance=even_balance(model, 3), chunks=4,
                             loss_fn=lambda out, _: weighted_loss(out), devices=["cuda:0"] * 3)
    x = sample("transformer").cuda()
    pipe.step(x, x)
    assert not any(stage.randomness.shared for stage in pipe.runtime.stages.values())


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_compiled_stages_on_cuda_are_exact(schedule: str) -> None:
    """Each stage one compiled graph, in float64 over two steps: the plain model's
    gradients."""
    model, reference = build("mlp")
    reference.cuda()
    x = sample("mlp", batch=12).cuda()
    y = torch.randn(12, 3, dtype=torch.float64, device="cuda")
    pipe = conveyor.Pipeline(model, loss_fn=torch.nn.functional.mse_loss, chunks=4,
                             schedule=schedule, balance=[4, 3], devices=cuda_devices(2),
                             compile=True)
    for _ in range(2):
        loss = pipe.step(x, y)
        expected = torch.nn.functional.mse_loss(reference(x), y)
        expected.backward()
        assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert all(not stage.compiled.eager[(True,) * len(stage.layers)]
               for stage in pipe.runtime.stages.values())
