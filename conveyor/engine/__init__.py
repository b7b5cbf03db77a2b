"""The engine: what runs a pipelined step in one process.

Micro-batches, stages and what each action means for them, the executor that walks a
schedule's table, the local transport, recomputation with its random streams and module
state (``recompute/``), the backward's routing, split and accumulation (``backward/``),
timeouts and hang reports (``watchdog/``), compiling, deferred batch norm, devices.
"""

__all__: list[str] = []
