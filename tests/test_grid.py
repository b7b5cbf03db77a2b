"""The equivalence grid on the models users bring: batch norm under every schedule and
checkpoint mode, layers random in eval mode, token losses over padded batches, ties, and
gradients accumulated over several steps. Under Pipeline as under GPipe."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
import conveyor.train.models
from conveyor.engine.microbatch import split
from tests.support.cases import (
    PAD,
    case_batch,
    case_model,
    padded_batch,
    plain_token_loss,
    token_loss,
)
from tests.support.models import assert_same_grads, paired, relative_error

MODES = ["always", "except_last", "never"]
# (schedule, virtual stages, ranks): every schedule on two ranks.
SCHEDULES = [("gpipe", 1, 2), ("1f1b", 1, 2), ("zero-bubble", 1, 2), ("interleaved-1f1b", 2, 2),
             ("zb-v", 2, 2), ("dualpipe-v", 2, 2)]  # the V shapes: two stages per rank too
CHUNKS = 4


# --------------------------------------------------------------------- batch norm

def convnet() -> nn.Sequential:
    torch.manual_seed(0)
    return conveyor.train.models.convnet(cells=4, channels=4).double()


def images(batch: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(batch, 3, 8, 8, dtype=torch.float64, generator=generator) * 2 + 1,
            torch.randint(0, 10, (batch,), generator=generator))


def norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class PerMicroBatch:
    """The plain model over the micro-batches, one after another (batch norm normalises
    each by its own statistics), outputs concatenated.

    Without deferral the running statistics update once per micro-batch, as they do in
    the pipeline. With deferral they must update once per step, from every input each
    batch norm saw over the step, pooled: :meth:`fold_deferred` (after backward, which
    needs the statistics as forward left them) computes that update from first
    principles.
    """

    def __init__(self, model: nn.Sequential) -> None:
        self.model = model
        self.seen: dict[nn.Module, list[torch.Tensor]] = defaultdict(list)
        self.before = {m: (m.running_mean.clone(), m.running_var.clone(),
                           m.num_batches_tracked.clone()) for m in norms(model)}

    def __call__(self, x: torch.Tensor, chunks: int) -> torch.Tensor:
        hooks = [m.register_forward_pre_hook(
            lambda m, args: self.seen[m].append(args[0].detach())) for m in norms(self.model)]
        try:
            return torch.cat([self.model(part) for part in split(x, chunks)])
        finally:
            for hook in hooks:
                hook.remove()

    @torch.no_grad()
    def fold_deferred(self) -> None:
        if not self.model.training:
            return
        for m, (mean, var, tracked) in self.before.items():
            pooled = torch.cat(self.seen[m]).transpose(0, 1).flatten(1)  # channels x values
            momentum = m.momentum if m.momentum is not None else 1.0 / float(tracked + 1)
            m.running_mean.copy_((1 - momentum) * mean + momentum * pooled.mean(1))
            m.running_var.copy_((1 - momentum) * var + momentum * pooled.var(1))
            m.num_batches_tracked.copy_(tracked + 1)


def assert_same_buffers(pipe: nn.Module, reference: nn.Module) -> None:
    buffers = dict(reference.named_buffers())
    names = [name for name, _ in pipe.named_buffers()]
    assert names == list(buffers) and names
    for name, value in pipe.named_buffers():
        assert relative_error(value.double(), buffers[name].double()) <= 1e-10, name


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("deferred", [False, True], ids=["plain-bn", "deferred-bn"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("schedule", "virtual", "ranks"), SCHEDULES)
def test_batch_norm_under_every_schedule(schedule: str, virtual: int, ranks: int,
                                         checkpoint: str, deferred: bool,
                                         training: bool) -> None:
    model = convnet().train(training)
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=ranks, devices=["cpu"] * ranks, chunks=CHUNKS,
                             schedule=schedule, virtual_stages=virtual,
                             checkpoint=checkpoint, loss_fn=nn.CrossEntropyLoss(),
                             deferred_batch_norm=deferred)
    x, y = images()
    for _ in range(2):  # the second step starts from the first one's statistics
        loss = pipe.step(x, y)
        run = PerMicroBatch(reference)
        expected = F.cross_entropy(run(x, CHUNKS), y)
        expected.backward()
        if deferred:
            run.fold_deferred()
        assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert_same_buffers(pipe, reference)
    if not training:  # in eval mode the micro-batches do not matter: the plain model
        assert torch.equal(reference.state_dict()["0.1.running_mean"], torch.zeros(4))
        assert relative_error(pipe.eval_step(x), reference(x)) <= 1e-12


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("deferred", [False, True], ids=["plain-bn", "deferred-bn"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_batch_norm_under_gpipe(checkpoint: str, deferred: bool, training: bool) -> None:
    model = convnet().train(training)
    reference = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [2, 4], devices=["cpu"] * 2, chunks=CHUNKS,
                          checkpoint=checkpoint, deferred_batch_norm=deferred)
    x, y = images()
    for _ in range(2):
        F.cross_entropy(pipe(x), y).backward()
        run = PerMicroBatch(reference)
        F.cross_entropy(run(x, CHUNKS), y).backward()
        if deferred:
            run.fold_deferred()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters())
    assert_same_buffers(pipe, reference)


# --------------------------------------------------------- random in eval mode too

class Noise(nn.Module):
    """Multiplicative noise, drawn in training and in eval mode alike (as MC dropout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 0.5 * torch.randn_like(x))


def noisy_chain() -> nn.Sequential:
    # No biases and a loss linear in the output: the loss is homogeneous of degree 1 in
    # every weight W, so loss == <W, dloss/dW> exactly, if and only if the gradient
    # belongs to the forward that gave the loss (the same noise).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=False), Noise(), nn.Linear(8, 8, bias=False),
                         Noise(), nn.Linear(8, 8, bias=False), Noise(),
                         nn.Linear(8, 3, bias=False)).double()


def linear_loss(output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (output * weights).sum()


def assert_gradients_belong_to_the_loss(model: nn.Module, loss: torch.Tensor) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        inner = float((p.detach() * p.grad).sum())
        assert abs(inner - float(loss)) <= 1e-10 * abs(float(loss)), name


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("schedule", "virtual", "ranks"), SCHEDULES)
def test_recomputation_replays_layers_random_in_eval_mode(schedule: str, virtual: int,
                                                          ranks: int, checkpoint: str,
                                                          training: bool) -> None:
    model = noisy_chain().train(training)
    pipe = conveyor.Pipeline(model, stages=ranks, devices=["cpu"] * ranks, chunks=CHUNKS,
                             schedule=schedule, virtual_stages=virtual,
                             checkpoint=checkpoint, loss_fn=linear_loss)
    x = torch.randn(8, 6, dtype=torch.float64)
    loss = pipe.step(x, torch.randn(8, 3, dtype=torch.float64))
    assert_gradients_belong_to_the_loss(pipe, loss)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_gpipe_recomputation_replays_layers_random_in_eval_mode(checkpoint: str,
                                                                training: bool) -> None:
    model = noisy_chain().train(training)
    pipe = conveyor.GPipe(model, [3, 4], devices=["cpu"] * 2, chunks=CHUNKS,
                          checkpoint=checkpoint)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    loss = linear_loss(pipe(x), torch.randn(8, 3, dtype=torch.float64))
    loss.backward()
    loss = loss.detach()
    assert_gradients_belong_to_the_loss(pipe, loss)
    assert abs(float((x.detach() * x.grad).sum()) - float(loss)) <= 1e-10 * abs(float(loss))


def test_eval_mode_inference_draws_from_torch_generators_like_the_plain_model() -> None:
    model = noisy_chain().eval()
    pipe = conveyor.GPipe(copy.deepcopy(model), [7], devices=["cpu"], chunks=1)
    assert not pipe.training  # a pipeline starts in its model's mode
    x = torch.randn(8, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.manual_seed(4)
        pipelined = pipe(x)
        torch.manual_seed(4)
        plain = model(x)
    assert torch.equal(pipelined, plain)


# ---------------------------------------------------------- token losses, padding

@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("schedule", "virtual", "ranks"), SCHEDULES)
def test_token_loss_over_padding_equals_the_plain_model(schedule: str, virtual: int,
                                                        ranks: int, checkpoint: str) -> None:
    model, _ = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=ranks, devices=["cpu"] * ranks, chunks=CHUNKS,
                             schedule=schedule, virtual_stages=virtual,
                             checkpoint=checkpoint, loss_fn=token_loss)
    x, y = padded_batch()
    loss = pipe.step(x, y)
    expected = plain_token_loss(reference(x), y)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    assert_same_grads(pipe.named_parameters(), reference.named_parameters(
        remove_duplicate=False))


def test_a_scalar_token_loss_is_weighted_by_samples_not_tokens() -> None:
    # Why the pair exists: the same loss averaged per micro-batch is weighted wrongly.
    model, _ = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=CHUNKS,
                             loss_fn=plain_token_loss)
    x, y = padded_batch()
    loss = pipe.step(x, y)
    expected = plain_token_loss(reference(x), y)
    assert abs(loss.item() - expected.item()) > 1e-3 * abs(expected.item())


def test_gpipe_token_loss_is_the_users_own() -> None:
    model, _ = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.GPipe(model, [3, 3], devices=["cpu"] * 2, chunks=CHUNKS)
    x, y = padded_batch()
    plain_token_loss(pipe(x), y).backward()
    plain_token_loss(reference(x), y).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters(
        remove_duplicate=False))


def test_token_loss_errors_name_the_micro_batch() -> None:
    model, _ = case_model("lm")
    x, y = padded_batch()

    def pipe_with(loss_fn: object) -> conveyor.Pipeline:
        return conveyor.Pipeline(copy.deepcopy(model), stages=2, devices=["cpu"] * 2,
                                 chunks=CHUNKS, loss_fn=loss_fn)

    with pytest.raises(conveyor.ConveyorError, match=r"whose count is -1 on micro-batch 0"):
        pipe_with(lambda out, t: (token_loss(out, t)[0], -1)).step(x, y)
    with pytest.raises(conveyor.ConveyorError,
                       match=r"returned a scalar for micro-batch 2 but not for micro-batch"):
        pipe_with(lambda out, t: token_loss(out, t) if t.shape[0] == 3 else
                  plain_token_loss(out, t)).step(x, y)
    everything_padded = torch.full_like(y, PAD)
    pipe = pipe_with(token_loss)
    with pytest.raises(conveyor.ConveyorError, match=r"counts add up to 0 over the whole batch"):
        pipe.step(x, everything_padded)
    assert all(p.grad is None for p in pipe.parameters())  # a failed step leaves no trace


# ------------------------------------------------------- accumulation over steps

@pytest.mark.parametrize("loss", ["scalar", "pair"])
def test_gradients_accumulate_over_steps_with_tied_weights(loss: str) -> None:
    model, scalar_loss = case_model("lm")
    reference = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2,
                             schedule="1f1b", loss_fn=token_loss if loss == "pair" else scalar_loss)
    for seed in range(3):
        x, y = padded_batch(seed) if loss == "pair" else case_batch("lm", seed=seed)
        pipe.step(x, y)
        (plain_token_loss if loss == "pair" else scalar_loss)(reference(x), y).backward()
    assert_same_grads(pipe.named_parameters(), reference.named_parameters(
        remove_duplicate=False))


def test_a_failed_step_leaves_the_accumulated_gradients_as_they_were() -> None:
    model, loss_fn = case_model("mlp")
    pipe = conveyor.Pipeline(model, stages=2, devices=["cpu"] * 2, chunks=2, loss_fn=loss_fn,
                             check_finite=True)
    x, y = case_batch("mlp")
    pipe.step(x, y)
    before = [p.grad.clone() for p in pipe.parameters()]
    y[7] = float("nan")  # the second micro-batch's loss is NaN
    with pytest.raises(conveyor.NonFiniteLossError):
        pipe.step(x, y)
    for p, grad in paired(pipe.parameters(), before):
        assert torch.equal(p.grad, grad)
