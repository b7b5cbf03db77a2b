"""``conveyor train --check``: one step of the run's pipeline beside the plain model,
before any training, as ``conveyor check`` runs it (float64 copies, one CPU thread per
stage). Under torchrun every process checks the same step alike, so all stop together."""

from __future__ import annotations

import os

import torch

from conveyor.errors import ConveyorError
from conveyor.checking.check import check
from conveyor.train.language import summed_next_token_loss
from conveyor.train.options import TrainConfig
from conveyor.train.user.corpus import read_data
from conveyor.train.user.model import build_model

__all__: list[str] = []


def check_first_step(config: TrainConfig) -> None:
    """Checks the first step of the run ``config`` describes; prints the report (rank 0).

    The model is built as the run builds it (same seed, same weights) and checked on the
    first batch of one pipeline (its replica's share, with ``--data-parallel``); torch's
    random state is left as it was.

    Raises:
        ConveyorError: the pipeline differs from the plain model.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(config.seed)
        built = build_model(config, materialize=True)
    inputs, targets = read_data(config, built, show=False).windows(
        0, config.batch, config.length, seed=config.seed)
    replicas = config.data_parallel
    report = check(built.model, inputs[::replicas], targets[::replicas],
                   loss_fn=summed_next_token_loss, stages=config.stages, chunks=config.chunks,
                   schedule=config.schedule, virtual_stages=config.virtual_stages,
                   checkpoint=config.recompute(), balance=config.balance(), seed=config.seed)
    if os.environ.get("RANK", "0") == "0":
        print(report, flush=True)
    if not report.ok:
        raise ConveyorError("--check: the pipeline does not compute what the plain model "
                            "does (the report above says where); nothing was trained")
