"""``conveyor.balance``: how many consecutive layers each stage of a sequence holds.

::

    from conveyor.balance import balance_by_time

    balance = balance_by_time(model, sample, stages=4)    # e.g. [5, 6, 6, 7]
    pipe = conveyor.GPipe(model, balance=balance, chunks=8)

Each ``balance_by_*`` minimises the costliest stage exactly over every contiguous cut
(and, among the cuts that reach it, evens out the others): by parameters, by forward and
backward time on a sample, or by memory. ``profile_layers`` gives the figures they
use, one :class:`LayerProfile` per layer; ``solve_balance`` cuts any list of costs.
A pipeline takes ``balance="time"`` (or None, by parameters) and does this itself.
"""

from __future__ import annotations

from conveyor.graph.balance import (
    balance_by_memory,
    balance_by_params,
    balance_by_time,
    solve_balance,
)
from conveyor.graph.profile import LayerProfile, profile_layers

__all__ = ["LayerProfile", "balance_by_memory", "balance_by_params", "balance_by_time",
           "profile_layers", "solve_balance"]
