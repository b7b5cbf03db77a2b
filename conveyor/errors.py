"""Typed errors: each names what was wrong, the values involved, and how to fix it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BalanceError",
    "ConfigError",
    "ConveyorError",
    "LayerOutputError",
    "MicroBatchError",
    "ModelError",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "PeerFailure",
    "RendezvousError",
    "SaveError",
    "ScheduleError",
    "SkipError",
    "StageError",
    "StepTimeout",
    "TensorParallelError",
    "VerificationError",
]


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


class BalanceError(ConveyorError, ValueError):
    """A partition (``balance``, ``devices``) does not fit the model."""


class ModelError(ConveyorError, ValueError):
    """The model cannot be pipelined as given (e.g. a layer name shadows an attribute)."""


class SkipError(ModelError):
    """The skip connections of an ``nn.Sequential`` do not match: a pop with no earlier
    stash, a stash never popped, a name stashed again before it is popped, or a
    ``stash``/``pop`` a layer's ``@skippable`` does not declare."""


class MicroBatchError(ConveyorError, ValueError):
    """A batch cannot be split into micro-batches, or outputs cannot be gathered."""


class ScheduleError(ConveyorError, ValueError):
    """A schedule table is malformed, incomplete or deadlocks, or a cost model cannot
    drive it."""


class LayerOutputError(ConveyorError, TypeError):
    """A layer returned something other than a tensor or a nested structure of tensors."""


class StageError(ConveyorError, RuntimeError):
    """An action failed on a stage; the original exception is the ``__cause__``.

    Attributes:
        stage: index of the stage whose action failed.
        action: the failed action, printed like ``1F3`` (stage 1, forward, micro-batch 3).
        microbatch: the micro-batch the action worked on.
        layer: global index of the failing layer, when it is known.
        where: the hang report of the step: where every rank stood when it failed
            (also added to the exception as a note, which tracebacks show).
    """

    where: str | None = None

    def __init__(
        self,
        message: str,
        *,
        stage: int,
        microbatch: int,
        action: str,
        layer: int | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
        self.action = action
        self.layer = layer


class PeerFailure(StageError):
    """Another rank failed, died or stopped answering; this rank stops too.

    Attributes:
        report: where the failure started (rank, stage, action, micro-batch, error),
            passed on unchanged when this rank tells its own peers.
    """

    report: dict[str, Any] | None = None


class StepTimeout(StageError, TimeoutError):
    """A step stopped moving: a rank waited for a message, or ran one action, longer
    than the pipeline's timeout. In one process the stuck rank's thread is left
    running and the pipeline refuses further steps; ``where`` says where each rank
    stood."""


class RendezvousError(ConveyorError, ConnectionError):
    """The process group could not be joined in time: the store's address did not answer
    or refused, or a rank did not arrive; the message names the address and the rank."""


class NonFiniteLossError(ConveyorError, FloatingPointError):
    """The loss of a micro-batch is NaN or infinite (``check_finite=True``)."""


class NonFiniteGradientError(ConveyorError, FloatingPointError):
    """A step's gradients are NaN or infinite (``conveyor train`` checks before every
    optimizer step); the message names the stages that hold them."""


class TensorParallelError(ModelError):
    """A tensor-parallel plan cannot split the model as asked: a style conveyor does
    not implement, a module it does not fit, or a size the tensor group does not divide."""


class ConfigError(ConveyorError, ValueError):
    """A command's option (``conveyor train``, ``conveyor simulate``) is out of range or
    contradicts another one, or ``--out`` cannot be used (a file, not writable, or in use
    by another run); or the ranks of a job were started with different pipelines."""


class VerificationError(ConveyorError, ArithmeticError):
    """A step of the user's own run, re-run through the unpartitioned computation
    (``Pipeline(verify_every=N)``), differs from what the pipeline computed; the message
    names the step and the first tensor that differs, by how much, and the tolerance.

    Attributes:
        step: the step (counted from 1) that was verified.
        tensor: the name of the first tensor that differs ("loss", or a parameter's).
    """

    def __init__(self, message: str, *, step: int, tensor: str) -> None:
        super().__init__(message)
        self.step, self.tensor = step, tensor


def add_note(exc: BaseException, note: str) -> None:
    """Adds ``note`` to an exception kept as is (shown in the traceback on Python 3.11+).

    Several stages may note the same exception; each note is added once.
    """
    notes = getattr(exc, "__notes__", None)
    if notes is not None and note in notes:
        return
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: keep the note where 3.11 would
        exc.__notes__ = [*(notes or []), note]  # type: ignore[attr-defined]


class SaveError(ConveyorError, RuntimeError):
    """What was to be written could not be (a checkpoint or a run's summary, e.g. on a
    full disk: the message says which checkpoint is still intact, the ``OSError`` is the
    ``__cause__``), or would replace what is there (an export into a folder that is not
    empty): nothing is written."""
