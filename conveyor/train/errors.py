"""The errors of the training app (``conveyor train``, its checkpoints and run folder),
exported from ``conveyor`` beside the library's own (:mod:`conveyor.errors`)."""

from __future__ import annotations

from conveyor.errors import ConveyorError

__all__ = ["CheckpointError", "SaveError"]


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint is missing, unreadable, or made for another model."""


class SaveError(ConveyorError, RuntimeError):
    """A run's output (a checkpoint, its summary) could not be written, e.g. on a full
    disk; the message says which checkpoint is still intact. The ``OSError`` is the
    ``__cause__``."""
