"""Mixed precision: autocast on every stage (the caller's, or ``precision=``), and
float16 loss scaling with GradScaler's rules over the whole pipeline.

On the CPU, in float32 weights with bfloat16 or float16 compute. Against the plain
model run micro-batch by micro-batch under the same autocast (the same shapes, so the
same kernels: 1e-6); and against the plain model on the whole batch at the looser
tolerance of a 16-bit format (kernels on other shapes round differently).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.loss import LossScaler
from tests.support.models import build, sample

SCHEDULES = ["gpipe", "1f1b", "zero-bubble"]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


def float32_model(name: str = "mlp") -> tuple[nn.Sequential, nn.Sequential]:
    model, reference = build(name)
    return model.float(), reference.float()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)


def plain_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype,
                chunks: int) -> list[torch.Tensor | None]:
    """The plain model's gradients under autocast, micro-batch by micro-batch."""
    for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
        with torch.autocast("cpu", dtype=dtype):
            (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()
    return [p.grad for p in model.parameters()]


def assert_grads(pipe: nn.Module, want: list[torch.Tensor | None], *, rtol: float) -> None:
    for (name, param), expected in zip(pipe.named_parameters(), want):
        assert param.grad is not None and expected is not None, name
        assert param.grad.dtype == torch.float32, name  # weights and gradients stay float32
        scale = float(expected.abs().max()) or 1.0
        error = float((param.grad - expected).abs().max()) / scale
        assert error <= rtol, f"{name}: {error:.2e}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("how", ["precision=", "caller's autocast"])
def test_bf16_equals_the_plain_model_under_the_same_autocast(schedule: str, how: str) -> None:
    model, reference = float32_model()
    x, y = batch()
    options = {"precision": "bf16"} if how == "precision=" else {}
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, schedule=schedule,
                             balance=[3, 4], devices=["cpu", "cpu"], **options)
    if how == "precision=":
        pipe.step(x, y)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.step(x, y)
    assert_grads(pipe, plain_grads(reference, x, y, torch.bfloat16, 4), rtol=1e-6)
    whole = float32_model()[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(whole(x), y).backward()
    assert_grads(pipe, [p.grad for p in whole.parameters()], rtol=3e-2)


def test_every_stage_computes_in_the_asked_dtype_on_its_own_thread() -> None:
    model, _ = float32_model()
    seen: list[tuple[str, torch.dtype]] = []
    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda m, a, out: seen.append(
                (threading.current_thread().name, out.dtype)))
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=2, schedule="1f1b",
                             balance=[3, 4], devices=["cpu", "cpu"], precision="bf16",
                             recompute="always")
    pipe.step(*batch())
    assert {dtype for _, dtype in seen} == {torch.bfloat16}  # recomputation too
    assert len({thread for thread, _ in seen}) == 2
    pipe.eval()
    assert pipe(batch()[0]).dtype == torch.bfloat16  # inference under it too


def test_fp16_scales_the_loss_and_unscales_the_gradients() -> None:
    model, reference = float32_model()
    x, y = batch()
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=3, schedule="1f1b",
                             balance=[3, 4], devices=["cpu", "cpu"], precision="fp16")
    assert pipe.scaler is not None and pipe.scaler.scale == 2.0**16
    loss = pipe.step(x, y)
    assert not pipe.scaler.found_inf and torch.isfinite(loss)
    assert_grads(pipe, plain_grads(reference, x, y, torch.float16, 3), rtol=1e-3)


def test_an_overflowing_fp16_step_is_dropped_and_the_optimizer_skips_it() -> None:
    model, _ = float32_model()
    x, y = batch()
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=3, schedule="zero-bubble",
                             balance=[3, 4], devices=["cpu", "cpu"], precision="fp16")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    assert pipe.scaler is not None
    pipe.scaler.scale = 2.0**120  # float16 gradients overflow
    before = [p.detach().clone() for p in pipe.parameters()]
    pipe.step(x, y)
    assert pipe.scaler.found_inf and pipe.scaler.scale == 2.0**119
    assert all(p.grad is None for p in pipe.parameters())  # as before the step
    assert not pipe.scaler.step(optimizer)
    assert all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
    pipe.scaler.update()  # torch.amp.GradScaler's loop: step(optimizer), then update()
    assert pipe.scaler.get_scale() == 2.0**119  # set by the step already, not halved again
    pipe.scaler.update(2.0**8)  # a new scale, as torch's update(new_scale) sets it
    pipe.step(x, y)
    assert not pipe.scaler.found_inf
    pipe.scaler.unscale_(optimizer)  # the gradients come back unscaled: nothing to do
    assert pipe.scaler.step(optimizer)
    pipe.scaler.update()
    assert pipe.scaler.get_scale() == 2.0**8
    assert not all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))


def test_the_scale_grows_after_growth_interval_good_steps_and_is_saved() -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    for found in (False, False, True, False, False):
        scaler.record(found)
    scaler.update(False)  # a bool alone: the rule for one step, as earlier versions took it
    assert scaler.scale == 8.0  # halved once, then doubled after three good steps
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    grads = [torch.full((2,), 16.0), torch.tensor([1.0, float("inf")])]
    assert scaler.unscale(grads)
    assert grads[0].tolist() == [2.0, 2.0]


def test_an_unknown_precision_is_refused_with_the_choices() -> None:
    model, _ = float32_model()
    with pytest.raises(conveyor.ConfigError, match="'bf16'.*'fp16'"):
        conveyor.Pipeline(model, loss_fn=loss_fn, chunks=2, balance=[3, 4],
                          devices=["cpu", "cpu"], precision="float8")


def test_a_transformer_trains_in_bf16_close_to_float32() -> None:
    """Not a tolerance test: a few steps of a real model in bf16 follow float32's."""
    losses = {}
    for precision in (None, "bf16"):
        torch.manual_seed(0)
        model, _ = build("transformer")
        model.float()
        ids = sample("transformer", batch=8)
        pipe = conveyor.Pipeline(model, chunks=4, schedule="1f1b", balance=[3, 3],
                                 devices=["cpu", "cpu"], precision=precision,
                                 loss_fn=lambda out, t: nn.functional.cross_entropy(
                                     out.flatten(0, 1).float(), t.flatten()))
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        for _ in range(5):
            optimizer.zero_grad()
            losses[precision] = pipe.step(ids, ids).item()
            optimizer.step()
    assert abs(losses["bf16"] - losses[None]) < 0.1 * losses[None]


def test_all_finite_reads_sums_and_checks_elements_only_where_a_sum_overflows() -> None:
    """The finiteness check of gradients (check_finite, the float16 scaler): a NaN or an
    infinity anywhere is found; finite elements whose sum overflows are finite."""
    from conveyor.engine.loss import all_finite

    ones = torch.ones(1000)
    assert all_finite([ones, torch.full((10,), 3e38)])  # the sum overflows, no element does
    assert all_finite([torch.full((8,), 60000.0, dtype=torch.float16)])
    assert all_finite([torch.tensor([1e308, 1e308], dtype=torch.float64), torch.tensor([1, 2])])
    assert all_finite([])
    assert not all_finite([ones, torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("inf"), -float("inf")])])  # a sum of nan
    assert not all_finite([torch.full((10,), 3e38), torch.tensor([float("inf")])])
    assert not all_finite([torch.tensor([1 + 1j, complex("nan")])])
