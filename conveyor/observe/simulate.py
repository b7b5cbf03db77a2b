"""Moved to :mod:`conveyor.schedules.simulate` (the simulator and timelines import no torch
and sit with the table); this name works for one more release, with a warning."""

from __future__ import annotations

import warnings

from conveyor.schedules.simulate import *  # noqa: F403 - the names as they were
from conveyor.schedules.simulate import __all__ as __all__

warnings.warn("conveyor.observe.simulate moved to conveyor.schedules.simulate; import it from there",
              DeprecationWarning, stacklevel=2)
