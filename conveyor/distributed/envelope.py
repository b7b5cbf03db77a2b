"""The envelope of a message between processes: a header of 32 int64s and a body.

The header carries the kind, sending and receiving stage, micro-batch, sizes, and (for a
single tensor, alone or in a list or tuple: an activation, a stage's input gradients)
its dtype and shape, so a later batch with another sequence length needs nothing
special; several tensors, or other values, travel with a pickled skeleton. Pure functions of
tensors: :mod:`conveyor.distributed.p2p` moves the bytes, this module lays them out.
"""

from __future__ import annotations

import array
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.errors import ConveyorError
from conveyor.torchprivate import pytree

__all__: list[str] = []


# The layout of a message, as it lies in the receiver's buffer on gloo: an envelope,
# header and body in one transfer into a receive posted as large as the largest
# message yet from that peer (its capacity). NCCL sends the header and the body as two
# messages of their exact sizes.
#
#   byte 0         256          256+S                                   256+BODY
#   | header       | skeleton | pad | tensor 0 | pad | tensor 1 | pad |  unused  |
#   | 32 int64s    |<---------------- body: BODY bytes --------------->| capacity |
#
# S, the skeleton's size, and each tensor's size are padded to 64 bytes, so every tensor
# starts aligned and is viewed as its dtype where it lies. A single tensor (the common
# case, also as the one element of a list or tuple) has no skeleton and no padding: the
# header describes it and the body is its bytes.
#
#   header field   meaning
#   0 code         0 activation, 1 gradient, 2 abort (the body is a pickled report)
#   1 stage        the receiving stage         (in an abort: the stage that failed, or -1)
#   2 microbatch   the micro-batch             (in an abort: its micro-batch, or -1)
#   3 body         BODY, the bytes after the header (padding included)
#   4 skeleton     S: the value pickled with a _Slot (offset, dtype, shape, flag) in
#                  place of each tensor; 0 for a single tensor
#   5 inline       1: the body follows in this buffer; 0: it comes in a message of its own
#   6 dtype        index into _DTYPES    \
#   7 grad         requires_grad          |  a single tensor only (at most 12 dims,
#   8 ndim         number of dims         |  a dtype in _DTYPES; anything else goes
#   9-20 shape     one size per dim      /   with a skeleton)
#   21 origin      in an abort: the rank whose failure it reports (kept if the body is
#                  lost, when that rank exits before its receiver takes the body);
#      / arrives   in a message sent inside ``emulated_links``: when it arrives, in
#                  nanoseconds of time.monotonic (one machine's clock); else 0
#   22 source      the sending stage (a neighbour, or the other end of an edge)
#   23 step        the sender's step: a message of an earlier, failed step is drained
#   24 container   a single tensor only: 0 the tensor, 1 a list of it, 2 a tuple of it
#   25-31          unused (0): the header stays a multiple of 64 bytes
_INTS = 32
_HEADER_BYTES = _INTS * 8
_MAX_DIMS = 12
_ALIGN = 64
_CODES = {"activation": 0, "gradient": 1}
_KINDS = {code: kind for kind, code in _CODES.items()}
_ABORT = 2
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]
# header fields
_CODE, _STAGE, _MICROBATCH, _BODY, _SKELETON, _INLINE, _DTYPE, _GRAD, _NDIM, _SHAPE = range(10)
_ORIGIN = 21
_ARRIVES = 21  # the same field, in a message rather than an abort
_SOURCE = 22
_STEP = 23
_CONTAINER = 24
_CONTAINERS: tuple[type, ...] = (torch.Tensor, list, tuple)  # by the field's value


# How messages meet their receives, for rank 1 of GPipe on two stages and two
# micro-batches whose activations are 4 KiB each. Both sides start a peer's capacity
# at 256 bytes (a header) and raise it to the largest message seen, in the same order,
# so they always agree whether the next message fits in one envelope:
#
#   rank 0 sends                           rank 1
#                                          prepare(): expects act(1,0), act(1,1) from
#                                            rank 0; posts a 256-byte receive
#   0F0: 4352 > 256 bytes: header alone  -> lands in it (inline 0); posts 4096 bytes
#        then the body (4096 bytes)      -> lands there; act(1,0) is decoded, capacity
#                                            is now 4352; posts 4352 bytes for act(1,1)
#   0F1: 4352 <= 4352: one envelope      -> lands whole in the posted receive (inline 1)
#        (header + body, inline 1)         rank 0 sends nothing more: no receive posted
#
# A failing rank sends an abort report in place of its next message to every peer, so
# a waiting receive ends with PeerFailure instead of a timeout, and a rank busy with
# other work sees the report before its next action (poll), whoever it came from. The
# report's header names the failing rank, stage and micro-batch, in case its body is
# lost with the failed process; each rank passes the report on when it stops.


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a message's skeleton: where its bytes start, and what it is.
    ``order``: a tensor whose dimensions lie in memory in another order than its shape's
    (a transposed one) travels in memory order, ``shape`` that order's, and is permuted
    back by ``order`` on arrival, so that it keeps its sender's layout (a dropout fills
    its mask in memory order)."""

    offset: int
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    order: tuple[int, ...] | None = None


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``t``'s dimensions that lists them in memory order, if ``t`` is
    dense in that order and not in its own (None: contiguous, or not a permutation of
    a dense layout)."""
    if t.is_contiguous() or t.dim() < 2:
        return None
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
    return order if t.permute(order).is_contiguous() else None


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _encode(code: int, stage: int, microbatch: int, value: Any,
            source: int = -1) -> tuple[list[int], list[Any]]:
    """The header and the pieces of the body (byte tensors, or bytes) of a message from
    stage ``source`` to ``stage``."""
    header = [0] * _INTS
    header[_CODE], header[_STAGE], header[_MICROBATCH] = code, stage, microbatch
    header[_SOURCE] = source
    if isinstance(value, bytes):  # an abort report
        header[_SKELETON] = header[_BODY] = len(value)
        return header, [value]
    if type(value) in (list, tuple) and len(value) == 1:  # a stage's input gradients
        header[_CONTAINER] = _CONTAINERS.index(type(value))
        value = value[0]
    if (isinstance(value, torch.Tensor) and value.dtype in _DTYPES
            and value.dim() <= _MAX_DIMS and _memory_order(value) is None):
        header[_DTYPE], header[_GRAD] = _DTYPES.index(value.dtype), int(value.requires_grad)
        header[_NDIM] = value.dim()
        header[_SHAPE:_SHAPE + value.dim()] = list(value.shape)
        header[_BODY] = value.numel() * value.element_size()
        return header, [_bytes(value)]
    if header[_CONTAINER]:  # its one element goes in a skeleton after all
        value, header[_CONTAINER] = _CONTAINERS[header[_CONTAINER]]([value]), 0
    tensors: list[torch.Tensor] = []
    offsets = [0]

    def slot(t: torch.Tensor) -> _Slot:
        order = _memory_order(t)
        laid = t if order is None else t.permute(order)  # contiguous: no copy
        tensors.append(_bytes(laid))
        offsets.append(offsets[-1] + _padded(tensors[-1].numel()))
        back = None if order is None else tuple(order.index(d) for d in range(t.dim()))
        return _Slot(offsets[-2], str(t.dtype).removeprefix("torch."), tuple(laid.shape),
                     t.requires_grad, back)

    skeleton = pickle.dumps(pytree.tree_map_only(torch.Tensor, slot, value))
    header[_SKELETON] = _padded(len(skeleton))
    header[_BODY] = header[_SKELETON] + offsets[-1]
    pieces: list[Any] = [skeleton]
    for tensor, start in zip(tensors, offsets):
        pieces.append((header[_SKELETON] + start, tensor))
    return header, pieces


def _encode_abort(report: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """The message of an abort report: the whole report pickled in the body, and where
    the failure started (rank, stage, micro-batch) in the header too."""
    header, pieces = _encode(_ABORT, report["stage"], report["microbatch"],
                             pickle.dumps(report))
    header[_ORIGIN] = report["rank"]
    return header, pieces


def _abort_summary(header: Sequence[int], lost: str) -> dict[str, Any]:
    """The report an abort's header alone tells, for when its body was ``lost``."""
    return {"rank": header[_ORIGIN], "error": f"its report was lost: {lost}",
            "stage": header[_STAGE], "microbatch": header[_MICROBATCH], "action": "?"}


def _describe(header: Sequence[int]) -> str:
    """The message a header announces, in words, for error messages."""
    if header[_CODE] == _ABORT:
        return "an abort report"
    sender = f" from stage {header[_SOURCE]}" if header[_SOURCE] >= 0 else ""
    return (f"the {_KINDS.get(header[_CODE], '?')} of micro-batch {header[_MICROBATCH]} "
            f"for stage {header[_STAGE]}{sender}")


def _check_header(header: Sequence[int]) -> None:
    """Raises ConveyorError unless ``header`` could be one that :func:`_encode` wrote."""
    if len(header) != _INTS:
        raise ConveyorError(f"a message header has {len(header)} fields, expected {_INTS}")
    if header[_CODE] not in _KINDS and header[_CODE] != _ABORT:
        raise ConveyorError(f"a message header has kind code {header[_CODE]}; known codes "
                            f"are {_KINDS | {_ABORT: 'abort'}}: the message is corrupt or "
                            "the ranks run different conveyor versions")
    if not 0 <= header[_SKELETON] <= header[_BODY]:
        raise ConveyorError(f"the header of {_describe(header)} gives a skeleton of "
                            f"{header[_SKELETON]} bytes and a body of {header[_BODY]}: the "
                            "message is corrupt")
    if header[_SKELETON] or header[_CODE] == _ABORT:
        return
    ndim = header[_NDIM]
    if not 0 <= header[_DTYPE] < len(_DTYPES) or not 0 <= ndim <= _MAX_DIMS:
        raise ConveyorError(f"the header of {_describe(header)} gives dtype code "
                            f"{header[_DTYPE]} and {ndim} dims; known are codes "
                            f"0-{len(_DTYPES) - 1}, 0-{_MAX_DIMS} dims: the message is corrupt")
    if not 0 <= header[_CONTAINER] < len(_CONTAINERS):
        raise ConveyorError(f"the header of {_describe(header)} gives container code "
                            f"{header[_CONTAINER]}; known are 0-{len(_CONTAINERS) - 1}: the "
                            "message is corrupt")
    shape = header[_SHAPE:_SHAPE + ndim]
    size = math.prod(shape) * _DTYPES[header[_DTYPE]].itemsize
    if min(shape, default=0) < 0 or size != header[_BODY]:
        raise ConveyorError(f"the header of {_describe(header)} gives shape {shape} of "
                            f"{_DTYPES[header[_DTYPE]]} ({size} bytes) and a body of "
                            f"{header[_BODY]} bytes: the message is corrupt")


def _unpickle(data: torch.Tensor, what: str) -> Any:
    """The object pickled into a uint8 tensor (without numpy, which torch does not need)."""
    try:
        return pickle.loads(bytes(data.cpu().tolist()))
    except Exception as exc:  # noqa: BLE001 - corrupt pickles raise many kinds of error
        raise ConveyorError(f"the pickled part of {what} ({data.numel()} bytes) cannot be "
                            f"read ({type(exc).__name__}: {exc}): the message is corrupt or "
                            "truncated") from exc


def _decode(header: list[int], body: torch.Tensor, *, checked: bool = False) -> Any:
    """The value of a message from its header and body (tensors are views of the body);
    ``checked``: the header has passed :func:`_check_header` (as the receiver checks it
    before trusting its body size).

    Raises:
        ConveyorError: the header is malformed, or the body is shorter than it says.
    """
    if not checked:
        _check_header(header)
    if body.numel() < header[_BODY]:
        raise ConveyorError(f"{_describe(header)} is truncated: its header announces a body "
                            f"of {header[_BODY]} bytes, {body.numel()} arrived")
    if header[_SKELETON] == 0:
        dtype = _DTYPES[header[_DTYPE]]
        shape = header[_SHAPE:_SHAPE + header[_NDIM]]
        tensor = body[:header[_BODY]].view(dtype).view(shape)
        if header[_GRAD]:
            tensor.requires_grad_()
        return _CONTAINERS[header[_CONTAINER]]([tensor]) if header[_CONTAINER] else tensor
    what = _describe(header)
    skeleton = _unpickle(body[:header[_SKELETON]], what)

    def fill(slot: _Slot) -> torch.Tensor:
        dtype = getattr(torch, slot.dtype)
        size = math.prod(slot.shape) * dtype.itemsize
        start = header[_SKELETON] + slot.offset
        if start + size > header[_BODY]:
            raise ConveyorError(f"{what} places a tensor of {size} bytes at byte {start} of "
                                f"a body of {header[_BODY]}: the message is corrupt")
        tensor = body[start:start + size].view(dtype).view(slot.shape)
        if slot.order is not None:  # the sender's layout
            tensor = tensor.permute(slot.order)
        return tensor.requires_grad_() if slot.requires_grad else tensor

    return pytree.tree_map_only(_Slot, fill, skeleton)


def header_bytes(header: list[int]) -> torch.Tensor:
    """``header`` as the bytes of its int64s, on the host (a copy of them)."""
    return torch.frombuffer(array.array("q", header), dtype=torch.uint8)


def _assemble(header: list[int], pieces: list[Any], *, with_header: bool,
              device: torch.device) -> torch.Tensor:
    """Header (optional) and body pieces laid out in one byte buffer."""
    start = _HEADER_BYTES if with_header else 0
    if (with_header and not header[_SKELETON] and len(pieces) == 1
            and isinstance(pieces[0], torch.Tensor) and pieces[0].device == device):
        # One tensor (the common message): header and its bytes joined in one copy.
        return torch.cat([header_bytes(header).to(device), pieces[0]])
    # Uninitialised: every byte read back is written below (padding is never read).
    buffer = torch.empty(start + header[_BODY], dtype=torch.uint8, device=device)
    if with_header:
        buffer[:_HEADER_BYTES] = header_bytes(header)
    for piece in pieces:
        offset, data = (0, piece) if not isinstance(piece, tuple) else piece
        if isinstance(data, bytes):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buffer[start + offset:start + offset + data.numel()] = data
    return buffer
