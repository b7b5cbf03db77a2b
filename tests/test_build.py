"""GPipe and Pipeline build their stages one way: the same checks, devices and errors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine import devices
from conveyor.engine.devices import resolve_devices


def _gpipe(model: nn.Sequential, **options: Any) -> nn.Module:
    return conveyor.GPipe(model, [1, 2], devices=["cpu"] * 2, **options)


def _pipeline(model: nn.Sequential, **options: Any) -> nn.Module:
    return conveyor.Pipeline(model, loss_fn=nn.MSELoss(), balance=[1, 2],
                             devices=["cpu"] * 2, **{"chunks": 1, **options})


BUILDERS = {"GPipe": _gpipe, "Pipeline": _pipeline}


def _model(first: str = "embed") -> nn.Sequential:
    return nn.Sequential(OrderedDict([(first, nn.Linear(3, 4)), ("act", nn.Tanh()),
                                      ("head", nn.Linear(4, 2))]))


@pytest.mark.parametrize("builder", BUILDERS.values(), ids=list(BUILDERS))
@pytest.mark.parametrize("name", ["chunks", "recompute", "devices", "balance"])
def test_a_layer_name_that_shadows_an_attribute_is_refused_alike(
        builder: Callable[..., nn.Module], name: str) -> None:
    with pytest.raises(conveyor.ModelError,
                       match=rf"layer name '{name}' clashes with an attribute of "
                             r"(GPipe|Pipeline); rename the layer"):
        builder(_model(first=name))


@pytest.mark.parametrize("builder,name", [(_gpipe, "partitions"), (_pipeline, "step"),
                                          (_pipeline, "loss_fn"), (_pipeline, "schedule")])
def test_names_of_either_face_are_refused_too(builder: Callable[..., nn.Module],
                                              name: str) -> None:
    with pytest.raises(conveyor.ModelError, match=rf"layer name '{name}' clashes"):
        builder(_model(first=name))


@pytest.mark.parametrize("builder", BUILDERS.values(), ids=list(BUILDERS))
def test_chunks_and_checkpoint_mode_are_checked_alike(builder: Callable[..., nn.Module]) -> None:
    with pytest.raises(conveyor.MicroBatchError, match="chunks must be a positive integer"):
        builder(_model(), chunks=0)
    with pytest.raises(ValueError, match=r"checkpoint='sometimes'.*'always', 'except_last'"):
        builder(_model(), checkpoint="sometimes")


@pytest.mark.parametrize("builder", BUILDERS.values(), ids=list(BUILDERS))
def test_deferred_batch_norm_is_converted_alike(builder: Callable[..., nn.Module]) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    pipe = builder(model, deferred_batch_norm=True)
    norms = [m for m in pipe.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 1 and isinstance(norms[0], conveyor.DeferredBatchNorm)


def test_a_bare_cuda_device_becomes_the_current_indexed_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(devices, "absent", lambda device: None)  # as if there were 2 GPUs
    assert resolve_devices(["cuda", "cpu", "cuda:0"], 3, what="balance has 3 stages") == [
        torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 0)]


def test_the_device_count_must_match() -> None:
    with pytest.raises(conveyor.BalanceError,
                       match=r"devices lists 1 devices but balance has 2 stages; give one "
                             "device per stage"):
        resolve_devices(["cpu"], 2, what="balance has 2 stages", per="stage")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("builder", BUILDERS.values(), ids=list(BUILDERS))
def test_pipelines_on_bare_cuda_name_the_indexed_device(builder: Callable[..., nn.Module]) -> None:
    model = _model()
    pipe = (conveyor.GPipe(model, [1, 2], devices=["cuda", "cuda"])
            if builder is _gpipe else
            conveyor.Pipeline(model, loss_fn=nn.MSELoss(), chunks=1, balance=[1, 2],
                              devices=["cuda", "cuda"]))
    current = torch.device("cuda", torch.cuda.current_device())
    assert pipe.devices == [current, current]
