"""Where stages run: the runtime both faces build (threads of one process, or processes
under torchrun), topology, the point-to-point transport, bounded collectives and hang
reports across ranks, tied weights across ranks, data parallelism (replicas or FSDP2),
clipping, and re-balancing a running pipeline.
"""

__all__: list[str] = []
