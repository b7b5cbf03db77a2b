"""PipeDream's replicated stages over 3 processes (``data_parallel=[2, 1]`` and
``[1, 2]``): equivalence with the plain model, clipping, a forward alone, micro-batches
the caller made, and a replicated stage's state (deferred batch norm pooled, any other
change refused). One launch serves every check (tests/test_distributed.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from tests.support.cases import case_batch, case_model, lengths_batch, padded_batch, token_loss
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


def given_microbatches(rank: int, out_dir: Path) -> None:
    """Micro-batches of their own lengths, given by the caller, through the replicated
    pipeline (stage 0's rank tells the others how many)."""
    model, loss_fn = case_model("lm")
    pipe = conveyor.Pipeline(model, chunks=4, schedule="1f1b", loss_fn=loss_fn,
                             data_parallel=[2, 1], timeout=30)
    loss = pipe.step(microbatches=lengths_batch())
    torch.save({"loss": loss, "grads": _grads(pipe)}, out_dir / f"given-rank{rank}.pt")


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
