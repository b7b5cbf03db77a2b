"""The engine: what runs a pipelined step in one process.

Micro-batches, stages, the executor that walks a schedule's table, the local transport,
recomputation, random streams, the weight-gradient split, deferred batch norm, devices.
"""

__all__: list[str] = []
