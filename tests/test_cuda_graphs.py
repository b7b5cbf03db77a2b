"""``cuda_graphs=True``: compiled stages replayed from CUDA graphs, one capture per
micro-batch in flight.

On the CPU: every case it refuses, with the reason. On a GPU (run by
``benchmarks/gpu.py``'s tests part): float64 steps equal to the plain model's under
GPipe and 1F1B over steps of uneven micro-batches, as many captures as micro-batches
are in flight, and ``eval_step`` without graphs; under ``precision="bf16"``, the
compiled stages' gradients.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import conveyor
from conveyor.engine.compiled.cudagraphs import check_cuda_graphs
from conveyor.errors import ConveyorError
from tests.support.models import assert_same_grads, build, sample

pytestmark = pytest.mark.filterwarnings("ignore")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GPU = torch.device("cuda", 0)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def steps_equal_the_plain_model(pipe: conveyor.Pipeline, reference: torch.nn.Module,
                                device: str) -> None:
    """Three steps, of 12, 10 and 12 samples (3 rows a micro-batch; then 3, 3, 2, 2),
    each the plain model's loss and gradients in float64."""
    for batch in (12, 10, 12):
        x = sample("mlp", batch=batch).to(device)
        y = torch.randn(batch, 3, dtype=torch.float64, device=device)
        pipe.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        expected = loss_fn(reference(x), y)
        expected.backward()
        assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
        assert_same_grads(pipe.named_parameters(), reference.named_parameters())


def test_cuda_graphs_are_refused_off_cuda() -> None:
    model, _ = build("mlp")
    with pytest.raises(ConveyorError, match="stage 0 is on cpu.*give CUDA devices"):
        conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, balance=[4, 3],
                          devices=["cpu", "cpu"], compile=True, cuda_graphs=True)


@pytest.mark.parametrize(("change", "reason"), [
    ({"compiled": False}, "give compile=True too"),
    ({"splits": True}, "splits the backward"),
    ({"modes": ["never", "except_last"]}, "recompute=\"never\""),
    ({"offloaded": True}, "offload="),
    ({"sharded": True}, "FSDP"),
])
def test_cuda_graphs_say_why_they_are_refused(change: dict[str, Any], reason: str) -> None:
    accepted = {"devices": [GPU, GPU], "compiled": True, "splits": False,
                "modes": ["never", "never"], "offloaded": False, "sharded": False}
    check_cuda_graphs(**accepted)
    with pytest.raises(ConveyorError, match=reason):
        check_cuda_graphs(**{**accepted, **change})


@cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replayed_stages_are_exact_over_steps_of_uneven_micro_batches(schedule: str) -> None:
    model, reference = build("mlp")
    reference.cuda()
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, schedule=schedule,
                             balance=[4, 3], devices=[GPU, GPU], compile=True,
                             recompute="never", cuda_graphs=True)
    steps_equal_the_plain_model(pipe, reference, "cuda")
    in_flight = {"gpipe": 4, "1f1b": 2}[schedule]  # at stage 0, per kind of input
    for stage in pipe.runtime.stages.values():
        assert stage.graphed is not None and 0 < stage.graphed.captures <= 2 * in_flight
    with torch.no_grad():
        x = sample("mlp", batch=12).cuda()
        torch.testing.assert_close(pipe.eval_step(x), reference(x))


@cuda
def test_replayed_stages_under_bf16_match_the_compiled_stages() -> None:
    """``precision="bf16"``: autocast caches the weights it casts within a step (the
    compiled stage's probe casts them before the first capture); a cast kept from
    before a capture ties it to the default stream, which CUDA refuses (H200)."""
    model, _ = build("mlp")
    model.float()
    twin = copy.deepcopy(model)
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": 4, "balance": [4, 3],
                               "devices": [GPU, GPU], "compile": True,
                               "recompute": "never", "precision": "bf16"}
    graphed = conveyor.Pipeline(model, cuda_graphs=True, **options)
    compiled = conveyor.Pipeline(twin, **options)
    for batch in (12, 10, 12):
        x = sample("mlp", batch=batch).float().cuda()
        y = torch.randn(batch, 3, device="cuda")
        losses = []
        for pipe in (graphed, compiled):
            pipe.zero_grad(set_to_none=True)
            losses.append(pipe.step(x, y))
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=1e-3)
        for (name, got), (_, want) in zip(graphed.named_parameters(),
                                           compiled.named_parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=2e-2, atol=2e-3,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert all(stage.graphed is not None and stage.graphed.captures > 0
               for stage in graphed.runtime.stages.values())


def replayed_in_static_memory(module: torch.nn.Module, sample_args: tuple[Any, ...], *,
                              allow_unused_input: bool = False) -> object:
    """``torch.cuda.make_graphed_callables`` as its replays behave, on the CPU: each
    call writes its output into one static tensor and hands on that tensor; the
    backward differentiates the capture's latest forward (a replay's saved tensors are
    the capture's static memory) and hands on static gradients. Any capture reused while
    a micro-batch still needs it, or a static tensor kept past its replay, shows."""
    params = [p for p in module.parameters() if p.requires_grad]
    static: dict[str, object] = {}
    run = module.forward

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                leaf = x.detach().requires_grad_(x.requires_grad)
                static["graph"] = (leaf, run(leaf))
            out = static["graph"][1]  # type: ignore[index]
            buffer = static.setdefault("out", torch.empty_like(out))
            buffer.copy_(out.detach())  # type: ignore[attr-defined]
            return buffer.detach()  # type: ignore[attr-defined]

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> tuple[object, ...]:
            leaf, out = static["graph"]  # type: ignore[misc]
            wanted = ([leaf] if leaf.requires_grad else []) + params
            grads = torch.autograd.grad(out, wanted, grad, allow_unused=True)
            kept = []
            for index, g in enumerate(grads):
                if g is not None:
                    g = static.setdefault(f"grad{index}", torch.empty_like(g)).copy_(g)
                kept.append(None if g is None else g.detach())
            input_grad = kept.pop(0) if leaf.requires_grad else None
            return (input_grad, *kept)

    module.forward = lambda x: Replay.apply(x, *params)  # type: ignore[method-assign]
    return module


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_captures_kept_apart_give_the_plain_models_gradients(
        schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bookkeeping on the CPU, with replays emulated in static memory: a capture
    per micro-batch in flight, given back after its backward and at a new step; the
    input's gradient copied out; each ``.grad`` there before a replay's backward (a
    zero one where there was none); the first replay checked."""
    from conveyor.engine.compiled import cudagraphs

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", replayed_in_static_memory)
    monkeypatch.setattr(cudagraphs, "_replayable", lambda x: isinstance(x, torch.Tensor))
    model, reference = build("mlp")
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, schedule=schedule,
                             balance=[4, 3], devices=["cpu", "cpu"], compile=True,
                             recompute="never")
    for stage in pipe.runtime.stages.values():
        stage.graphed = cudagraphs.GraphedStage(stage.compiled.graph, stage.layers,
                                                stage.index)
    steps_equal_the_plain_model(pipe, reference, "cpu")
    captures = [stage.graphed.captures for stage in pipe.runtime.stages.values()]
    # per kind of input: GPipe holds all its micro-batches at once (4 of 3 rows, then 2
    # of 3 and 2 of 2 rows); 1F1B at most 2 on stage 0 and 1 on stage 1
    assert captures == ({"gpipe": [6, 6], "1f1b": [4, 2]}[schedule])


def test_a_capture_that_replays_something_else_fails_the_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture's first replay is checked against the compiled stage: one that
    computes otherwise fails the step, naming the stage, rather than train on."""
    from conveyor.engine.compiled import cudagraphs

    def off_by_a_little(module: torch.nn.Module, sample_args: tuple[Any, ...],
                        **_: object) -> object:
        run = module.forward
        module.forward = lambda x: run(x) * 1.001  # type: ignore[method-assign]
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", off_by_a_little)
    monkeypatch.setattr(cudagraphs, "_replayable", lambda x: isinstance(x, torch.Tensor))
    model, _ = build("mlp")
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=2, balance=[4, 3],
                             devices=["cpu", "cpu"], compile=True, recompute="never")
    stage = pipe.runtime.stages[1]
    stage.graphed = cudagraphs.GraphedStage(stage.compiled.graph, stage.layers, 1)
    with pytest.raises(ConveyorError, match="stage 1: the CUDA graph captured"):
        pipe.step(sample("mlp", batch=4), torch.randn(4, 3, dtype=torch.float64))
