"""Moved to :mod:`conveyor.schedules.timeline` (the simulator and timelines import no torch
and sit with the table); this name works for one more release, with a warning."""

from __future__ import annotations

import warnings

from conveyor.schedules.timeline import *  # noqa: F403 - the names as they were
from conveyor.schedules.timeline import __all__ as __all__

warnings.warn("conveyor.observe.trace moved to conveyor.schedules.timeline; import it from there",
              DeprecationWarning, stacklevel=2)
