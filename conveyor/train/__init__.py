"""``conveyor train`` and what it stands on: options, data, reference models, the loop,
and saving (verified checkpoints, in ``checkpoints/``).

Nothing is imported here, so the command line can read its options without torch.
"""

__all__: list[str] = []
