"""Re-balancing a running pipeline: the policy that decides when and to what balance
(``policy``), the measuring and agreeing (``rebalancing``), and moving layers with their
optimizer state (``moves``, ``optimizer``).
"""

__all__: list[str] = []
