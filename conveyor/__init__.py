"""conveyor: GPipe for PyTorch. Train an ``nn.Sequential`` as a pipeline of stages."""

from __future__ import annotations

from conveyor.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from conveyor.checkpoint import is_recomputing
from conveyor.errors import (
    BalanceError,
    ConveyorError,
    LayerOutputError,
    MicroBatchError,
    ScheduleError,
    StageError,
)
from conveyor.partition import (
    LayerProfile,
    balance_by_memory,
    balance_by_params,
    balance_by_time,
    profile_layers,
    solve_balance,
)
from conveyor.pipe import GPipe

__version__ = "0.1.0"

__all__ = [
    "BalanceError",
    "ConveyorError",
    "DeferredBatchNorm",
    "GPipe",
    "LayerOutputError",
    "LayerProfile",
    "MicroBatchError",
    "ScheduleError",
    "StageError",
    "balance_by_memory",
    "balance_by_params",
    "balance_by_time",
    "convert_deferred_batch_norm",
    "is_recomputing",
    "profile_layers",
    "solve_balance",
]
