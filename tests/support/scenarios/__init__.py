"""What each process of a multi-process test does, registered by name.

A scenario is a function ``(rank, world, out_dir) -> None``, recorded in
:data:`SCENARIOS` by the :func:`scenario` decorator of the module that defines it:
``pipeline`` (equivalence, data parallel, faults, models nobody here wrote, direct
sends), ``replicated`` (stages with replicas), ``fsdp``, ``hang``, ``rebalance`` and
``modeldir`` (model directories read and saved). A
test starts one with ``tests.support.launch.launch(NAME, world, out_dir)``; each of its
processes runs ``python -m tests.support.scenarios NAME OUT_DIR`` (``__main__.py``),
which imports those modules and calls ``SCENARIOS[NAME]``.

This package imports none of the scenario modules, and they import none of each other:
what two of them share (models, batches, losses) is in ``tests.support.cases`` (the
Hugging Face models of the tensor-parallel and FSDP ones: ``tests.support.tensor_cases``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Scenario = Callable[[int, int, Path], None]

#: Every registered scenario by name, filled as the scenario modules are imported.
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    """Registers the decorated function as the scenario ``name`` (a name once only).

    Also callable on a function made elsewhere: ``scenario("hang_loop")(_stopping(...))``.
    """
    def register(run: Scenario) -> Scenario:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is registered twice: by "
                             f"{SCENARIOS[name].__module__} and {run.__module__}")
        SCENARIOS[name] = run
        return run
    return register
