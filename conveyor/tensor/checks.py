"""Sizes a tensor group must divide, checked when the pipeline is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from conveyor.errors import TensorParallelError

__all__: list[str] = []

#: The dimension each style splits, by module kind: (attribute, what it is).
_SPLIT = {
    ("colwise", "Linear"): ("out_features", "output features"),
    ("colwise_gather_output", "Linear"): ("out_features", "output features"),
    ("rowwise", "Linear"): ("in_features", "input features"),
    ("embedding_rowwise", "Embedding"): ("num_embeddings", "vocabulary"),
}
#: A model configuration's sizes that a split attention must divide.
_HEADS = ("num_attention_heads", "num_key_value_heads")


def check_sizes(model: nn.Module, planned: Mapping[str, tuple[str, str]], size: int,
                config: Any) -> None:
    """Refuses a tensor-parallel size that does not divide a split dimension of a
    planned module, or the heads of a model whose attention projections are split.

    Raises:
        TensorParallelError: naming the module (or the configuration), the dimension,
            its size and the tensor-parallel sizes that would divide it.
    """
    for name, (style, _) in planned.items():
        module = model.get_submodule(name)
        found = _SPLIT.get((style, type(module).__name__))
        if found is None:
            continue
        attribute, what = found
        value = int(getattr(module, attribute))
        if value % size:
            raise TensorParallelError(
                f"tensor_parallel={size} does not divide {name}'s {what} ({attribute}="
                f"{value}, split by {style!r}); use tensor_parallel in {_divisors(value)}")
    if config is None or not any(s in ("colwise", "rowwise") for s, _ in planned.values()):
        return
    for attribute in _HEADS:
        heads = getattr(config, attribute, None)
        if isinstance(heads, int) and heads % size:
            raise TensorParallelError(
                f"tensor_parallel={size} does not divide the model's heads (config."
                f"{attribute}={heads}), which its attention projections split; use "
                f"tensor_parallel in {_divisors(heads)}")


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]
