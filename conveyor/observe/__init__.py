"""Seeing into a pipeline: the simulator and timelines (no torch), recording, where the
ranks stand, and the planner.

Nothing is imported here, so ``conveyor.schedules.simulate`` loads without torch.
"""

__all__: list[str] = []
