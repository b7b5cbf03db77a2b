"""Schedules as data: the action table, its text form and validator, its builders, and
what is computed from a table alone: the simulator (``schedules.simulate``) and
timelines (``schedules.timeline``).

Imports nothing from torch, so tables can be built, checked and simulated anywhere.
"""

from __future__ import annotations

from conveyor.schedules.builders import (
    SCHEDULES,
    V_SHAPES,
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
from conveyor.schedules.vmemory import v_half, v_min
from conveyor.schedules.vshape import dualpipe_v, v_stages, zero_bubble_v

__all__ = [
    "Action",
    "Edge",
    "Kind",
    "Message",
    "SCHEDULES",
    "Schedule",
    "V_SHAPES",
    "actions_of",
    "build",
    "dependencies",
    "dualpipe_v",
    "gpipe",
    "interleaved_1f1b",
    "layout_clock",
    "one_f_one_b",
    "parse",
    "render_clock",
    "v_half",
    "v_min",
    "v_stages",
    "validate",
    "zero_bubble_h1",
    "zero_bubble_v",
]
