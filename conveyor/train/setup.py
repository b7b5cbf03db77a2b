"""How ``conveyor train`` trains the model it built (:mod:`conveyor.train.user.model`):
its pipeline on this machine's devices (or, under torchrun, this process's), AdamW and
its learning-rate schedule."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from conveyor.engine.devices import absent
from conveyor.errors import ConfigError
from conveyor.pipeline import Pipeline
from conveyor.runtime.rebalance.policy import Rebalance
from conveyor.train.language import summed_next_token_loss
from conveyor.train.models import TRANSFORMER_TP_PLAN
from conveyor.train.options import TrainConfig
from conveyor.train.user.model import BuiltModel

__all__: list[str] = []


def build(config: TrainConfig,
          built: BuiltModel) -> tuple[Pipeline, torch.optim.Optimizer, Any]:
    """The model's pipeline (its weights read from its directory, if it has them),
    AdamW, and its schedule: linear warm-up, cosine decay."""
    pipe = Pipeline(built.model, stages=config.stages, chunks=config.chunks,
                    schedule=config.schedule, virtual_stages=config.virtual_stages,
                    checkpoint=config.recompute(),
                    balance=config.balance(),
                    devices=stage_devices(config),
                    data_parallel=config.replicas() or config.data_parallel,
                    tensor_parallel=config.tensor_parallel, tp_plan=tensor_plan(config),
                    sharding="fsdp" if config.shard else "replicate",
                    loss_fn=summed_next_token_loss, check_finite=True,
                    timeout=config.timeout or None, verify_every=config.verify_every or None,
                    rebalance=Rebalance() if config.rebalance else None,
                    weights=str(built.weights) if built.weights is not None else None,
                    sample=None if isinstance(built.model, nn.Sequential) else sample(config))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=config.lr, weight_decay=0.01)
    pipe.attach_optimizer(optimizer)  # re-balancing moves its state with the layers

    def rate(step: int) -> float:
        warm = min(1.0, (step + 1) / config.warmup)
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))

    return pipe, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, rate)


def tensor_plan(config: TrainConfig) -> str | dict[str, str] | None:
    """How ``--tensor-parallel`` splits the run's model: the bundled Transformer's
    feed-forward layers (:data:`~conveyor.train.models.TRANSFORMER_TP_PLAN`), any other
    model by its own plan (a Hugging Face model's); None without tensor parallelism."""
    if config.tensor_parallel == 1:
        return None
    return "auto" if config.model else dict(TRANSFORMER_TP_PLAN)


def sample(config: TrainConfig) -> torch.Tensor:
    """One micro-batch of token ids as the run's model takes it, to trace the model by
    (every rank alike, under torchrun too)."""
    rows = max(1, config.batch // (config.data_parallel * config.chunks))
    return torch.zeros(rows, config.length, dtype=torch.long)


def stage_devices(config: TrainConfig) -> list[torch.device] | None:
    """The device of each pipeline rank in one process (None under torchrun, where
    each process has its own).

    Raises:
        ConfigError: ``--devices`` names a device that does not exist, or not one per
            stage.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if config.devices != "auto":
            raise ConfigError("under torchrun each process uses its own device (its "
                              "LOCAL_RANK's GPU, else the CPU); leave out --devices")
        return None
    if config.devices == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", s % gpus) if gpus else torch.device("cpu")
                for s in range(config.stages)]
    names = config.devices.split(",")
    if len(names) == 1:
        names = names * config.stages
    if len(names) != config.stages:
        raise ConfigError(f"--devices names {len(names)} devices for {config.stages} stages; "
                          "give one for all, or one per stage")
    devices = []
    for name in names:
        try:
            device = torch.device(name.strip())
        except RuntimeError as exc:
            raise ConfigError(f"--devices: {name!r} is not a device (cpu, cuda, cuda:1, "
                              "...)") from exc
        if (missing := absent(device)) is not None:
            raise ConfigError(f"--devices: {missing}")
        devices.append(device)
    return devices
