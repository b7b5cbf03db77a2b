"""What both faces stand on: the runtime of one pipeline in this process (its stages,
table, transport and executor, wired for threads or for ranks), the options object,
the step's work after its actions, planning the table, and re-balancing while training
(policy and mechanism, in ``rebalance/``).
"""

__all__: list[str] = []
