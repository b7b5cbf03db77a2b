"""The wire and the ranks: topology, the point-to-point transport and its envelopes,
watched receives, tied weights across ranks, data parallelism (replicas or FSDP2) and
gradients across ranks; what a rank reports when another fails is in ``faults/``.
"""

__all__: list[str] = []
