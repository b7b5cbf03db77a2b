"""Bytes a process sends through torch.distributed, counted by wrapping its functions.

Point-to-point sends (``isend``, ``send``, and ``batch_isend_irecv``, whose ``P2POp``s
call ``isend``) add up ``numel * element_size`` of each tensor sent: the bytes that go
over the wire, whatever they hold (conveyor's envelopes: header, pickled skeleton,
padding and values). Collectives (``all_reduce``, ``broadcast``) are counted apart: the
bytes of the tensor a rank hands in, which the backend's algorithm then moves.

Which pipeline message a sent tensor belongs to (an activation, a gradient) is told by
also wrapping where each library decides what to send: conveyor's
``P2PTransport.send(kind, stage, microbatch, value)`` and torch's
``PipelineStage.get_fwd_send_ops`` / ``get_bwd_send_ops``. Their values' tensors are the
*payload*; the wire bytes include whatever a library adds around them.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.utils._pytree as pytree

__all__ = ["count_bytes", "nbytes"]

_POINT_TO_POINT = ("isend", "send")
_COLLECTIVES = ("all_reduce", "broadcast")


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _name(path: tuple[Any, ...]) -> str:
    """A value's place in a message: its key in a dict, its index in a list."""
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return ".".join(keys) or "tensor"


class _Count:
    """What one process sends while :meth:`active`."""

    def __init__(self) -> None:
        self.wire: dict[str, int] = defaultdict(int)        # by message kind
        self.messages: dict[str, int] = defaultdict(int)    # sends, by kind
        self.payload: dict[str, int] = defaultdict(int)     # the values' tensors, by kind
        self.values: dict[str, list[str]] = {}              # what one message carries
        self.collective: dict[str, int] = defaultdict(int)  # by collective
        self._current: str | None = None                    # conveyor: the message sent now
        self._by_id: dict[int, str] = {}                    # torch: its send ops' tensors

    def _message(self, kind: str, named: list[tuple[str, torch.Tensor]]) -> None:
        self.payload[kind] += sum(nbytes(t) for _, t in named)
        if named:
            self.values.setdefault(kind, [f"{name} {tuple(t.shape)} {str(t.dtype)[6:]}"
                                          for name, t in named])

    def _send(self, send: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            kind = self._current or self._by_id.get(id(tensor), "other")
            self.wire[kind] += nbytes(tensor)
            self.messages[kind] += 1
            return send(tensor, *args, **kwargs)
        return counted

    def _collective(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.collective[name] += nbytes(tensor)
            return function(tensor, *args, **kwargs)
        return counted

    def _conveyor_send(self, send: Callable[..., Any]) -> Callable[..., Any]:
        def counted(transport: Any, kind: str, stage: int, microbatch: int, value: Any,
                    **options: Any) -> Any:
            leaves, _ = pytree.tree_flatten_with_path(value)
            self._message(kind, [(_name(path), t) for path, t in leaves
                                 if isinstance(t, torch.Tensor)])
            self._current = kind
            try:
                return send(transport, kind, stage, microbatch, value, **options)
            finally:
                self._current = None
        return counted

    def _torch_ops(self, make: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def counted(stage: Any, chunk: int) -> Any:
            ops = make(stage, chunk)
            self._message(kind, [(f"arg {i}", op.tensor) for i, op in enumerate(ops)])
            self._by_id.update({id(op.tensor): kind for op in ops})
            return ops
        return counted

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Wraps the send functions of ``torch.distributed`` (and of
        ``distributed_c10d``, where ``P2POp`` checks its op and ``batch_isend_irecv``
        dispatches on it) and the libraries' senders; puts them back after."""
        from conveyor.distributed.p2p import P2PTransport
        from torch.distributed.pipelining.stage import _PipelineStageBase

        patches: list[tuple[Any, str, Any]] = []
        for name in _POINT_TO_POINT + _COLLECTIVES:
            original = getattr(c10d, name)
            wrapped = (self._send(original) if name in _POINT_TO_POINT
                       else self._collective(name, original))
            patches += [(c10d, name, wrapped), (dist, name, wrapped)]
        patches += [
            (P2PTransport, "send", self._conveyor_send(P2PTransport.send)),
            (_PipelineStageBase, "get_fwd_send_ops",
             self._torch_ops(_PipelineStageBase.get_fwd_send_ops, "activation")),
            (_PipelineStageBase, "get_bwd_send_ops",
             self._torch_ops(_PipelineStageBase.get_bwd_send_ops, "gradient")),
        ]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, value in patches:
            setattr(owner, name, value)
        try:
            yield
        finally:
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)


def count_bytes(step: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
    """What this process sends in one ``step``, and what the step returned.

    Returns:
        ``{"wire", "messages", "payload", "collective": {kind: bytes or count},
        "values": {kind: one message's tensors}}``, and the step's result.
    """
    count = _Count()
    with count.active():
        result = step()
    return {"wire": dict(count.wire), "messages": dict(count.messages),
            "payload": dict(count.payload), "collective": dict(count.collective),
            "values": count.values}, result
