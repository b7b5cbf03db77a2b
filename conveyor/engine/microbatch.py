"""Splitting a batch into micro-batches along dim 0, and gathering outputs back.

A batch is a tensor or any nested tuple/list/dict of tensors (a pytree). Tensors with
a batch dimension are split with ``torch.tensor_split``, so sizes may be uneven
(N=10, M=4 gives 3, 3, 2, 2) and each micro-batch is a view, not a copy. Leaves that
are not batched (numbers, strings, 0-dim tensors, None) go to every micro-batch as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conveyor.errors import MicroBatchError
from conveyor.torchprivate import pytree

__all__: list[str] = []


def _describe(path: tuple[Any, ...], root: str) -> str:
    return root + pytree.keystr(path)


def microbatch_sizes(batch_size: int, chunks: int) -> list[int]:
    """Sizes of the micro-batches ``split`` makes: as even as possible, larger first.

    Raises:
        MicroBatchError: ``chunks`` is not positive, or the batch is smaller than it.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise MicroBatchError(f"chunks must be a positive integer, got {chunks!r}")
    if batch_size < chunks:
        raise MicroBatchError(
            f"a batch of {batch_size} samples cannot be split into {chunks} micro-batches; "
            f"use chunks <= {batch_size} or a batch of at least {chunks} samples"
        )
    base, extra = divmod(batch_size, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


def microbatch_count(batch: Any, chunks: int) -> int:
    """The number of micro-batches a forward-only call splits ``batch`` into: ``chunks``,
    or one per sample when the batch has fewer (generation one sequence at a time).

    Raises:
        MicroBatchError: ``chunks`` is not positive, or the batch holds no batched tensor.
    """
    microbatch_sizes(chunks, chunks)  # checks chunks
    return min(chunks, batch_size(batch))


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: dim 0 of its first batched tensor.

    Raises:
        MicroBatchError: the batch holds no tensor with a batch dimension.
    """
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise MicroBatchError(
        "the batch holds no tensor with a batch dimension (dim 0) to split into "
        f"micro-batches; got {_summary(batch)}: pass a tensor (torch.tensor(...) of a "
        "list of numbers), or a tuple or dict of tensors"
    )


def split(batch: Any, chunks: int) -> list[Any]:
    """Splits ``batch`` into ``chunks`` micro-batches along dim 0.

    Args:
        batch: a tensor, or a nested tuple/list/dict whose tensor leaves share dim 0.
        chunks: the number of micro-batches M.

    Returns:
        A list of M batches with the structure of ``batch``.

    Raises:
        MicroBatchError: no tensor has a batch dimension, the batch is empty, tensors
            disagree on the batch size, or the batch has fewer samples than ``chunks``.
    """
    leaves, spec = pytree.tree_flatten_with_path(batch)
    batched = [
        (path, leaf)
        for path, leaf in leaves
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    ]
    if not batched:
        batch_size(batch)  # raises the error that says so
    first_path, first = batched[0]
    size = first.shape[0]
    for path, leaf in batched[1:]:
        if leaf.shape[0] != size:
            raise MicroBatchError(
                f"tensors in the batch disagree on the batch size (dim 0): "
                f"{_describe(first_path, 'input')} has {size} samples but "
                f"{_describe(path, 'input')} has {leaf.shape[0]}"
            )
    if size == 0:
        raise MicroBatchError(
            f"the batch is empty: {_describe(first_path, 'input')} has 0 samples"
        )
    sizes = microbatch_sizes(size, chunks)
    pieces = [
        leaf.split(sizes) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None
        for _, leaf in leaves
    ]
    return [
        pytree.tree_unflatten(
            [
                parts[m] if parts is not None else leaf
                for (_, leaf), parts in zip(leaves, pieces)
            ],
            spec,
        )
        for m in range(chunks)
    ]


def gather(outputs: Sequence[Any]) -> Any:
    """Concatenates per-micro-batch outputs along dim 0 into one batch.

    Tensor leaves are concatenated; other leaves must be equal in every micro-batch
    and are returned once.

    Raises:
        MicroBatchError: the micro-batches differ in structure, a tensor leaf is 0-dim,
            or a non-tensor leaf differs between micro-batches.
    """
    if not outputs:
        raise MicroBatchError("there are no micro-batch outputs to gather")
    flat = [pytree.tree_flatten_with_path(out) for out in outputs]
    paths_and_leaves, spec = flat[0]
    for m, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise MicroBatchError(
                f"micro-batch {m} returned a different structure than micro-batch 0: "
                f"{other} vs {spec}"
            )
    gathered = []
    for i, (path, leaf) in enumerate(paths_and_leaves):
        column = [leaves[i][1] for leaves, _ in flat]
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise MicroBatchError(
                    f"{_describe(path, 'output')} is a 0-dim tensor; outputs are "
                    "concatenated along dim 0 over micro-batches, so return one value "
                    "per sample (shape [batch, ...]) or compute it after the pipeline"
                )
            gathered.append(column[0] if len(column) == 1 else torch.cat(column))
        else:
            differing = [m for m, value in enumerate(column) if value != leaf]
            if differing:
                m = differing[0]
                raise MicroBatchError(
                    f"{_describe(path, 'output')} is not a tensor and differs between "
                    f"micro-batches ({leaf!r} in micro-batch 0, {column[m]!r} in "
                    f"micro-batch {m}); non-tensor outputs must be the same for every "
                    "micro-batch"
                )
            gathered.append(leaf)
    return pytree.tree_unflatten(gathered, spec)


def _summary(batch: Any, depth: int = 0) -> str:
    """What ``batch`` is made of, by types and shapes, never its values (a list of a
    thousand numbers is ``list[1000] of float``)."""
    if isinstance(batch, torch.Tensor):
        return f"Tensor{tuple(batch.shape)}"
    if isinstance(batch, (list, tuple)) and depth < 3:
        kinds = sorted({_summary(item, depth + 1) for item in batch})
        inner = kinds[0] if len(kinds) == 1 else " or ".join(kinds[:3])
        return f"{type(batch).__name__}[{len(batch)}]" + (f" of {inner}" if inner else "")
    if isinstance(batch, dict) and depth < 3:
        text = ", ".join(f"{k!r}: {_summary(v, depth + 1)}" for k, v in list(batch.items())[:4])
        return "{" + text + (", ...}" if len(batch) > 4 else "}")
    return "None" if batch is None else type(batch).__name__
