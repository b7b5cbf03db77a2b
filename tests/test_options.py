"""``PipelineOptions`` is where Pipeline's options are written: the signature, the
docstring, what the ranks agree on and what the cut takes all follow it."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from torch import nn

import conveyor
from conveyor.runtime.options import PipelineOptions


def test_the_signature_is_the_options() -> None:
    params = inspect.signature(conveyor.Pipeline.__init__).parameters
    keywords = {name: p for name, p in params.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: f for f in dataclasses.fields(PipelineOptions)}
    assert list(keywords) == list(fields)
    for name, field in fields.items():
        default = keywords[name].default
        wanted = inspect.Parameter.empty if field.default is dataclasses.MISSING \
            else field.default
        assert default == wanted, f"{name}: Pipeline's default {default!r}, the options' {wanted!r}"


def test_the_docstring_documents_each_option() -> None:
    doc = inspect.getdoc(conveyor.Pipeline) or ""
    documented = set(re.findall(r"^    (\w+):", doc, flags=re.MULTILINE))
    missing = [f.name for f in dataclasses.fields(PipelineOptions) if f.name not in documented]
    assert not missing, f"Pipeline's docstring does not document {missing}"


def test_agreed_and_cut_options_are_plain_or_named() -> None:
    options = PipelineOptions(loss_fn=nn.functional.mse_loss, chunks=4, balance=(1, 2),
                              schedule="1f1b", tie_weights=[("a.weight", "b.weight")],
                              checkpoint="never")
    agreed = options.agreed()
    assert agreed["balance"] == [1, 2] and agreed["recompute"] == "never"
    assert agreed["tie_weights"] == [["a.weight", "b.weight"]]
    assert "loss_fn" not in agreed and "devices" not in agreed and "sample" not in agreed
    assert set(options.cut()) == {"layers", "balance", "split_at", "tie_weights",
                                  "deferred_batch_norm", "init_fn", "weights"}


def test_the_options_are_kept_frozen_on_the_pipeline() -> None:
    pipe = conveyor.Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2,
                             loss_fn=nn.functional.mse_loss, stages=2, balance=[1, 1])
    assert pipe.options.chunks == 2 and pipe.options.balance == [1, 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipe.options.chunks = 3  # type: ignore[misc]
