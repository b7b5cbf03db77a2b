"""conveyor: GPipe for PyTorch. Train a model as a pipeline of stages.

The package is layered; each part imports only those listed above it::

    errors.py     every error a user can catch
    schedules/    the action table, validator, builders              (no torch)
    engine/       one process: stages, executor, recompute, watchdog
    graph/        any model cut into stages: tracing, balance, skips, weights
    distributed/  where stages run: the runtime, topology, p2p, ties, re-balancing
    gpipe.py, pipeline.py   the two faces: ``GPipe`` and ``Pipeline``
    observe/      simulator and timelines (no torch), recording, planner, check
    train/        conveyor train: options, data, reference models, saving
    cli/          the conveyor command

The names below load on first use, so ``import conveyor`` and ``conveyor.schedules``
(and the simulator, ``conveyor.schedules.simulate``) work without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from conveyor import errors as _errors
from conveyor.errors import *  # noqa: F403 - the library's errors, as errors.__all__ lists them

__version__ = "0.1.0"

# The public names beyond the library's errors (``errors.__all__``), by the module that
# defines them: the one list. They load on first use.
_PUBLIC = {
    "GPipe": "conveyor.gpipe",
    "Pipeline": "conveyor.pipeline",
    "generate": "conveyor.decoding",
    "Schedule": "conveyor.schedules",
    "DeferredBatchNorm": "conveyor.engine.batchnorm",
    "convert_deferred_batch_norm": "conveyor.engine.batchnorm",
    "is_recomputing": "conveyor.engine.recompute.replay",
    "token_loss": "conveyor.engine.loss",
    "tune_malloc": "conveyor.engine.allocator",
    "LayerProfile": "conveyor.graph.profile",
    "balance_by_memory": "conveyor.graph.balance",
    "balance_by_params": "conveyor.graph.balance",
    "balance_by_time": "conveyor.graph.balance",
    "profile_layers": "conveyor.graph.profile",
    "solve_balance": "conveyor.graph.balance",
    "initialize": "conveyor.graph.weights",
    "isolate": "conveyor.graph.skip",
    "pop": "conveyor.graph.skip",
    "skippable": "conveyor.graph.skip",
    "stash": "conveyor.graph.skip",
    "verify_skips": "conveyor.graph.skipcut",
    "record": "conveyor.observe.recording",
    "Rebalance": "conveyor.runtime.rebalance.policy",
    "check": "conveyor.checking.check",
    "CheckReport": "conveyor.checking.check",
    "CostModel": "conveyor.schedules.simulate",
    "Timeline": "conveyor.schedules.timeline",
    "plot_timelines": "conveyor.schedules.timeline",
    "where": "conveyor.observe.where",
    "report_on_signal": "conveyor.observe.where",
    "CheckpointError": "conveyor.train.errors",
    "SaveError": "conveyor.train.errors",
}

__all__ = sorted([*_errors.__all__, *_PUBLIC])


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
