"""Re-materialization: which micro-batches a stage recomputes in backward, and how.

In forward, a checkpointed stage keeps only its input; in backward it runs its layers
again to rebuild the activations. conveyor uses torch.utils.checkpoint (non-reentrant),
with two additions: layers can ask :func:`is_recomputing`, and the recomputation sees the
state of the stage's modules (buffers, tensor and plain attributes) as the forward saw
it and leaves it as it finds it (:mod:`conveyor.engine.recompute.sideeffects`), so batch norm's
running statistics, a step counter or an exponential average are neither read advanced
nor advanced a second time.
Random numbers are replayed by :mod:`conveyor.engine.recompute.rng`, so the checkpoint does not stash
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

from torch.utils.checkpoint import checkpoint as torch_checkpoint

from conveyor.engine.recompute.sideeffects import ModuleState, SideEffects

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


def recompute_mode(recompute: str | Sequence[str] | None,
                   checkpoint: str | Sequence[str] | None) -> str | tuple[str, ...]:
    """The recompute mode of a pipeline given ``recompute=`` or its alias
    ``checkpoint=`` (default ``"except_last"``, as the paper): one mode for every
    stage, or a list of one per stage (as a plan chooses: ``["never", "always"]``).

    Raises:
        ValueError: both are given, or an unknown mode; the message lists the known ones.
    """
    if recompute is not None and checkpoint is not None:
        raise ValueError(f"recompute={recompute!r} and checkpoint={checkpoint!r}: "
                         "checkpoint= is another name for recompute=; give one of them")
    named = "checkpoint" if checkpoint is not None else "recompute"
    mode = checkpoint if checkpoint is not None else recompute or "except_last"
    modes = [mode] if isinstance(mode, str) else list(mode)
    for one in modes:
        if one not in RECOMPUTE_MODES:
            which = f"{named}={one!r}" if isinstance(mode, str) else f"{named}={mode!r}: {one!r}"
            raise ValueError(
                f"{which} is not a recompute mode; use one of "
                + ", ".join(repr(m) for m in RECOMPUTE_MODES)
                + ("" if isinstance(mode, str) else ", or a list of them, one per stage")
            )
    if not modes:
        raise ValueError(f"{named}=[] names no mode; give one, or one per stage")
    return mode if isinstance(mode, str) else tuple(modes)


def check_stage_modes(mode: str | tuple[str, ...], stages: int) -> None:
    """Raises ValueError unless ``mode`` is one mode or one per stage of ``stages``."""
    if not isinstance(mode, str) and len(mode) != stages:
        raise ValueError(f"recompute={list(mode)} gives {len(mode)} modes for {stages} "
                         "stages; give one mode, or one per stage")


def recomputes(mode: str | tuple[str, ...], microbatch: int, num_microbatches: int,
               stage: int = 0) -> bool:
    """Whether ``microbatch`` is recomputed in backward on ``stage`` under ``mode``.

    ``except_last`` (the paper's choice) keeps the activations of the last micro-batch,
    whose backward comes right after its forward in a fill-drain schedule.
    """
    if not isinstance(mode, str):
        mode = mode[stage]
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != num_microbatches - 1
    return False


class Recomputation:
    """Context of one recomputation (entered again for each): the module state the
    first forward saw put in place, and what was there put back on exit (see
    :mod:`conveyor.engine.recompute.sideeffects`). Putting tensors back, rather than copying
    values into them, leaves their version counters alone: a micro-batch that was not
    recomputed (under ``except_last``, while other micro-batches recompute before its
    backward under 1F1B) still finds the buffers its forward saved for backward as
    they were.
    """

    def __init__(self, effects: SideEffects) -> None:
        self._effects = effects
        self._current: list[list[Any]] = []

    def __enter__(self) -> None:
        self._current.append(self._effects.put_before())
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1
        self._effects.put_back(self._current.pop())


def checkpointed(function: Callable[[Any], Any], inputs: Any,
                 state: ModuleState) -> tuple[Any, SideEffects]:
    """Runs ``function(inputs)`` keeping only ``inputs``; backward recomputes the rest,
    with the module state the forward saw. Returns the outputs and what the forward
    changed in ``state``'s modules."""
    effects = SideEffects()

    def first_or_again(x: Any) -> Any:
        if is_recomputing():  # torch.utils.checkpoint runs it again in backward
            return function(x)
        return state.run(function, x, effects)

    outputs = torch_checkpoint(
        first_or_again,
        inputs,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=lambda: (contextlib.nullcontext(), Recomputation(effects)),
    )
    return outputs, effects
