"""Multi-process scenario of model directories: a tied Llama on the meta device reads its
weights from a sharded directory (each rank noting the shards it opened), trains a step
and is saved back as a model directory by both ranks."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import conveyor
from tests.support.any_models import CHUNKS, llama, loss_of, sample_of, tied_llama
from tests.support.scenarios import scenario


class _Opened(logging.Handler):
    """The names of the files conveyor's weight reader opened (its DEBUG line)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.files: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("weights: opening ") and record.args:
            self.files.append(Path(str(record.args[0])).name)  # type: ignore[index]


@scenario("model_directories")
def model_directories(rank: int, world: int, out_dir: Path) -> None:
    _, _, inputs, targets = llama()
    with torch.device("meta"):
        meta = type(tied_llama())(tied_llama().config)
    logger, opened = logging.getLogger("conveyor"), _Opened()
    level = logger.level
    logger.addHandler(opened)
    logger.setLevel(logging.DEBUG)
    try:
        pipe = conveyor.Pipeline(meta, split_at=["model.layers.2"], sample=sample_of(inputs),
                                 chunks=CHUNKS, loss_fn=loss_of("llama"),
                                 weights=out_dir / "sharded", timeout=60)
    finally:
        logger.removeHandler(opened)
        logger.setLevel(level)
    loaded = {k: v.clone() for k, v in pipe.state_dict().items()}
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.step(inputs, targets)
    optimizer.step()
    pipe.save_pretrained(out_dir / "saved")
    torch.save({"opened": opened.files, "loaded": loaded, "trained": pipe.state_dict()},
               out_dir / f"rank{rank}.pt")
