"""Gradients of one pipelined call, kept apart from those accumulated before it.

A call's backward runs into empty ``.grad`` fields, with what the parameters held
before set aside. The call can then work on its own gradients alone (sum the copies of
a tied weight, divide by a token count, average over data-parallel replicas) before
they are added to the earlier ones, as autograd would have added them; a call that
fails leaves ``.grad`` as it found it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__: list[str] = []


class SetAside:
    """Sets the ``.grad`` of ``params`` aside (to None) until :meth:`restore` or
    :meth:`add_back`."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._held: list[tuple[nn.Parameter, torch.Tensor | None]] = [
            (p, p.grad) for p in params]
        for p, _ in self._held:
            p.grad = None

    def restore(self) -> None:
        """Puts back the gradients held before, dropping what the call computed."""
        for p, earlier in self._held:
            p.grad = earlier

    def add_back(self) -> None:
        """Adds the gradients held before to the call's own (in place, as autograd
        accumulates)."""
        for p, earlier in self._held:
            if earlier is None:
                continue
            if p.grad is None:
                p.grad = earlier
            else:
                p.grad = earlier.add_(p.grad)
