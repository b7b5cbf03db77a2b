"""Seeing into a pipeline: the simulator and timelines (no torch), recording, the planner.

Nothing is imported here, so ``conveyor.observe.simulate`` loads without torch.
"""

__all__: list[str] = []
