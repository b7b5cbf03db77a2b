"""``compile=True``: each stage's layers compiled with torch.compile, still exact.

In float64 on the CPU against the plain model (eager) on the whole batch: a split
backward (zero-bubble's ``I``/``W``) with recomputation, dropout in training mode (its
modules stay eager, drawing from the pipeline's streams) on stages that share the CPU,
and a traced model cut by ``split_at``; the V shapes; dropout after a compiled stage
whose output inductor lays out otherwise than eager; a Hugging Face Llama. A first
compile takes seconds: few
cases (``python -m tests.generated --compile`` runs the generator's, compiled).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.compiled.stages import CompiledCall, EagerLayout, is_compiled
from conveyor.engine.recompute.rng import draw_step_seed
from conveyor.checking.plain import traced_per_microbatch
from tests.generated.cases import draw_case, draw_cases
from tests.generated.running import run_case
from tests.support import any_models
from tests.support.cases import packed
from tests.support.extras import require
from tests.support.models import (
    VOCAB,
    assert_same_grads,
    build,
    relative_error,
    sample,
    seeded_per_layer,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def test_compiled_stages_with_split_backward_recomputation_and_dropout_are_exact() -> None:
    model, reference = build("mlp", dropout=0.3)
    x = sample("mlp", batch=12)
    y = torch.randn(12, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, schedule="zero-bubble",
                             recompute="always", balance=[4, 4], devices=["cpu", "cpu"],
                             compile=True)
    torch.manual_seed(7)
    loss = pipe.step(x, y)
    torch.manual_seed(7)
    expected = loss_fn(seeded_per_layer(reference, x, 4, draw_step_seed()), y)
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    for stage in pipe.runtime.stages.values():
        # A stage whose layers draw random numbers runs those eagerly and each other
        # one compiled; a stage whose layers draw none runs them as one graph.
        drawing = {offset for offset, layer in enumerate(stage.layers)
                   if any(isinstance(m, nn.Dropout) for m in layer.modules())}
        assert stage.compiled.eager == {(True,) * len(stage.layers): frozenset(drawing)}


def test_a_traced_model_compiles_stage_by_stage_and_stays_exact() -> None:
    model, reference = build("transformer")
    wrapped, plain = nn.Sequential(model), nn.Sequential(reference)
    ids = sample("transformer", batch=8)
    y = torch.randn(8, ids.shape[1], VOCAB, dtype=torch.float64)
    pipe = conveyor.Pipeline(wrapped, loss_fn=loss_fn, chunks=2, schedule="1f1b",
                             split_at=["0.3"], sample=ids[:2], devices=["cpu", "cpu"],
                             recompute="except_last", compile=True)
    loss = pipe.step(ids, y)
    expected = loss_fn(plain(ids), y)
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), plain.named_parameters())


def test_a_traced_stage_drawing_random_numbers_stays_eager_and_exact() -> None:
    """Compiled, its dropout would draw inductor's numbers, not the plain model's."""
    model, reference = build("transformer", dropout=0.2)
    wrapped, plain = nn.Sequential(model), nn.Sequential(reference)
    ids = sample("transformer", batch=4)
    y = torch.randn(4, ids.shape[1], VOCAB, dtype=torch.float64)
    pipe = conveyor.Pipeline(wrapped, loss_fn=loss_fn, chunks=2, schedule="zero-bubble",
                             split_at=["0.4"], sample=ids[:2], devices=["cpu", "cpu"],
                             recompute="always", compile=True)
    torch.manual_seed(3)
    loss = pipe.step(ids, y)
    torch.manual_seed(3)
    expected = loss_fn(traced_per_microbatch(plain, ids, 2, draw_step_seed(), ["0.4"]), y)
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), plain.named_parameters())
    stages = pipe.runtime.stages
    first, last = stages[0].layers[0].graphs(), stages[1].layers[0].graphs()
    assert first and last
    programs = stages[0].layers[0].programs
    assert not is_compiled(programs[True].module)  # its blocks' dropout, training
    assert is_compiled(programs[False].module)  # in eval mode its dropout draws nothing
    assert all(map(is_compiled, last))  # the norm and the head


class Skipping(nn.Module):
    """Three blocks, the last reading the first's output too: cut before the last, the
    first stage sends two values, which leave its compiled graph's one backward node."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.tanh(self.blocks[0](x))
        second = torch.tanh(self.blocks[1](first))
        return self.head(self.blocks[2](second) * torch.sigmoid(first))


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
def test_compiled_v_shapes_on_one_rank_are_exact(schedule: str) -> None:
    # The generator under compile=True (python -m tests.generated --compile) found the
    # first stage's weight gradients wrong here: W started both of its outputs at the
    # first slot of their one node (tests/test_weightgrad.py has it without compile).
    torch.manual_seed(0)
    model = Skipping().double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, schedule=schedule,
                             split_at=["blocks.2"], sample=x[:2], devices=["cpu"],
                             compile=True)
    loss = pipe.step(x, y)
    expected = loss_fn(plain(x), y)
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), plain.named_parameters())
    assert all(is_compiled(graph) for stage in pipe.runtime.stages.values()
               for layer in stage.layers for graph in layer.graphs())


def test_dropout_after_a_compiled_stage_draws_the_plain_models_mask() -> None:
    # Found by the generator under compile=True (seed 54.2, shrunk): the first stage's
    # compiled graph handed on its batch norm's transposed output contiguous, and the
    # next stage's dropout, filling its mask in memory order, dropped other elements.
    case = replace(draw_cases(54, compiled=True)[2], chunks=2, batch=3, recompute="never",
                   schedule="interleaved-1f1b")
    case = replace(case, spec=replace(case.spec, blocks=("batchnorm", "dropout", "linear"),
                                      memory_from=None, skip=None, extra=None))
    assert case.train and case.ranks == 1 and case.virtual == 2
    result = run_case(case)
    assert result.ok, str(result)


class Transposing(nn.Module):
    """Batch norm over a transposed input, handed on transposed back: eager returns a
    view whose memory runs along the last dim but one; inductor, a contiguous tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def test_a_compiled_layer_hands_on_the_eager_layout_and_updates_its_buffers_once() -> None:
    torch.manual_seed(0)
    layer, plain = Transposing().double(), Transposing().double()
    plain.load_state_dict(layer.state_dict())
    compiled = CompiledCall(layer, "transposing")
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    out, expected = compiled(x), plain(x)
    assert out.stride() == expected.stride()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # The eager run that found the layout put the running statistics back.
    torch.testing.assert_close(layer.norm.running_mean, plain.norm.running_mean,
                               rtol=1e-12, atol=1e-12)
    assert int(layer.norm.num_batches_tracked) == 1
    out.sum().backward()  # the inputs the graph saved were left as they were


def test_a_hugging_face_llama_compiles_and_stays_exact() -> None:
    """A model nobody here wrote, traced and cut by split_at, each stage's graph compiled:
    its attention and dropout calls take p=0.0, which draw nothing (before, any such
    call kept the whole graph eager, so compile=True compiled none of a Hugging Face
    model). Fused weight gradients stay off: compiled stages keep autograd's.

    Exact to float32's precision: Llama's RMSNorm and softmax compute in float32 in a
    float64 model, and inductor's fused float32 kernels round otherwise than eager's
    (6.8e-8, one float32 step). Every float64 operation is exact."""
    model, reference, split_at, inputs, targets = any_models.build("llama")
    stages = len(split_at) + 1
    pipe = conveyor.Pipeline(model, split_at=split_at, sample=any_models.sample_of(inputs),
                             stages=stages, devices=["cpu"] * stages,
                             chunks=any_models.CHUNKS, schedule="1f1b",
                             loss_fn=any_models.loss_of("llama"), compile=True)
    loss = pipe.step(inputs, targets)
    expected = any_models.plain_step("llama", reference, inputs, targets)
    assert abs(loss.item() - expected.item()) <= 1e-7 * abs(expected.item())
    any_models.assert_model_grads(pipe, reference, tolerance=1e-6)
    assert all(is_compiled(graph) for stage in pipe.runtime.stages.values()
               for graph in stage.layers[0].graphs())


@pytest.mark.parametrize("traced", [False, True])
def test_compiled_layers_run_compiled_from_their_first_call(traced: bool) -> None:
    """Stages sharing a device learn which parts of a layer draw random numbers by a
    first call under a dispatch mode, which torch.compile leaves eager (torch 2.13 and
    older: that layer for good, so compile=True compiled nothing on threads or one
    GPU). A compiled layer is now probed by an eager call aside: every call of a
    compiled graph in the step (a stage of layers: one graph of them all), the first
    included, runs compiled."""
    model, _ = build("transformer")
    ids = sample("transformer", batch=8)
    y = torch.randn(8, ids.shape[1], VOCAB, dtype=torch.float64)
    layers = nn.Sequential(*model) if not traced else nn.Sequential(model)
    options = {"split_at": ["0.3"], "sample": ids[:2]} if traced else {"balance": [3, 3]}
    pipe = conveyor.Pipeline(layers, loss_fn=loss_fn, chunks=2, schedule="1f1b",
                             devices=["cpu", "cpu"], recompute="always", compile=True,
                             **options)
    made: list[str] = []

    def note(module: nn.Module, args: object, output: object) -> None:
        leaves = torch.utils._pytree.tree_leaves(output)
        made.append(type(next(t for t in leaves if isinstance(t, torch.Tensor)).grad_fn).__name__)

    stages = pipe.runtime.stages.values()
    compiled = [stage.compiled.graph.module for stage in stages] if not traced else [
        layer.graph() for stage in stages for layer in stage.layers if is_compiled(layer.graph())]
    assert compiled
    for module in compiled:
        module.register_forward_hook(note)
    pipe.step(ids, y)
    # Each micro-batch's forward; recomputations (which may stop early) come on top.
    assert len(made) >= len(compiled) * 2 and set(made) == {"CompiledFunctionBackward"}, made


def test_uneven_micro_batches_recomputed_through_a_compiled_graph_are_exact() -> None:
    """Generator seed 61.0, shrunk: a traced model in eval mode (its attention compiled),
    12 samples in 5 micro-batches (3, 3, 2, 2, 2), recomputed. Before the batch
    dimension was marked dynamic, the third micro-batch recompiled the graph for any
    size, micro-batch 1's recomputation ran the new graph, and its backward (the old
    graph's) refused the saved tensors' layout."""
    case = replace(draw_case(61, 0), schedule="gpipe", ranks=1, virtual=1, cut="auto",
                   boundaries=(), compiled=True)
    case = replace(case, spec=replace(case.spec, blocks=("linear", "conv1d", "attention"),
                                      tie_head=False, extra=None))
    assert (case.batch, case.chunks, case.recompute, case.train) == (12, 5, "except_last", False)
    result = run_case(case)
    assert result.error <= 1e-10, result


#: A schedule of each kind (GPipe and ZB-V run compiled in the tests above and in the
#: generator's compiled cases).
SCHEDULE_OPTIONS = {
    "1f1b": {"devices": ["cpu", "cpu"], "balance": [4, 3]},
    "zero-bubble": {"devices": ["cpu", "cpu"], "balance": [4, 3]},
    "interleaved-1f1b": {"devices": ["cpu", "cpu"], "balance": [2, 2, 2, 1],
                         "virtual_stages": 2},
    "dualpipe-v": {"devices": ["cpu"], "balance": [4, 3]},
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULE_OPTIONS))
def test_every_schedule_runs_whole_compiled_stages_exactly(schedule: str) -> None:
    """Each stage of torch's own layers is one compiled graph (one autograd node, whose
    backward is two compiled graphs: I's, and W's for a split backward), and the step
    is the plain model's in float64, in training and then in eval mode."""
    model, reference = build("mlp")
    x, y = sample("mlp", batch=8), torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, schedule=schedule,
                             compile=True, **SCHEDULE_OPTIONS[schedule])
    for training in (True, False):
        pipe.train(training)
        reference.train(training)
        pipe.zero_grad()
        reference.zero_grad()
        loss = pipe.step(x, y)
        expected = loss_fn(reference(x), y)
        expected.backward()
        assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
        assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    for stage in pipe.runtime.stages.values():
        modes = {(training,) * len(stage.layers) for training in (True, False)}
        assert stage.compiled.eager == dict.fromkeys(modes, frozenset())


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble"])
def test_a_recomputed_micro_batch_recomputes_inside_the_compiled_backward(
        schedule: str) -> None:
    """A stage run as one compiled graph recomputes inside its backward graph: the
    forward of a recomputed micro-batch keeps nothing but its input and the parameters,
    the stage's layers run once per micro-batch (a pre-hook on its partition fires
    once, not again in backward), and the step is the plain model's in float64, the split
    backward's I and W included."""
    model, reference = build("mlp")
    x, y = sample("mlp", batch=8), torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, schedule=schedule,
                             balance=[4, 3], devices=["cpu", "cpu"], recompute="always",
                             compile=True)
    calls = [0, 0]
    for k, stage in pipe.runtime.stages.items():  # pre-hooks fire again when recomputing
        stage.layers.register_forward_pre_hook(
            lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
    for _ in range(2):  # the first step decides that the stages run whole, then again
        pipe.zero_grad()
        loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert calls == [8, 8]  # 2 steps of 4 micro-batches, each run once
    stage = pipe.runtime.stages[1]
    inputs = torch.randn(2, 12, dtype=torch.float64, requires_grad=True)
    kept = {(t.data_ptr(), t.shape) for t in (*stage.trainable_parameters(), inputs)}
    for recompute in (True, False):
        outputs, effects = stage.forward(inputs, 0, step_seed=None, recompute=recompute)
        saved = outputs.grad_fn.saved_tensors
        assert effects is None and saved
        only_inputs = all((t.data_ptr(), t.shape) in kept for t in saved)
        assert only_inputs == recompute, [tuple(t.shape) for t in saved]


class Caching(nn.Module):
    """Reads what its previous call left in a buffer, then writes its input's mean there
    under ``no_grad`` (the generator's "cache" block, seeds 0.3 and 7.0): compiled,
    torch saved the buffer itself for backward and then wrote into it, and backward
    refused it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("state", torch.zeros(6))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h + self.linear(h) * torch.tanh(self.state.clone())
        with torch.no_grad():
            self.state.copy_(h.mean(0))
        return out


def test_a_layer_updating_a_buffer_runs_eagerly_and_the_others_compiled() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Caching(), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, balance=[3, 1],
                             devices=["cpu", "cpu"], recompute="never", compile=True)
    loss = pipe.step(x, y)
    expected = sum(loss_fn(reference(part), target) * len(part) / len(x)
                   for part, target in zip(x.chunk(4), y.chunk(4)))
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    torch.testing.assert_close(model[1].state, reference[1].state)
    first, last = pipe.runtime.stages[0].compiled, pipe.runtime.stages[1].compiled
    assert first.eager == {(True,) * 3: frozenset({1})}
    assert last.eager == {(True,): frozenset()}


def test_compiling_leaves_the_models_modules_as_they_were() -> None:
    """A copy of the model after a compiled step is the plain model: no module's
    forward is replaced, no layout hook added (a replaced forward had held the
    original module, so a deepcopy computed with the pipeline's parameters)."""
    model, _ = build("mlp", dropout=0.3)
    x, y = sample("mlp", batch=8), torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=2, balance=[4, 4],
                             devices=["cpu", "cpu"], compile=True)
    pipe.step(x, y)
    for module in model.modules():
        assert "forward" not in vars(module)
        assert not any(isinstance(hook, EagerLayout) for hook in module._forward_hooks.values())
    copied = copy.deepcopy(model).eval()
    with torch.no_grad():
        copied[0].weight.add_(1.0)
        assert not torch.equal(copied(x), model.eval()(x))


class WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.cache, self.head = nn.Linear(6, 6), Caching(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cache(self.first(x)))


def test_a_traced_graph_writing_into_a_buffer_stays_eager_and_exact() -> None:
    """Compiled, torch saved the buffer itself for backward and then wrote into it, and
    backward refused it; the graph that writes stays eager, the other compiles."""
    torch.manual_seed(0)
    model = WithCache().double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=2, schedule="dualpipe-v",
                             split_at=["head"], sample=x[:4], devices=["cpu"],
                             recompute="never", compile=True)
    loss = pipe.step(x, y)
    expected = sum(loss_fn(plain(part), target) / 2
                   for part, target in zip(x.chunk(2), y.chunk(2)))
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), plain.named_parameters())
    first, last = (stage.layers[0].graphs() for stage in pipe.runtime.stages.values())
    assert not any(map(is_compiled, first)) and all(map(is_compiled, last))


def test_a_recording_counts_the_graphs_compiled_meanwhile() -> None:
    """The first step compiles each stage's graph; later steps compile nothing, other
    and uneven micro-batch sizes included (dim 0 is dynamic), but for a micro-batch of
    one row: torch specializes sizes 0 and 1, so that compiles once more, and shows."""
    model, _ = build("mlp")
    x, y = sample("mlp", batch=10), torch.randn(10, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=4, balance=[4, 3],
                             devices=["cpu", "cpu"], compile=True)
    with conveyor.record(pipe) as first:
        pipe.step(x, y)
    with conveyor.record(pipe) as later:
        pipe.step(x, y)
        pipe.step(x[:9], y[:9])  # micro-batches of 3, 2, 2, 2 rows
    with conveyor.record(pipe) as single:
        pipe.step(x[:7], y[:7])  # 2, 2, 2, 1
    assert first.compiled_graphs == 4 and later.compiled_graphs == 0
    assert single.compiled_graphs == 2
    assert conveyor.Timeline.from_dict(first.to_dict()).compiled_graphs == first.compiled_graphs


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_a_stage_whose_first_layer_writes_into_its_input_compiles_on_a_copy(
        recompute: str) -> None:
    """Generator seed 16.3, shrunk: the stage's input arrives as a leaf that requires
    grad, and its first layer is an in-place ReLU. Eager, the stage learns it from the
    error and copies its input; compiled as one graph, the probe aside finds it first
    (on a copy of the input, which it had written into before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.ReLU(inplace=True),
                          nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, chunks=2, balance=[2, 2],
                             devices=["cpu", "cpu"], recompute=recompute, compile=True)
    loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert abs(float(loss) - float(expected)) <= 1e-12 * abs(float(expected))
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    last = pipe.runtime.stages[1]
    assert last.copies_input and last.compiled.eager == {(True, True): frozenset()}


def test_a_layer_torch_cannot_compile_runs_eagerly_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """Inductor refused a conv2d block's dynamic batch size inside the generator's run
    (seed 35.1: "cannot determine truth value of Relational"): torch's error comes
    before the graph runs, so the layer runs eagerly from then on, said once."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4).double()
    call = CompiledCall(layer, "conveyor_layer_7")
    calls = []

    def refuse(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        raise torch._dynamo.exc.TorchRuntimeError("cannot determine truth value")

    call._compiled = refuse
    x = torch.randn(3, 4, dtype=torch.float64)
    with caplog.at_level("WARNING", logger="conveyor.engine.compiled.stages"):
        torch.testing.assert_close(call(x), layer(x), rtol=0, atol=0)
        torch.testing.assert_close(call(x), layer(x), rtol=0, atol=0)
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "compile=True: torch could not compile conveyor_layer_7, which runs eagerly: "
        "cannot determine truth value"]


def test_packed_sequences_of_new_lengths_recompile_in_the_first_step_only() -> None:
    """A traced GPT-2 under zero-bubble (compiled split backward), given packed
    micro-batches of a new length each: the recording shows the graphs compiled in the
    first step (a second length makes torch's graph dynamic in it) and none after, and
    each step is the plain model's in float64."""
    require("transformers")
    model, split_at, _, _ = any_models.gpt2()
    model = model.double()
    reference = copy.deepcopy(model)
    loss_of = any_models.loss_of("gpt2")
    pipe = conveyor.Pipeline(model, split_at=split_at, chunks=3, schedule="zero-bubble",
                             loss_fn=loss_of, devices=["cpu"] * (len(split_at) + 1),
                             compile=True, sample=packed(((2,),), 0)[0][0])
    plain = dict(reference.named_parameters(remove_duplicate=False))
    compiled = []
    for seed, docs in ((1, ((3, 4), (5, 2, 6), (2,))), (2, ((9,), (1, 1, 4))),
                       (3, ((11,), (8, 3), (2, 2)))):
        pipe.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        pairs = packed(docs, seed)
        with conveyor.record(pipe) as timeline:
            loss = pipe.step(microbatches=pairs)
        compiled.append(timeline.compiled_graphs)
        tokens = sum(y.numel() for _, y in pairs)
        total = sum(loss_of(reference(**x), y)[0] for x, y in pairs)
        total.backward()
        assert abs(loss.item() - total.item() / tokens) <= 1e-12 * loss.item()
        for name, p in pipe.named_parameters():
            assert relative_error(p.grad, plain[name].grad / tokens) <= 1e-10, f"{seed}: {name}"
    assert compiled[0] > 0 and compiled[1:] == [0, 0]
