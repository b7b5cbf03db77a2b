"""``conveyor train --tensor-parallel 2`` in one torchrun launch of 4 processes, for
tests/test_train_tensor.py: several runs one after another in the same processes (the
process group kept between them), each rank noting the gradient norm of every step.

Run as ``python -m tests.support.tensor_train OUT MODEL DATA`` (torchrun ``-m``). In
OUT: ``whole`` (a Hugging Face Llama, 2 stages x 2 tensor ranks, 6 steps, exported to
``exported``), ``split``
(the same stopped by a signal after step 4 and resumed), ``reshaped`` (the checkpoint
of step 4 resumed as 2 stages x 2 replicas, no tensor parallelism), ``bundled`` (the
bundled Transformer, 2 stages x 2 tensor ranks), ``norms-rank<r>.json``, ``step4.pt``
(the weights and optimizer state of the checkpoint resumed at the other shape, whole,
read in one process) and ``loaded-rank<r>.pt`` (what that resume gave each rank's
pipeline and optimizer).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conveyor.cli import main, training
from conveyor.pipeline import Pipeline
from conveyor.train import saving
from tests.support.training import TINY

#: A short run of the user's model, as tests/test_train_user.py runs it.
USER = ["--length", "32", "--batch", "8", "--chunks", "2", "--eval-every", "3",
        "--eval-batches", "1", "--save-every", "3", "--sample-bytes", "0", "--warmup", "1"]
STOP_AT = 4  # the split run's signal comes during this step

norms: dict[str, list[float]] = {}
_run = ""  # the run the norms now go to
_calls = 0  # Pipeline.step calls of the run


def _noting(clip: Any) -> Any:
    def clip_grad_norm_(self: Pipeline, max_norm: float, norm_type: float = 2.0) -> Any:
        norm = clip(self, max_norm, norm_type)
        norms.setdefault(_run, []).append(float(norm))
        return norm
    return clip_grad_norm_


def _signalling(step: Any) -> Any:
    def stepped(self: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        global _calls
        _calls += 1
        if _run == "split" and _calls == STOP_AT:
            signal.raise_signal(signal.SIGINT)
        return step(self, inputs, targets)
    return stepped


def _capturing(load: Any) -> Any:
    """``saving.load`` that keeps, in the reshaped run, the state it gave the pipeline
    and its optimizer (by parameter name)."""
    def loaded(directory: Any, *, model: Any, optimizer: Any = None) -> Any:
        extra = load(directory, model=model, optimizer=optimizer)
        if _run == "reshaped":
            loaded_state["model"] = {name: tensor.detach().clone()
                                     for name, tensor in model.state_dict().items()}
            loaded_state["optimizer"] = {
                name: {key: value.detach().clone() for key, value in
                       optimizer.state.get(parameter, {}).items()
                       if isinstance(value, torch.Tensor)}
                for name, parameter in model.named_parameters(remove_duplicate=False)}
        return extra
    return loaded


loaded_state: dict[str, Any] = {}  # what the reshaped run's pipeline and optimizer got


def train(run: str, out: Path, *flags: str) -> int:
    global _run, _calls
    _run, _calls = run, 0
    return main(["train", *flags, "--out", str(out)])


def runs(out: Path, model: str, data: str) -> list[int]:
    """The runs, in order; their exit codes."""
    user = ["--model", model, "--data", data, *USER, "--steps", "6"]
    codes = [train("whole", out / "whole", *user, "--tensor-parallel", "2", "--export",
                   str(out / "exported")),
             train("split", out / "split", *user, "--tensor-parallel", "2")]
    dist.barrier()
    if dist.get_rank() == 0:  # the checkpoint of step 4, to resume at another shape
        shutil.copytree(out / "split", out / "reshaped")
        torch.save({"model": saving.load_weights(out / "reshaped"),
                    "optimizer": saving.load_optimizer_state(out / "reshaped")},
                   out / "step4.pt")
    dist.barrier()
    codes += [train("resumed", out / "split", "--resume"),
              train("reshaped", out / "reshaped", "--resume", "--tensor-parallel", "1",
                    "--data-parallel", "2"),
              train("bundled", out / "bundled", *TINY, "--steps", "3",
                    "--tensor-parallel", "2")]
    return codes


if __name__ == "__main__":
    end = training.end_process_group
    training.end_process_group = lambda code, seconds=10.0: None  # type: ignore[assignment]
    Pipeline.clip_grad_norm_ = _noting(Pipeline.clip_grad_norm_)  # type: ignore[method-assign]
    Pipeline.step = _signalling(Pipeline.step)  # type: ignore[method-assign]
    saving.load = _capturing(saving.load)  # type: ignore[assignment]
    folder = Path(sys.argv[1])
    codes = runs(folder, sys.argv[2], sys.argv[3])
    (folder / f"norms-rank{dist.get_rank()}.json").write_text(
        json.dumps({"codes": codes, "norms": norms}))
    torch.save(loaded_state, folder / f"loaded-rank{dist.get_rank()}.pt")
    end(0)
    sys.exit(0)
