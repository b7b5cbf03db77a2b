"""What the tests share, kept out of the test modules (no ``test_*.py`` imports another).

- ``models``: small float64 models (MLP, CNN, Transformer) and gradient comparisons.
- ``user_models``: models as a user hands them over, and ``conveyor plan --model`` targets.
- ``any_models``: models nobody here wrote (Hugging Face from small configurations, a
  U-Net), with their batches, losses and plain-model reference steps.
- ``crossing_models``: models whose values cross stages past the next one.
- ``skip_models``: nn.Sequential layers that stash and pop a skip connection.
- ``check_cases``: models with one planted cause of divergence, for ``conveyor check``.
- ``cases``: the deep MLP and tied-embedding LM, their batches and losses, run by the
  multi-process scenarios and compared with in one process.
- ``saved_bytes``: what each rank holds for backward, counted as a step runs (the
  planner's memory against it).
- ``training``: ``conveyor train`` in a test (tiny flags, its checkpoint, its error line).
- ``extras``: an optional dependency for a test (skip, or fail under ``make test``).
- ``launch``: runs commands and multi-process scenarios from the repository root.
- ``scenarios``: what each process of a multi-process test does, registered by name
  (``python -m tests.support.scenarios NAME OUT_DIR`` is the worker).
- ``elastic_worker``: ``conveyor train`` behind a gate, for torchrun in test_elastic.

The fixtures shared by test modules are in ``tests/conftest.py``.
"""
