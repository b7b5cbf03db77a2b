"""conveyor: GPipe for PyTorch. Train an ``nn.Sequential`` as a pipeline of stages.

The names below load on first use, so ``import conveyor.schedules`` (and the simulator
built on it) works without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from conveyor.allocator import tune_malloc
from conveyor.errors import (
    BalanceError,
    ConveyorError,
    LayerOutputError,
    MicroBatchError,
    ScheduleError,
    StageError,
)

if TYPE_CHECKING:
    from conveyor.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
    from conveyor.checkpoint import is_recomputing
    from conveyor.partition import (
        LayerProfile,
        balance_by_memory,
        balance_by_params,
        balance_by_time,
        profile_layers,
        solve_balance,
    )
    from conveyor.pipe import GPipe
    from conveyor.pipeline import Pipeline
    from conveyor.recording import record
    from conveyor.schedules import Schedule
    from conveyor.simulate import CostModel
    from conveyor.trace import Timeline, plot_timelines

__version__ = "0.1.0"

_LAZY = {
    "DeferredBatchNorm": "conveyor.batchnorm",
    "convert_deferred_batch_norm": "conveyor.batchnorm",
    "is_recomputing": "conveyor.checkpoint",
    "LayerProfile": "conveyor.partition",
    "balance_by_memory": "conveyor.partition",
    "balance_by_params": "conveyor.partition",
    "balance_by_time": "conveyor.partition",
    "profile_layers": "conveyor.partition",
    "solve_balance": "conveyor.partition",
    "GPipe": "conveyor.pipe",
    "Pipeline": "conveyor.pipeline",
    "Schedule": "conveyor.schedules",
    "record": "conveyor.recording",
    "CostModel": "conveyor.simulate",
    "Timeline": "conveyor.trace",
    "plot_timelines": "conveyor.trace",
}

__all__ = [
    "BalanceError",
    "ConveyorError",
    "CostModel",
    "DeferredBatchNorm",
    "GPipe",
    "LayerOutputError",
    "LayerProfile",
    "MicroBatchError",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "StageError",
    "Timeline",
    "balance_by_memory",
    "balance_by_params",
    "balance_by_time",
    "convert_deferred_batch_norm",
    "is_recomputing",
    "plot_timelines",
    "profile_layers",
    "record",
    "solve_balance",
    "tune_malloc",
]


# Submodules reachable as attributes without importing them first (conveyor.saving...).
_SUBMODULES = {"data", "models", "plan", "saving", "schedules", "simulate", "trace"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"conveyor.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
