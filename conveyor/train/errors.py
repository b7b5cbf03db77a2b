"""The errors of the training app (``conveyor train``, its checkpoints and run folder),
exported from ``conveyor`` beside the library's own (:mod:`conveyor.errors`)."""

from __future__ import annotations

from conveyor.errors import ConveyorError
from conveyor.errors import SaveError as SaveError  # imported from here before it moved

__all__ = ["CheckpointError"]  # and SaveError, from conveyor.errors (export raises it too)


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint is missing, unreadable, or made for another model."""
