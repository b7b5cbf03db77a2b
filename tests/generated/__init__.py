"""Proof by generator: random models, cut at random, on every schedule and option, each
compared with the plain model in float64.

``python -m tests.generated --seed N`` reruns one case; ``--count`` runs many (``make
fuzz``). tests/test_generated.py runs a fixed sample in CI.
"""
