"""Skip connections in an nn.Sequential (conveyor.skip.skippable, stash, pop, isolate): the
layer list runs as a plain model, and pipelined its skips cross stages with their
gradients, equal to the plain model in float64; mismatched stashes and pops are refused
before anything is built, naming the layers."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.graph.skip import _store
from conveyor.graph.skipcut import skips_of, split_at_skips
from conveyor.errors import BalanceError, ModelError, SkipError
from tests.support.models import relative_error
from tests.support.skip_models import Dense, Pop, Stash, build, long_skip

CHUNKS = 4


@conveyor.skip.skippable(stash=["index", "nothing"])
class StashIndex(Dense):
    """Stashes an integer tensor (no gradient) and None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conveyor.skip.stash("index", x.argmax(dim=1))
        conveyor.skip.stash("nothing", None)
        return torch.tanh(self.linear(x))


@conveyor.skip.skippable(pop=["index", "nothing"])
class PopIndex(Dense):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert conveyor.skip.pop("nothing") is None
        return self.linear(x) * F.one_hot(conveyor.skip.pop("index"), 6).to(x.dtype)


def assert_same_grads(pipe: nn.Module, reference: nn.Module) -> None:
    plain = dict(reference.named_parameters())
    assert [name for name, _ in pipe.named_parameters()] == list(plain)
    for name, param in pipe.named_parameters():
        assert param.grad is not None and plain[name].grad is not None, name
        assert relative_error(param.grad, plain[name].grad) <= 1e-10, name


def assert_cut(pipe: conveyor.GPipe, model: nn.Sequential, balance: list[int]) -> None:
    """Stage k reads the parameters of the layers the balance gives it, and no others."""
    starts = [sum(balance[:k]) for k in range(len(balance) + 1)]
    for k, partition in enumerate(pipe.partitions):
        expected = {id(p) for layer in model[starts[k]:starts[k + 1]] for p in layer.parameters()}
        assert {id(p) for p in partition[0].bound_parameters()} == expected, k


def test_the_layer_list_runs_as_a_plain_model() -> None:
    model, _, inputs, _ = long_skip()
    stashed = torch.tanh(model[0].linear(inputs))
    h = stashed
    for layer in model[1:4]:
        h = layer(h)
    assert torch.equal(model(inputs), model[4].linear(h) + stashed)
    assert not _store.values
    model[0](inputs)  # alone, a layer's stash waits for a pop (torchgpipe's test_stash)
    assert len(_store.values) == 1
    assert torch.equal(model[4](h), model[4].linear(h) + stashed)
    assert not _store.values


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_a_skip_across_two_stages_equals_the_plain_model(schedule: str) -> None:
    model, reference, inputs, targets = long_skip()
    pipe = conveyor.Pipeline(model, balance=[2, 2, 1], stages=3, devices=["cpu"] * 3,
                             chunks=CHUNKS, schedule=schedule, sample=inputs[:2],
                             loss_fn=F.mse_loss)
    assert pipe.balance == [2, 2, 1]
    loss = pipe.step(inputs.detach(), targets)
    expected = F.mse_loss(reference(inputs.detach()), targets)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item()
    assert_same_grads(pipe, reference)
    assert list(pipe.state_dict()) == list(reference.state_dict())


def test_balance_by_time_profiles_layers_that_stash_and_pop() -> None:
    """Profiling runs each layer alone, several times: a pop reads its stash's value."""
    model, reference, inputs, targets = long_skip()
    pipe = conveyor.Pipeline(model, balance="time", stages=2, devices=["cpu"] * 2,
                             chunks=CHUNKS, sample=inputs[:2].detach(), loss_fn=F.mse_loss)
    assert sum(pipe.balance) == 5 and len(pipe.balance) == 2
    assert not _store.values
    loss = pipe.step(inputs.detach(), targets)
    expected = F.mse_loss(reference(inputs.detach()), targets)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item()
    assert_same_grads(pipe, reference)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpipe_sends_the_skip_and_its_gradient_in_every_checkpoint_mode(
        checkpoint: str) -> None:
    model, reference, inputs, targets = long_skip()
    pipe = conveyor.GPipe(model, balance=[2, 2, 1], sample=inputs[:2], devices=["cpu"] * 3,
                          chunks=CHUNKS, checkpoint=checkpoint)
    assert_cut(pipe, model, [2, 2, 1])
    plain_inputs = inputs.detach().clone().requires_grad_()
    F.mse_loss(pipe(inputs), targets).backward()
    F.mse_loss(reference(plain_inputs), targets).backward()
    assert_same_grads(pipe, reference)
    assert inputs.grad is not None and plain_inputs.grad is not None
    assert relative_error(inputs.grad, plain_inputs.grad) <= 1e-10
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        assert relative_error(pipe(inputs), reference(inputs)) <= 1e-12


@pytest.mark.parametrize("balance", [[3], [1, 2], [2, 1], [1, 1, 1]])
def test_1to3_under_every_balance(balance: list[int]) -> None:
    """torchgpipe's test_1to3: stash in the first of three layers, pop in the last."""
    model, reference, inputs, targets = build(Stash(), Dense(), Pop())
    pipe = conveyor.GPipe(model, balance=balance, sample=inputs[:2],
                          devices=["cpu"] * len(balance), chunks=CHUNKS)
    if len(balance) == 1:  # the skip stays in the one stage: nothing is traced
        assert [type(layer) for layer in pipe.partitions[0]] == [Stash, Dense, Pop]
    else:
        assert_cut(pipe, model, balance)
    F.mse_loss(pipe(inputs.detach()), targets).backward()
    F.mse_loss(reference(inputs.detach()), targets).backward()
    assert_same_grads(pipe, reference)


def test_an_integer_skip_and_none_cross_stages() -> None:
    model, reference, inputs, targets = build(StashIndex(), Dense(), Dense(), PopIndex())
    pipe = conveyor.Pipeline(model, balance=[1, 2, 1], stages=3, devices=["cpu"] * 3,
                             chunks=CHUNKS, schedule="1f1b", sample=inputs[:2],
                             loss_fn=F.mse_loss)
    loss = pipe.step(inputs.detach(), targets)
    expected = F.mse_loss(reference(inputs.detach()), targets)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item()
    assert_same_grads(pipe, reference)


def test_a_skip_within_a_stage_runs_the_layers_untraced() -> None:
    model, reference, inputs, targets = build(Dense(), Stash(), Pop(), Dense())
    pipe = conveyor.GPipe(model, balance=[1, 3], devices=["cpu"] * 2, chunks=CHUNKS,
                          checkpoint="always")  # no sample=: nothing to trace
    assert [type(layer).__name__ for layer in pipe.partitions[1]] == ["Stash", "Pop", "Dense"]
    F.mse_loss(pipe(inputs.detach()), targets).backward()
    F.mse_loss(reference(inputs.detach()), targets).backward()
    assert_same_grads(pipe, reference)
    assert not _store.values


def test_namespaces_pair_nested_blocks_and_a_name_is_reused_in_sequence() -> None:
    """A U-Net's levels (stash outer, stash inner, pop inner, pop outer) need a namespace
    each; blocks in sequence (stash, pop, stash, pop) may share the name."""
    isolate = conveyor.skip.isolate
    model, reference, inputs, targets = build(
        isolate(Stash(), "outer"), isolate(Stash(), "inner"), Dense(),
        isolate(Pop(), "inner"), isolate(Pop(), "outer"), Stash(), Pop())
    assert [(s.stashed_by, s.popped_by) for s in skips_of(list(model.named_children()))] \
        == [(1, 3), (0, 4), (5, 6)]
    pipe = conveyor.GPipe(model, balance=[2, 3, 2], sample=inputs[:2], devices=["cpu"] * 3,
                          chunks=CHUNKS)
    F.mse_loss(pipe(inputs.detach()), targets).backward()
    F.mse_loss(reference(inputs.detach()), targets).backward()
    assert_same_grads(pipe, reference)


def test_where_each_skip_goes() -> None:
    """torchgpipe's test_inspect_skip_layout: which skips cross, and where the cut is."""
    def layers(*modules: nn.Module) -> list[tuple[str, nn.Module]]:
        return list(nn.Sequential(*modules).named_children())

    assert skips_of(layers(Dense(), Dense())) == []
    inner = layers(Stash(), Pop(), Dense())
    assert split_at_skips(inner, [2, 1], sample=None, deferred_batch_norm=True) is None
    far = layers(Stash(), Dense(), Pop())
    assert split_at_skips(far, [1, 1, 1], sample=1, deferred_batch_norm=False) == ["1", "2"]
    both = layers(isolate_all(Stash(), "a"), isolate_all(Stash(), "b"), Dense(),
                  isolate_all(Pop(), "b"), isolate_all(Pop(), "a"))
    assert [(s.key, s.stash_path, s.pop_path) for s in skips_of(both)] == [
        (("b", "skip"), "1", "3"), (("a", "skip"), "0", "4")]
    with pytest.raises(BalanceError, match=r"layer '0' stashes 'skip' on stage 0 and layer "
                                           r"'2' pops it on stage 1: conveyor traces the "
                                           r"layers to send it; pass sample="):
        split_at_skips(far, [1, 2], sample=None, deferred_batch_norm=False)


def isolate_all(module: nn.Module, namespace: str) -> nn.Module:
    return conveyor.skip.isolate(module, namespace)


def test_verify_names_every_layer_that_does_not_match() -> None:
    @conveyor.skip.skippable(stash=["skip", "other"])
    class StashTwo(Dense):
        pass

    @conveyor.skip.skippable(pop=["skip"], stash=["next"])
    class Relay(Dense):
        pass

    @conveyor.skip.skippable(pop=["next"])
    class PopNext(Dense):
        pass

    conveyor.skip.verify_skips(nn.Sequential(Stash(), Pop(), Stash(), Pop()))  # names reused
    conveyor.skip.verify_skips(nn.Sequential(Stash(), Relay(), PopNext()))
    cases = {
        (Pop(),): r"layer '0' pops 'skip', but no layer before it stashes it",
        (Stash(),): r"layer '0' stashes 'skip', but no later layer pops it",
        (Stash(), Stash(), Pop()): r"layer '1' stashes 'skip' while the value layer '0' "
                                   r"stashed is not popped yet; .*conveyor.skip.isolate",
        (Stash(), Pop(), Pop()): r"layer '2' pops 'skip', which layer '1' popped already",
        (StashTwo(), Pop()): r"layer '0' stashes 'other', but no later layer pops it",
        (conveyor.skip.isolate(Stash(), "a"), Pop()): r"(?s)'1' pops 'skip', but no layer "
                                                 r".*'0' stashes 'skip' \(namespace 'a'\)",
        (nn.Sequential(Dense(), Stash()),): r"layer '0.1' stashes 'skip', but no later",
    }
    for layers, message in cases.items():
        with pytest.raises(SkipError, match=message):
            conveyor.skip.verify_skips(nn.Sequential(*layers))
    with pytest.raises(SkipError, match=r"do not match"):  # before anything is built
        conveyor.GPipe(nn.Sequential(Pop(), Dense()), balance=[1, 1], devices=["cpu"] * 2)
    with pytest.raises(SkipError, match=r"declares \['skip'\] both in stash= and pop="):
        conveyor.skip.skippable(stash=["skip"], pop=["skip"])
    with pytest.raises(SkipError, match=r"write stash=\['skip'\]"):
        conveyor.skip.skippable(stash="skip")
    with pytest.raises(TypeError, match=r"decorates an nn.Module class"):
        conveyor.skip.skippable(stash=["skip"])(print)  # type: ignore[arg-type]


def test_stash_and_pop_check_what_the_layer_declares() -> None:
    """torchgpipe's test_stash_pop: declared but not used, used but not declared, popped
    before any stash; and both called outside a skippable forward."""
    @conveyor.skip.skippable(stash=["skip"])
    class Silent(Dense):
        pass

    @conveyor.skip.skippable(stash=["skip"])
    class Twice(Dense):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            conveyor.skip.stash("skip", x)
            conveyor.skip.stash("skip", x)
            return x

    @conveyor.skip.skippable()
    class Undeclared(Dense):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + conveyor.skip.pop("skip")

    @conveyor.skip.skippable(pop=["skip"])
    class StashUndeclared(Dense):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            conveyor.skip.stash("skip", x)
            return x

    x = torch.zeros(2, 6)
    for layer, message in [
            (Silent(), r"Silent declares stash=\['skip'\] but its forward did not stash"),
            (Twice(), r"Twice stashes 'skip' twice in one call"),
            (Undeclared(), r"Undeclared pops 'skip', which its class does not declare \(pop"),
            (StashUndeclared(), r"StashUndeclared stashes 'skip', which its class does not"),
            (Pop(), r"Pop pops 'skip', but nothing stashed it")]:
        with pytest.raises(SkipError, match=message):
            layer(x)
    with pytest.raises(SkipError, match=r"conveyor.skip.stash\('skip'\) runs outside the forward"):
        conveyor.skip.stash("skip", x)
    with pytest.raises(SkipError, match=r"Dense has no @conveyor.skip.skippable layer"):
        conveyor.skip.isolate(Dense(), "a")
    with pytest.raises(SkipError, match=r"declares \['skip'\], not \['other'\]"):
        conveyor.skip.isolate(Stash(), "a", only=["other"])
    assert not _store.values  # Twice's first value went with its failed call


def test_a_skip_across_stages_needs_a_sample_and_per_microbatch_batch_norm() -> None:
    model, _, inputs, _ = long_skip()
    with pytest.raises(BalanceError, match=r"layer '0' stashes 'skip' on stage 0 and layer "
                                           r"'4' pops it on stage 2: .* pass sample="):
        conveyor.Pipeline(model, balance=[2, 2, 1], stages=3, devices=["cpu"] * 3,
                          chunks=CHUNKS, loss_fn=F.mse_loss)
    with pytest.raises(ModelError, match=r"a traced nn.Sequential takes one argument: give "
                                         r"each micro-batch as a tensor or a list of tensors, "
                                         r"not a tuple"):
        conveyor.GPipe(model, balance=[2, 2, 1], sample=(inputs[:2],), devices=["cpu"] * 3)
    with pytest.raises(BalanceError, match=r"drop deferred_batch_norm=True"):
        conveyor.GPipe(model, balance=[2, 2, 1], sample=inputs[:2], devices=["cpu"] * 3,
                       deferred_batch_norm=True)


def test_the_class_stays_itself() -> None:
    """No wrapper module (torchgpipe's repr is @skippable(...), its parameters under
    `module.`): the same repr, names and state dict; namespaces survive a copy and
    pickling (torchgpipe's test_namespace_copy)."""
    layer = Stash()
    assert type(layer).__name__ == "Stash" and isinstance(layer, Dense)
    assert repr(layer) == repr(Dense()).replace("Dense", "Stash")
    assert list(layer.state_dict()) == ["linear.weight", "linear.bias"]
    model = nn.Sequential(conveyor.skip.isolate(Stash(), "a"), conveyor.skip.isolate(Pop(), "a"))
    inputs = torch.randn(2, 6)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        conveyor.skip.verify_skips(twin)
        assert torch.equal(twin(inputs), model(inputs))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_nothing_stays_stashed(train: bool) -> None:
    """torchgpipe's test_leak: no value outlives the call, plain or pipelined (a traced
    pipeline runs its graph: stash and pop are not even called)."""
    model, _, inputs, _ = long_skip()
    model.train(train)
    model(inputs).sum().backward()
    assert not _store.values and not _store.calls
    pipe = conveyor.GPipe(model, balance=[2, 2, 1], sample=inputs[:2], devices=["cpu"] * 3,
                          chunks=CHUNKS)
    pipe(inputs).sum().backward()
    assert not _store.values and not _store.calls


def test_stashed_values_stay_in_their_thread() -> None:
    """torchgpipe's test_default_skip_tracker: a value stashed in one thread is not
    popped in another."""
    stash, pop = Stash(), Pop()
    inputs = torch.randn(2, 6)
    worker = threading.Thread(target=stash, args=(inputs,))
    worker.start()
    worker.join()
    with pytest.raises(SkipError, match=r"nothing stashed it"):
        pop(inputs)

