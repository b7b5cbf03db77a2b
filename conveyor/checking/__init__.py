"""``conveyor.check``, in its room: finding where a pipeline stops matching the plain model, and why.

It runs the plain model and the pipeline (every stage in this process, on an explicit
topology) on one batch in float64, compares every layer's output and gradient, and names
the first difference and its likely cause.
"""

__all__: list[str] = []
