"""Seeing into a run: recording its steps as timelines, where the ranks stand in a
running step, and the planner. (The simulator and timelines are the schedules', in
``conveyor.schedules``: they need no torch; ``observe.simulate`` and ``observe.trace``
warn and lead there.)
"""

__all__: list[str] = []
