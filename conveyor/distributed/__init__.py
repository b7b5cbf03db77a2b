"""Pipelines over processes (torchrun): topology, the point-to-point transport, a rank's
own layers, tied weights across ranks, data-parallel averaging and clipping; ``Pipeline``.
"""

__all__: list[str] = []
