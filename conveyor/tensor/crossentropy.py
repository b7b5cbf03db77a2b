"""The cross-entropy of logits split by vocabulary, each part held by its own rank or
device, computed without putting the logits together (Megatron's vocabulary-parallel
cross-entropy).

Part r holds the logits ``z_r`` of vocabulary rows ``lo_r .. hi_r - 1``::

    m = max over parts of max(z_r)           s = sum over parts of sum(exp(z_r - m))
    t = the target's logit (from the part that holds its row)
    loss = log s + m - t                      d loss / d z_r = exp(z_r - m) / s - onehot_r

Two faces use it: a head split over a stage's tensor group (``tensor_parallel`` with
``loss_fn=VocabParallelCrossEntropy``: :func:`parallel_cross_entropy`, the group's sums
as bounded all-reduces), and the head split over the pipeline's ranks
(:mod:`conveyor.runtime.vocabulary`, which joins the same pieces across its shards).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from conveyor.distributed.faults import collective
from conveyor.tensor.apply import Group
from conveyor.torchprivate import process_group_named

__all__: list[str] = []


def exp_sum(z: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Per token, the sum of ``exp(z - top)`` over a part's logits."""
    return (z - top.to(z.device)[:, None]).exp().sum(dim=1)


def target_logit(z: torch.Tensor, targets: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per token, its target's logit where the target is among rows ``lo .. hi - 1``
    of a part, else 0."""
    targets = targets.to(z.device)
    inside = (targets >= lo) & (targets < hi)
    value = z.gather(1, (targets - lo).clamp(0, hi - lo - 1)[:, None]).squeeze(1)
    return torch.where(inside, value, torch.zeros_like(value))


def token_losses(top: torch.Tensor, total: torch.Tensor, picked: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """Per token, ``log sum exp - target logit`` (0 where ``valid`` is false)."""
    per_token = total.log() + top - picked
    return torch.where(valid, per_token, torch.zeros_like(per_token))


def logit_grad(z: torch.Tensor, top: torch.Tensor, total: torch.Tensor, targets: torch.Tensor,
               weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The gradient of ``sum(weight * token losses)`` in a part's logits: its part of
    the softmax, less 1 at each target among its rows, times each token's weight."""
    device = z.device
    grad_z = (z - top.to(device)[:, None]).exp() / total.to(device)[:, None]
    targets = targets.to(device)
    rows = ((targets >= lo) & (targets < hi)).nonzero().squeeze(1)
    grad_z[rows, targets[rows] - lo] -= 1
    return grad_z * weight.to(device)[:, None]


def parallel_cross_entropy(z: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                           group: Group) -> torch.Tensor:
    """The summed cross-entropy of the tokens ``valid`` marks, from this tensor rank's
    logits ``z`` (tokens x its vocabulary rows, part ``group.rank`` of ``group.size``
    equal parts), differentiable in ``z``. A collective: every rank of the group calls
    it alike (three all-reduces of one value per token)."""
    loss: torch.Tensor = _GroupCrossEntropy.apply(z, targets, valid, group)
    return loss


class _GroupCrossEntropy(torch.autograd.Function):
    """Forward sums the group's parts; backward is each rank's own part, local."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                group: Group) -> torch.Tensor:
        width = z.shape[1]
        lo, hi = group.rank * width, (group.rank + 1) * width
        wide = z.to(torch.promote_types(z.dtype, torch.float32))  # a softmax's sum
        top = _over(wide.amax(dim=1), group, "the logits' max", dist.ReduceOp.MAX)
        total = _over(exp_sum(wide, top), group, "the softmax's sum")
        picked = _over(target_logit(wide, targets, lo, hi), group, "the target logits")
        ctx.save_for_backward(wide, top, total, targets, valid)
        ctx.rows, ctx.dtype = (lo, hi), z.dtype
        return token_losses(top, total, picked, valid).sum().to(z.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        wide, top, total, targets, valid = ctx.saved_tensors
        weight = valid.to(wide.dtype) * grad.to(wide.dtype)
        grad_z = logit_grad(wide, top, total, targets, weight, *ctx.rows)
        return grad_z.to(ctx.dtype), None, None, None


def _over(value: torch.Tensor, group: Group, what: str, op: Any = None) -> torch.Tensor:
    value = value.detach().contiguous().clone()
    collective.all_reduce(value, group=process_group_named(group.name), seconds=group.seconds,
                          what=f"the tensor group's cross-entropy: {what}", op=op)
    return value
