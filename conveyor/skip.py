"""``conveyor.skip``: skip connections in an ``nn.Sequential``, across stages.

::

    from conveyor.skip import pop, skippable, stash

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            stash("skip", x)
            return self.pool(x)

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, x):
            return self.conv(self.upsample(x) + pop("skip"))

A layer stashes a value and a later one pops it, on the same stage or a later one (the
pipeline carries it, and its gradient back). Nested pairs that reuse a name get a
namespace each with :func:`isolate`; :func:`verify_skips` checks the names of a model
before it is cut. How it works: :mod:`conveyor.graph.skip`.
"""

from __future__ import annotations

from conveyor.graph.skip import isolate, pop, skippable, stash
from conveyor.graph.skipcut import verify_skips

__all__ = ["isolate", "pop", "skippable", "stash", "verify_skips"]
