"""A stage's backward: which gradient goes with which output (``routing``), the split
into an input gradient (``I``) and a weight gradient (``W``) (``weightgrad``), and
weight gradients that add themselves into ``.grad`` (``accumulation``).
"""

__all__: list[str] = []
