"""conveyor: GPipe for PyTorch. Train a model as a pipeline of stages.

The package is layered; each subpackage imports only those listed above it::

    schedules/    the action table, validator, builders              (no torch)
    engine/       one process: stages, executor, recompute, GPipe
    distributed/  many processes: topology, p2p, ties, Pipeline
    observe/      simulator and timelines (no torch), recording, planner
    train/        conveyor train: options, data, reference models, saving
    cli/          the conveyor command

The names below load on first use, so ``import conveyor.schedules`` (and the simulator
built on it) works without importing torch. The short module paths users know
(``conveyor.simulate``, ``conveyor.models``, ``conveyor.saving`` ...) stay importable.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from conveyor.engine.allocator import tune_malloc
from conveyor.errors import (
    BalanceError,
    CheckpointError,
    ConfigError,
    ConveyorError,
    LayerOutputError,
    MicroBatchError,
    ModelError,
    NonFiniteLossError,
    PeerFailure,
    SaveError,
    ScheduleError,
    SkipError,
    StageError,
    StepTimeout,
)

if TYPE_CHECKING:
    from conveyor.pipeline import Pipeline
    from conveyor.engine.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
    from conveyor.gpipe import GPipe
    from conveyor.graph.balance import (
        LayerProfile,
        balance_by_memory,
        balance_by_params,
        balance_by_time,
        profile_layers,
        solve_balance,
    )
    from conveyor.engine.recompute import is_recomputing
    from conveyor.graph.weights import initialize
    from conveyor.graph.skip import isolate, pop, skippable, stash, verify_skips
    from conveyor.observe.check import CheckReport, check
    from conveyor.observe.rebalance_policy import Rebalance
    from conveyor.observe.recording import record
    from conveyor.observe.simulate import CostModel
    from conveyor.observe.trace import Timeline, plot_timelines
    from conveyor.observe.where import report_on_signal, where
    from conveyor.schedules import Schedule

__version__ = "0.1.0"

_LAZY = {
    "DeferredBatchNorm": "conveyor.engine.batchnorm",
    "convert_deferred_batch_norm": "conveyor.engine.batchnorm",
    "is_recomputing": "conveyor.engine.recompute",
    "LayerProfile": "conveyor.graph.balance",
    "balance_by_memory": "conveyor.graph.balance",
    "balance_by_params": "conveyor.graph.balance",
    "balance_by_time": "conveyor.graph.balance",
    "profile_layers": "conveyor.graph.balance",
    "solve_balance": "conveyor.graph.balance",
    "GPipe": "conveyor.gpipe",
    "initialize": "conveyor.graph.weights",
    "isolate": "conveyor.graph.skip",
    "pop": "conveyor.graph.skip",
    "skippable": "conveyor.graph.skip",
    "stash": "conveyor.graph.skip",
    "verify_skips": "conveyor.graph.skip",
    "Pipeline": "conveyor.pipeline",
    "Schedule": "conveyor.schedules",
    "record": "conveyor.observe.recording",
    "Rebalance": "conveyor.observe.rebalance_policy",
    "check": "conveyor.observe.check",
    "CheckReport": "conveyor.observe.check",
    "CostModel": "conveyor.observe.simulate",
    "Timeline": "conveyor.observe.trace",
    "plot_timelines": "conveyor.observe.trace",
    "where": "conveyor.observe.where",
    "report_on_signal": "conveyor.observe.where",
}

# Public modules by their short names: ``conveyor.simulate`` is conveyor.observe.simulate.
_MODULES = {
    "simulate": "conveyor.observe.simulate",
    "trace": "conveyor.observe.trace",
    "plan": "conveyor.observe.plan",
    "models": "conveyor.train.models",
    "data": "conveyor.train.data",
    "saving": "conveyor.train.saving",
}

__all__ = [
    "BalanceError",
    "CheckReport",
    "CheckpointError",
    "ConfigError",
    "ConveyorError",
    "CostModel",
    "DeferredBatchNorm",
    "GPipe",
    "LayerOutputError",
    "LayerProfile",
    "MicroBatchError",
    "ModelError",
    "NonFiniteLossError",
    "PeerFailure",
    "Pipeline",
    "Rebalance",
    "SaveError",
    "Schedule",
    "ScheduleError",
    "SkipError",
    "StageError",
    "StepTimeout",
    "Timeline",
    "balance_by_memory",
    "balance_by_params",
    "balance_by_time",
    "check",
    "convert_deferred_batch_norm",
    "initialize",
    "is_recomputing",
    "isolate",
    "plot_timelines",
    "pop",
    "profile_layers",
    "record",
    "report_on_signal",
    "skippable",
    "solve_balance",
    "stash",
    "tune_malloc",
    "verify_skips",
    "where",
]


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Lets ``import conveyor.simulate`` load and return conveyor.observe.simulate itself
    (one module object under two names, never a second copy)."""

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, short = fullname.partition(".")
        if prefix != __name__ or short not in _MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_MODULES[spec.name.partition(".")[2]])
        self._specs[spec.name] = module.__spec__  # importing the alias replaces it
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module ran when it was imported under its own name: give back its spec.
        module.__spec__ = self._specs.pop(module.__spec__.name if module.__spec__ else "", None)


if not any(isinstance(finder, _ShortNames) for finder in sys.meta_path):
    sys.meta_path.append(_ShortNames())


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
