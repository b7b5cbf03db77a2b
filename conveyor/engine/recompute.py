"""Re-materialization: which micro-batches a stage recomputes in backward, and how.

In forward, a checkpointed stage keeps only its input; in backward it runs its layers
again to rebuild the activations. conveyor uses torch.utils.checkpoint (non-reentrant),
with two additions: layers can ask :func:`is_recomputing`, and running statistics of
normalisation layers (batch norm) are not updated a second time by the recomputation.
Random numbers are replayed by :mod:`conveyor.engine.rng`, so the checkpoint does not stash
generator states itself.

torch.utils.checkpoint rebuilds the graph inside each backward call that needs it. A
split backward is two calls, I and later W, so it would recompute the stage twice; the
stage rebuilds that graph itself instead, once, under :class:`Recomputation`, and
keeps it from I to W (see ``Stage._rebuilt``).

The mode is the pipelines' ``recompute=`` option; ``checkpoint=``, torchgpipe's name for
it, is accepted as an alias (:func:`recompute_mode`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = ["is_recomputing"]

RecomputeMode = Literal["always", "except_last", "never"]
RECOMPUTE_MODES: tuple[str, ...] = ("always", "except_last", "never")

_local = threading.local()


def is_recomputing() -> bool:
    """Whether the calling thread is recomputing a forward pass for backward.

    A layer with side effects in forward (counting, logging, caching) can skip them
    during recomputation, which runs its forward a second time on the same input.
    """
    return getattr(_local, "depth", 0) > 0


def recompute_mode(recompute: str | None, checkpoint: str | None) -> str:
    """The recompute mode of a pipeline given ``recompute=`` or its alias
    ``checkpoint=`` (default ``"except_last"``, as the paper).

    Raises:
        ValueError: both are given, or an unknown mode; the message lists the known ones.
    """
    if recompute is not None and checkpoint is not None:
        raise ValueError(f"recompute={recompute!r} and checkpoint={checkpoint!r}: "
                         "checkpoint= is another name for recompute=; give one of them")
    named = "checkpoint" if checkpoint is not None else "recompute"
    mode = checkpoint if checkpoint is not None else recompute or "except_last"
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"{named}={mode!r} is not a recompute mode; use one of "
            + ", ".join(repr(m) for m in RECOMPUTE_MODES)
        )
    return mode


def recomputes(mode: str, microbatch: int, num_microbatches: int) -> bool:
    """Whether ``microbatch`` is recomputed in backward under ``mode``.

    ``except_last`` (the paper's choice) keeps the activations of the last micro-batch,
    whose backward comes right after its forward in a fill-drain schedule.
    """
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != num_microbatches - 1
    return False


def running_stat_layers(layers: nn.Module) -> list[nn.Module]:
    """Normalisation layers that update running statistics in training."""
    return [
        m for m in layers.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    ]


class Recomputation:
    """Context of one recomputation (entered again for each).

    Recomputing runs batch norm's forward again, which would update its running
    statistics a second time per micro-batch. For the length of the recomputation each
    normalisation layer works on copies of its buffers, and gets its own tensors back
    on exit. Putting the tensors back, rather than copying old values into them, leaves
    their version counters alone: a micro-batch that was not recomputed (under
    ``except_last``, while other micro-batches recompute before its backward under
    1F1B) still finds the running statistics its batch norm saved for backward as they
    were.
    """

    def __init__(self, norms: Sequence[nn.Module]) -> None:
        self._norms = norms
        self._saved: list[list[dict[str, torch.Tensor | None]]] = []

    def __enter__(self) -> None:
        originals = []
        for module in self._norms:
            buffers = dict(module._buffers)
            originals.append(buffers)
            for name, buffer in buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.detach().clone()
        self._saved.append(originals)
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1
        for module, buffers in zip(self._norms, self._saved.pop()):
            module._buffers.update(buffers)


def checkpointed(function: Callable[[Any], Any], inputs: Any, norms: Sequence[nn.Module]) -> Any:
    """Runs ``function(inputs)`` keeping only ``inputs``; backward recomputes the rest."""
    return torch_checkpoint(
        function,
        inputs,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=lambda: (contextlib.nullcontext(), Recomputation(norms)),
    )
