"""conveyor: GPipe for PyTorch. Train a model as a pipeline of stages.

The package is layered; each part imports only those listed above it::

    errors.py     every error a user can catch
    schedules/    the action table, validator, builders, simulator, timelines  (no torch)
    engine/       one process: stages, executor, recompute, backward, watchdog
    graph/        any model cut into stages: tracing, balance, skips, weights
    distributed/  the wire and the ranks: topology, p2p, ties, data parallelism, faults/
    runtime/      what both faces run: the Runtime, its wiring, options, the step, planning,
                  re-balancing
    gpipe.py, pipeline.py, decoding.py   the faces: ``GPipe``, ``Pipeline``, ``generate``
    balance.py, skip.py                  the sub-faces ``conveyor.balance`` and ``conveyor.skip``
    observe/      what sees a run: recording, where, the per-device planner
    planner/      PipeDream's planner: cluster, profile, solver, plans
    checking/     conveyor.check: the pipeline against the plain model
    train/        conveyor train: options, data, reference models, saving
    cli/          the conveyor command
    integrations/ thin adapters to where users train: the Hugging Face Trainer (an extra)

The names below load on first use, so ``import conveyor`` and ``conveyor.schedules``
(and the simulator, ``conveyor.schedules.simulate``) work without importing torch.
"""

from __future__ import annotations

import importlib
import warnings
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
    "VocabParallelCrossEntropy": "conveyor.runtime.vocabulary",
    "tune_malloc": "conveyor.engine.allocator",
    "initialize": "conveyor.graph.weights",
    "record": "conveyor.observe.recording",
    "Rebalance": "conveyor.runtime.rebalance.policy",
    "check": "conveyor.checking.check",
    "CheckReport": "conveyor.checking.report",
    "CostModel": "conveyor.schedules.simulate",
    "Timeline": "conveyor.schedules.timeline",
    "plot_timelines": "conveyor.schedules.timeline",
    "where": "conveyor.observe.where",
    "report_on_signal": "conveyor.observe.where",
    "CheckpointError": "conveyor.train.errors",
}

# Families of names with a module of their own, as torchgpipe's: ``conveyor.balance``
# and ``conveyor.skip`` (and ``conveyor.schedules``, its tables).
_SUBFACES = ("balance", "skip", "schedules")

# Flat names that moved to a sub-face: they still work, with a DeprecationWarning,
# until 0.3.
_MOVED = {name: "balance" for name in ("LayerProfile", "balance_by_memory",
                                       "balance_by_params", "balance_by_time",
                                       "profile_layers", "solve_balance")}
_MOVED.update({name: "skip" for name in ("isolate", "pop", "skippable", "stash",
                                         "verify_skips")})

__all__ = sorted([*_errors.__all__, *_PUBLIC, *_SUBFACES])


def __getattr__(name: str) -> Any:
    if name in _SUBFACES or name in _MOVED or name in _PUBLIC:
        importlib.import_module("conveyor.torchprivate")  # refuses a torch too old
    if name in _SUBFACES:
        return importlib.import_module(f"conveyor.{name}")
    if name in _MOVED:
        face = _MOVED[name]
        warnings.warn(f"conveyor.{name} is conveyor.{face}.{name} (from conveyor.{face} "
                      f"import {name}); the flat name goes in conveyor 0.3",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"conveyor.{face}"), name)
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
