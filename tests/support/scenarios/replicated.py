"""PipeDream's replicated stages over 3 processes (``data_parallel=[2, 1]`` and
``[1, 2]``): equivalence with the plain model, clipping, a forward alone, micro-batches
the caller made, and a replicated stage's state (deferred batch norm pooled, any other
change refused); and, beside them, a plain pipeline's refusal of gradients NaN on one
rank. One launch serves every check (tests/test_replicated_stages.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from tests.support.cases import case_batch, case_model, lengths_batch, padded_batch, token_loss
from tests.support.models import relative_error
from tests.support.scenarios import scenario


def _grads(pipe: conveyor.Pipeline) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}


#: (model, schedule, replicas per stage, chunks) of the ``replicated_stages`` scenario:
#: a replicated first stage holding the LM's tied embedding, a replicated last stage
#: dealt an odd number of micro-batches, and zero-bubble's split backward.
REPLICATED = [("lm", "1f1b", (2, 1), 4), ("lm", "zero-bubble", (2, 1), 4),
              ("mlp", "gpipe", (1, 2), 5), ("mlp", "zero-bubble", (1, 2), 3)]


@scenario("replicated_stages")
def replicated_stages(rank: int, world: int, out_dir: Path) -> None:
    """PipeDream's replicated stages: one pipeline of 3 processes, every rank stepping
    on the same batch; the token loss too, and a forward without backward. Then a
    replicated stage's batch norm (:func:`replicated_state`)."""
    for model_name, schedule, replicas, chunks in REPLICATED:
        model, loss_fn = case_model(model_name)
        pipe = conveyor.Pipeline(model, chunks=chunks, schedule=schedule, loss_fn=loss_fn,
                                 data_parallel=list(replicas), timeout=30)
        x, y = case_batch(model_name)
        with conveyor.record(pipe) as timeline:
            loss = pipe.step(x, y)
        result: dict[str, Any] = {
            "loss": loss, "grads": _grads(pipe), "eval": pipe.eval_step(x),
            "ran": sorted((e.rank, e.stage, e.kind, e.microbatch) for e in timeline.events),
            "norm": pipe.clip_grad_norm_(1e9, float("inf") if schedule == "gpipe" else 2.0)}
        if model_name == "lm":  # padding differs between the replicas' micro-batches
            pipe.zero_grad(set_to_none=True)
            pipe.loss_fn = token_loss
            x, y = padded_batch()
            result["token_loss"] = pipe.step(x, y)
            result["token_grads"] = _grads(pipe)
        torch.save(result, out_dir / f"{model_name}-{schedule}-rank{rank}.pt")
    given_microbatches(rank, out_dir)
    replicated_state(rank, out_dir)
    torch.save(nan_gradients_on_rank_0(), out_dir / f"nan-rank{rank}.pt")


def given_microbatches(rank: int, out_dir: Path) -> None:
    """Micro-batches of their own lengths, given by the caller, through the replicated
    pipeline (stage 0's rank tells the others how many)."""
    model, loss_fn = case_model("lm")
    pipe = conveyor.Pipeline(model, chunks=4, schedule="1f1b", loss_fn=loss_fn,
                             data_parallel=[2, 1], timeout=30)
    loss = pipe.step(microbatches=lengths_batch())
    torch.save({"loss": loss, "grads": _grads(pipe)}, out_dir / f"given-rank{rank}.pt")


def nan_gradients_on_rank_0() -> dict[str, object]:
    """A step whose loss is finite but whose gradients are NaN on rank 0's stage alone
    (a pipeline of 3 stages, no ties, no replicas: the check's flags ride in the loss's
    all-reduce; in this launch, which the quick suite runs): every rank
    refuses it, naming stage 0, and keeps the gradients it had; the next step is the
    plain model's. Returns what this rank saw."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2)).double()
    plain = copy.deepcopy(model)
    pipe = conveyor.Pipeline(model, chunks=2, schedule="1f1b", timeout=30,
                             loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    poisoned = [pipe.topology.pipeline_rank == 0]
    if poisoned[0]:
        next(pipe.parameters()).register_hook(
            lambda g: g * float("nan") if poisoned[0] else g)
    try:
        pipe.step(x, y)
        refused = ""
    except conveyor.NonFiniteGradientError as exc:
        refused = str(exc)
    kept = [p.grad is None for p in pipe.parameters()]
    poisoned[0] = False
    pipe.step(x, y)
    nn.functional.mse_loss(plain(x), y).backward()
    expected = dict(plain.named_parameters())
    worst = max(relative_error(p.grad, expected[name].grad)
                for name, p in pipe.named_parameters())
    return {"refused": refused, "kept": kept, "worst": worst}


def batch_norm_mlp() -> nn.Sequential:
    """A batch norm in the first stage of two (a layer each but the norm's)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()


def replicated_state(rank: int, out_dir: Path) -> None:
    """A replicated stage's batch norm: deferred, its statistics pooled over the
    replicas; plain, refused on every rank (its running statistics would differ)."""
    x, y = case_batch("mlp")
    result: dict[str, Any] = {}
    for deferred in (True, False):
        pipe = conveyor.Pipeline(batch_norm_mlp(), chunks=4, balance=[2, 1],
                                 loss_fn=F.mse_loss, data_parallel=[2, 1],
                                 deferred_batch_norm=deferred, timeout=30)
        try:
            result[f"loss{deferred}"] = pipe.step(x, y)
        except conveyor.ConveyorError as exc:
            result[f"error{deferred}"] = str(exc)
        result[f"state{deferred}"] = {k: v.clone() for k, v in pipe.state_dict().items()}
        result[f"grads{deferred}"] = _grads(pipe)
    torch.save(result, out_dir / f"state-rank{rank}.pt")
