"""Deferred batch norm: running statistics over the whole mini-batch, not each micro-batch.

In training, batch norm normalises each micro-batch by its own statistics, as in the
paper. Plain batch norm would also update its running mean and variance once per
micro-batch, from micro-batch statistics; :class:`DeferredBatchNorm` instead pools the
statistics of all micro-batches of a step (Chan's parallel algorithm, so it is as
accurate as one pass over the whole batch) and updates the running estimates once, when
the pipeline calls :meth:`DeferredBatchNorm.commit` at the end of the step. After a step
they equal those of the unpartitioned model on the whole mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.recompute.replay import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A batch norm of any input rank whose running statistics update once per step.

    Its parameters and persistent buffers are those of ``nn.BatchNorm{1,2,3}d``, so a
    state dict moves freely between the two.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self._pending_count = 0
        self._pending_mean: torch.Tensor | None = None
        self._pending_m2: torch.Tensor | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm expects input of shape (N, C, ...), got {input.dim()}D"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        if not is_recomputing():
            self._pool(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _pool(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        m2 = var * count
        if self._pending_mean is None or self._pending_m2 is None:
            self._pending_count, self._pending_mean, self._pending_m2 = count, mean, m2
            return
        total = self._pending_count + count
        delta = mean - self._pending_mean
        self._pending_mean = self._pending_mean + delta * (count / total)
        self._pending_m2 = (
            self._pending_m2 + m2 + delta.square() * (self._pending_count * count / total)
        )
        self._pending_count = total

    @torch.no_grad()
    def commit(self) -> None:
        """Folds the pooled statistics of this step into the running estimates."""
        mean, m2, count = self._pending_mean, self._pending_m2, self._pending_count
        self.discard()
        if mean is None or m2 is None or self.running_mean is None or self.running_var is None:
            return
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        unbiased = m2 / max(count - 1, 1)
        self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean)
        self.running_var.copy_(factor * unbiased + (1 - factor) * self.running_var)

    @torch.no_grad()
    def merge_pooled(self, reduce: Callable[[torch.Tensor], None]) -> None:
        """Pools the statistics other processes pooled for this layer with this one's
        (replicas of a stage, each given some of the micro-batches): ``reduce`` sums a
        float64 tensor over them, in place. Sums of n, n·mean and m2 + n·mean², which
        give the pooled mean and m2 of all their rows."""
        if self.running_mean is None:
            return
        features = self.running_mean.numel()
        packed = torch.zeros(1 + 2 * features, dtype=torch.float64,
                             device=self.running_mean.device)
        if self._pending_mean is not None and self._pending_m2 is not None:
            count, mean = self._pending_count, self._pending_mean.to(torch.float64)
            packed[0] = count
            packed[1:1 + features] = count * mean
            packed[1 + features:] = self._pending_m2.to(torch.float64) + count * mean.square()
        reduce(packed)
        count = int(packed[0].item())
        if count == 0:
            return
        mean = packed[1:1 + features] / count
        m2 = packed[1 + features:] - count * mean.square()
        dtype = self.running_mean.dtype
        self._pending_count, self._pending_mean, self._pending_m2 = \
            count, mean.to(dtype), m2.to(dtype)

    def discard(self) -> None:
        """Forgets statistics pooled since the last commit (after a failed step)."""
        self._pending_count, self._pending_mean, self._pending_m2 = 0, None, None


_CONVERTIBLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replaces every ``nn.BatchNorm{1,2,3}d`` in ``module`` by a DeferredBatchNorm.

    The new layers share the old ones' parameters and buffers (an optimizer built
    before keeps working). Children are replaced in place; the converted module is
    returned (a new object only if ``module`` itself is a batch norm).
    """
    if isinstance(module, _CONVERTIBLE) and not isinstance(module, DeferredBatchNorm):
        deferred = DeferredBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine,
            module.track_running_stats,
        )
        for name, value in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]:
            setattr(deferred, name, value)
        deferred.train(module.training)
        return deferred
    for name, child in module.named_children():
        converted = convert_deferred_batch_norm(child)
        if converted is not child:
            setattr(module, name, converted)
    return module
