"""A compiled graph's backward split into an input-gradient (I) and a weight-gradient (W)
graph (``conveyor.engine.compiled.backward``), in float64 against eager autograd.

I computes the input gradient and leaves ``.grad`` as it was; W, later, adds the
weight gradients (a linear layer's inside its matrix product); ``B`` does both at once;
a backward nobody planned returns every gradient, as torch's own node; a parameter with
a gradient hook gets its gradient through autograd, hook called.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import conveyor.engine.compiled.backward as compiled_module
from conveyor.engine.compiled.backward import SplitBackward, compiled_nodes, planned, split_backend
from conveyor.engine.backward.weightgrad import backward_input
from conveyor.torchprivate import keep_compiled_buffers

pytestmark = pytest.mark.filterwarnings("ignore")

# On CUDA, autograd runs the compiled node on the device's own thread: the plan must
# reach it there (run by benchmarks/gpu.py's tests part where a GPU is at hand).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.fixture(autouse=True)
def fresh_graphs() -> None:
    """Each test compiles ``compiled``'s one function again: torch keeps 8 graphs per
    code object and runs it eagerly from the ninth (this file's tests on a GPU)."""
    torch._dynamo.reset()


def block(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6), nn.LayerNorm(6),
                         nn.Linear(6, 4, bias=False)).double().to(device)


def conv_block(device: str = "cpu") -> nn.Module:
    """A convolution's backward is one op of several outputs (the input's, the
    weight's and the bias's gradients): I hands W its parts, not the op (generator seed
    42.0, compiled: inductor refused a graph handing on the op's tuple)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (1, 2, 3)), nn.Conv2d(1, 2, 2, padding=1),
                         nn.Tanh(), nn.Flatten(), nn.Linear(24, 4)).double().to(device)


def compiled(module: nn.Module) -> object:
    keep_compiled_buffers()  # I keeps the graph for W, as conveyor's compiled stages do
    def call(x: torch.Tensor) -> torch.Tensor:
        return module(x)
    return torch.compile(call, backend=split_backend)


def expected_grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor
                   ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    plain, leaf = copy.deepcopy(module), x.detach().requires_grad_(x.requires_grad)
    plain(leaf).backward(g)
    return leaf.grad, [p.grad for p in plain.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [block, conv_block])
@pytest.mark.parametrize("input_grad", [True, False])
def test_i_leaves_the_weight_gradients_to_w(input_grad: bool, make: Any, device: str) -> None:
    module = make(device)
    run = compiled(module)
    x = torch.randn(5, 6, dtype=torch.float64, device=device, requires_grad=input_grad)
    g = torch.randn(5, 4, dtype=torch.float64, device=device)
    want_input, want_params = expected_grads(module, x, g)
    params = list(module.parameters())
    for p in params:  # accumulates, as over micro-batches
        p.grad = torch.ones_like(p)
    out = run(x)
    found, weight = backward_input([out], [g], [x] if input_grad else [], params)
    for p in params:
        assert torch.equal(p.grad, torch.ones_like(p)), "I changed a weight gradient"
    if input_grad:
        torch.testing.assert_close(found[0], want_input, rtol=1e-12, atol=1e-12)
    weight.run()
    for p, want in zip(params, want_params):
        torch.testing.assert_close(p.grad, want + 1, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_b_adds_the_weight_gradients_at_once_inside_the_products(device: str) -> None:
    module = block(device)
    run = compiled(module)
    x = torch.randn(7, 6, dtype=torch.float64, device=device, requires_grad=True)
    g = torch.randn(7, 4, dtype=torch.float64, device=device)
    want_input, want_params = expected_grads(module, x, g)
    out = run(x)
    nodes = compiled_nodes([out.grad_fn])
    assert len(nodes) == 1
    handles = planned(nodes, None)
    try:
        out.backward(g)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(x.grad, want_input, rtol=1e-12, atol=1e-12)
    for p, want in zip(module.parameters(), want_params):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-12)


def test_the_backward_is_two_graphs_and_w_does_not_compute_the_input_path_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """I hands W the gradient at each layer's output; W computes no matrix product of
    its own (each linear weight's leaves as the product's operands) and three of its
    seven gradients are such products."""
    module = block()
    splits: list[SplitBackward] = []
    weight_graphs: list[torch.fx.GraphModule] = []
    make_split, make_weight_graph = SplitBackward.__init__, compiled_module._weight_graph

    def split(self: SplitBackward, *args: object) -> None:
        make_split(self, *args)
        splits.append(self)

    def weight_graph(*args: object) -> torch.fx.GraphModule:
        weight_graphs.append(make_weight_graph(*args))
        return weight_graphs[-1]

    monkeypatch.setattr(SplitBackward, "__init__", split)
    monkeypatch.setattr(compiled_module, "_weight_graph", weight_graph)
    torch._dynamo.reset()  # else the graph compiled for another block would serve
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    compiled(module)(x).sum().backward()
    assert len(splits) == 1 and len(weight_graphs) == 1
    assert sum(splits[0]._products) == 3 and len(splits[0]._products) == 7
    products = [n for n in weight_graphs[0].graph.nodes
                if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert products == []


def test_a_backward_nobody_planned_and_a_hooked_parameter_get_every_gradient() -> None:
    module = block()
    run = compiled(module)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 4, dtype=torch.float64)
    want_input, want_params = expected_grads(module, x, g)
    run(x).backward(g)  # no plan: torch's own accumulation
    for p, want in zip(module.parameters(), want_params):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-12)
    module.zero_grad(set_to_none=True)
    called = []
    module[0].weight.register_hook(lambda grad: called.append(1))
    out = run(x)
    found, weight = backward_input([out], [g], [x], list(module.parameters()))
    weight.run()
    assert called == [1]
    torch.testing.assert_close(found[0], want_input, rtol=1e-12, atol=1e-12)
    for p, want in zip(module.parameters(), want_params):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-12)


def test_a_plan_left_armed_by_a_failed_backward_is_taken_by_no_later_one() -> None:
    """A node whose backward raised before its post-hook leaves its plan armed on the
    thread; once the backward that planned it is over (its handles removed), the next
    compiled backward on the thread ignores it and returns every gradient."""
    module = block()
    run = compiled(module)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 4, dtype=torch.float64)
    want_input, want_params = expected_grads(module, x, g)
    waiting: list[object] = []
    stale_output = run(x)  # (alive: a node outlives its tensors only while they live)
    stale = stale_output.grad_fn
    handles = planned([stale], waiting)
    compiled_module._arm(handles[-1], ())  # as its pre-hook would, its backward then failing
    for handle in handles:
        handle.remove()
    run(x).backward(g)
    assert waiting == []
    torch.testing.assert_close(x.grad, want_input, rtol=1e-12, atol=1e-12)
    for p, want in zip(module.parameters(), want_params):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-12)
