"""Schedules as data: the action table, its text form and validator, and its builders.

Imports nothing from torch, so tables can be built, checked and simulated anywhere.
"""

from __future__ import annotations

from conveyor.schedules.builders import (
    SCHEDULES,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from conveyor.schedules.clock import layout_clock, render_clock
from conveyor.schedules.table import (
    Action,
    Edge,
    Kind,
    Message,
    Schedule,
    actions_of,
    dependencies,
    parse,
)
from conveyor.schedules.validator import validate

__all__ = [
    "Action",
    "Edge",
    "Kind",
    "Message",
    "SCHEDULES",
    "Schedule",
    "actions_of",
    "build",
    "dependencies",
    "gpipe",
    "interleaved_1f1b",
    "layout_clock",
    "one_f_one_b",
    "parse",
    "render_clock",
    "validate",
    "zero_bubble_h1",
]
