"""What crosses a stage boundary under tensor parallelism: 1/T of it per tensor rank.

Tensor rank t of stage k sends to tensor rank t of stage k+1. After a row-parallel
layer (and wherever a stage's output is not split) every rank of the group holds the
same activation, and its gradient comes back the same on every rank of the next
group, so sending it whole from each rank sends it T times. Instead::

    stage k, rank t:   value ──flatten──> piece t of T ──────p2p──────>  stage k+1, rank t
    stage k+1, rank t: pieces 0..T-1 ──all-gather in its tensor group──> value, whole

The bytes crossing the boundary stay those of one copy, whatever T, and the gather
runs on the receiving group's own links (a node's fast ones: TP is innermost).

Which values are held alike is found, not assumed: the first time a kind of message
goes from one stage to another, the sending group compares each tensor's shape, dtype
and a checksum of its bytes (one exchange of plain data), and slices only those every
rank holds bit for bit; a tensor each rank holds its own part of (a cut between a
column- and a row-parallel layer) goes whole, as before. The pieces are the sender's
own bytes in its memory order, so what is gathered equals what was sent bit for bit.
Tensors under :data:`conveyor.tensor.SLICED_FROM` bytes go whole: there the gather's latency costs more
than the bytes it saves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.distributed.envelope import _memory_order
import conveyor.tensor
from conveyor.distributed.faults import collective
from conveyor.torchprivate import pytree

__all__: list[str] = []

#: What the group can gather (gloo and NCCL alike).
_GATHERED = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
             torch.int32, torch.uint8}
_RUN = 1 << 22  # words of a tensor's bytes summed at once by its fingerprint


@dataclass
class Piece:
    """This rank's piece of a tensor every rank of the sending group holds alike: the
    ``rank``-th of ``parts`` equal runs of its bytes in memory order (the last padded),
    with what the receiver needs to put it back together."""

    data: torch.Tensor
    shape: tuple[int, ...]  # in memory order
    order: tuple[int, ...] | None  # the permutation back to the sender's dims


def _unflatten(children: Any, context: Any) -> Piece:
    (data,) = children
    return Piece(data, *context)


pytree.register_pytree_node(Piece, lambda p: ([p.data], (p.shape, p.order)), _unflatten,
                            serialized_type_name="conveyor.tensor.boundary.Piece")


class Boundary:
    """The slicing and gathering of one rank's messages between stages.

    Args:
        group: this stage's tensor process group.
        size: T, the ranks in it.
        rank: this rank's place in it.
        seconds: how long the group's exchange and gathers may wait.
        notice: a rank's announced failure, which names what ended a gather whose
            connections closed.
    """

    def __init__(self, group: Any, size: int, rank: int, seconds: float,
                 notice: Callable[[], Any] | None = None) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.seconds = seconds
        self.notice = notice
        #: per (kind, source stage, stage): how many tensors its messages hold, and
        #: which of them (by place) every rank of the group holds alike
        self.alike: dict[tuple[str, int, int], tuple[int, frozenset[int]]] = {}

    def cut(self, kind: str, source: int, stage: int, value: Any) -> Any:
        """``value`` as this rank sends it: each large tensor the group holds alike
        replaced by this rank's :class:`Piece` of it."""
        leaves, spec = pytree.tree_flatten(value)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not tensors:
            return value
        key = (kind, source, stage)
        known = self.alike.get(key)
        if known is None or known[0] != len(tensors):
            known = self.alike[key] = (len(tensors), self._held_alike(
                [leaves[i] for i in tensors], f"stage {source}'s {kind} for stage {stage}"))
        cut = False
        for place in known[1]:
            leaf = leaves[tensors[place]]
            if leaf.numel() * leaf.element_size() >= conveyor.tensor.SLICED_FROM and leaf.numel() >= self.size:
                leaves[tensors[place]] = self._piece(leaf)
                cut = True
        return pytree.tree_unflatten(leaves, spec) if cut else value

    def join(self, value: Any) -> Any:
        """``value`` as it was sent: each :class:`Piece` gathered from the group's ranks
        (every rank of the group joins, in the same order: they run the same actions)."""
        if isinstance(value, torch.Tensor) or not any(
                isinstance(leaf, Piece) for leaf in pytree.tree_leaves(value, is_leaf=_is_piece)):
            return value
        return pytree.tree_map_only(Piece, self._gather, value, is_leaf=_is_piece)

    def _held_alike(self, tensors: list[torch.Tensor], what: str) -> frozenset[int]:
        """The places of the tensors that every rank of the group holds bit for bit."""
        mine = [_fingerprint(t) for t in tensors]
        everyone = collective.exchange(
            mine, group=self.group, what=f"the tensor group's comparison of {what}",
            seconds=self.seconds, device=tensors[0].device if tensors[0].is_cuda else None)
        return frozenset(i for i, print_ in enumerate(mine) if tensors[i].dtype in _GATHERED
                         and all(theirs[i] == print_ for theirs in everyone))

    def _piece(self, tensor: torch.Tensor) -> Piece:
        order = _memory_order(tensor)
        laid = (tensor if order is None else tensor.permute(order)).detach()
        flat = laid.reshape(-1)
        run = math.ceil(flat.numel() / self.size)
        data = flat[self.rank * run:(self.rank + 1) * run]
        if data.numel() < run:  # the last piece, padded to the others' length
            data = torch.cat([data, data.new_zeros(run - data.numel())])
        back = None if order is None else tuple(order.index(d) for d in range(tensor.dim()))
        return Piece(data.requires_grad_(tensor.requires_grad), tuple(laid.shape), back)

    def _gather(self, piece: Piece) -> torch.Tensor:
        data = piece.data.detach()
        pieces = [torch.empty_like(data) for _ in range(self.size)]
        # waited for here, as the layers' all-reduces in the same group are: the
        # watcher's hop to this thread would add a few hundred us to each message
        collective.all_gather(pieces, data, group=self.group, seconds=self.seconds,
                              what="the tensor group's gathering of a stage's input",
                              notice=self.notice, inline=True)
        whole = torch.cat(pieces)[:math.prod(piece.shape)].view(piece.shape)
        if piece.order is not None:
            whole = whole.permute(piece.order)
        return whole.requires_grad_() if piece.data.requires_grad else whole


def _is_piece(value: Any) -> bool:
    return isinstance(value, Piece)


def _fingerprint(tensor: torch.Tensor) -> list[Any]:
    """Shape, dtype and two sums of ``tensor``'s bytes read as integers (one weighted by
    place): equal on two ranks when they hold the same bytes, and almost surely not
    otherwise. Integer sums (wrapping alike), so the order a kernel adds in cannot
    change them; taken a run of 2^22 words at a time, to bound the memory."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    plain = weighted = 0
    for start in range(0, words.numel(), _RUN):
        run = words[start:start + _RUN].to(torch.int64)
        place = torch.arange(start, start + run.numel(), device=run.device) % 65521 + 1
        plain += int(run.sum())
        weighted += int((run * place).sum())
    return [list(tensor.shape), str(tensor.dtype), plain, weighted]
