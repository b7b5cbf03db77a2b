"""A message between processes: header and body carry any value and give it back.

These are the encoding helpers of :mod:`conveyor.distributed.envelope`, pure functions of
tensors that need no process group; tests/test_distributed.py sends such messages
between processes for real.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from conveyor.distributed.envelope import (
    _ABORT,
    _BODY,
    _CODES,
    _DTYPE,
    _DTYPES,
    _CONTAINER,
    _HEADER_BYTES,
    _NDIM,
    _SHAPE,
    _SKELETON,
    _abort_summary,
    _assemble,
    _decode,
    _encode,
    _encode_abort,
    _padded,
    _unpickle,
)
from conveyor.errors import ConveyorError

CPU = torch.device("cpu")
ACTIVATION = _CODES["activation"]
# The dtypes the header describes by itself: a single tensor of these needs no pickle.
HEADER_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8,
                 torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                 torch.complex64, torch.complex128]
# The rest of what CPU tensors can hold (where this torch has it) travels with a skeleton.
SKELETON_DTYPES = [getattr(torch, name) for name in (
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name)]


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5), seed: int = 0) -> torch.Tensor:
    """A tensor of random bit patterns (NaNs included: the bytes must travel unchanged)."""
    generator = torch.Generator().manual_seed(seed)
    count = 1
    for size in shape:
        count *= size
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def through_envelope(value: Any) -> Any:
    """As on gloo: header and body in one transfer into a posted receive with room to spare."""
    header, pieces = _encode(ACTIVATION, 4, 7, value)
    sent = _assemble(header, pieces, with_header=True, device=CPU)
    posted = torch.full((sent.numel() + 100,), 0xEE, dtype=torch.uint8)
    posted[:sent.numel()] = sent
    received = posted[:_HEADER_BYTES].view(torch.int64).tolist()
    return _decode(received, posted[_HEADER_BYTES:])


def through_two_messages(value: Any) -> Any:
    """As on NCCL (and on gloo past the capacity): the header, then a body of its exact size."""
    header, pieces = _encode(ACTIVATION, 4, 7, value)
    header_bytes = torch.tensor(header, dtype=torch.int64).view(torch.uint8).clone()
    body = _assemble(header, pieces, with_header=False, device=CPU)
    return _decode(header_bytes.view(torch.int64).tolist(), body.clone())


SENDS = pytest.mark.parametrize("send", [through_envelope, through_two_messages],
                                ids=["envelope", "header-then-body"])
Send = Callable[[Any], Any]


def assert_same(got: Any, want: Any) -> None:
    """Same structure, and each leaf the same: tensors bit for bit, with dtype, shape, flag."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor)
            assert (g.dtype, g.shape, g.requires_grad) == (w.dtype, w.shape, w.requires_grad)
            assert torch.equal(raw(g), raw(w))
        else:
            assert type(g) is type(w) and g == w


# ------------------------------------------------------------ round trips


def test_the_header_describes_the_stated_dtypes() -> None:
    assert set(_DTYPES) == set(HEADER_DTYPES)
    assert not set(SKELETON_DTYPES) & set(HEADER_DTYPES)


@SENDS
@pytest.mark.parametrize("dtype", HEADER_DTYPES, ids=str)
def test_a_tensor_of_a_header_dtype_travels_without_a_skeleton(send: Send,
                                                                dtype: torch.dtype) -> None:
    value = sample(dtype)
    assert _encode(ACTIVATION, 4, 7, value)[0][_SKELETON] == 0
    assert_same(send(value), value)


@SENDS
@pytest.mark.parametrize("dtype", HEADER_DTYPES + SKELETON_DTYPES, ids=str)
def test_every_dtype_travels_inside_a_structure(send: Send, dtype: torch.dtype) -> None:
    value = {"x": sample(dtype, (2, 3)), "rest": [sample(dtype, (5,), seed=1)]}
    assert _encode(ACTIVATION, 4, 7, value)[0][_SKELETON] > 0
    assert_same(send(value), value)


@SENDS
@pytest.mark.parametrize("dtype", SKELETON_DTYPES, ids=str)
def test_a_tensor_of_another_dtype_travels_with_a_skeleton(send: Send,
                                                           dtype: torch.dtype) -> None:
    value = sample(dtype)
    assert _encode(ACTIVATION, 4, 7, value)[0][_SKELETON] > 0
    assert_same(send(value), value)


@SENDS
@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (3, 0, 2), (1,) * 13],
                         ids=["0-dim", "empty", "0 rows", "0 in the middle", "13 dims"])
@pytest.mark.parametrize("wrap", [lambda t: t, lambda t: (t, t.sum())], ids=["alone", "nested"])
def test_empty_zero_dim_and_many_dim_tensors(send: Send, shape: tuple[int, ...],
                                             wrap: Callable[[torch.Tensor], Any]) -> None:
    value = wrap(torch.randn(shape, dtype=torch.float64))
    assert_same(send(value), value)


NON_CONTIGUOUS = {
    "transposed": lambda: torch.randn(4, 6).t(),
    "strided": lambda: torch.randn(4, 6)[:, ::2],
    "offset slice": lambda: torch.randn(4, 6)[1:3, 1:],
    "expanded": lambda: torch.randn(3, 1).expand(3, 4),
    "permuted": lambda: torch.randn(2, 3, 4, dtype=torch.float64).permute(2, 0, 1),
}


@SENDS
@pytest.mark.parametrize("make", NON_CONTIGUOUS.values(), ids=NON_CONTIGUOUS.keys())
def test_non_contiguous_tensors_arrive_with_their_values(send: Send,
                                                         make: Callable[[], torch.Tensor]) -> None:
    tensor = make()
    assert not tensor.is_contiguous()
    dense = any(tensor.permute(order).is_contiguous()  # a transposed or permuted one
                for order in itertools.permutations(range(tensor.dim())))
    for value in (tensor, {"v": tensor, "w": tensor}):
        got = send(value)
        assert_same(got, value)
        for arrived in pytree.tree_leaves(got):  # a permuted dense layout is kept
            assert arrived.stride() == tensor.stride() if dense else arrived.is_contiguous()


@SENDS
def test_nested_structures_keep_their_shape_and_plain_leaves(send: Send) -> None:
    value = {
        "hidden": (torch.randn(2, 3), [torch.arange(5), None, {"mask": torch.ones(3) > 0,
                                                              "heads": 4}]),
        "name": "causal",
        "scale": 0.5,
        "ids": [torch.tensor(9), "x", None, (1, 2)],
    }
    got = send(value)
    assert_same(got, value)
    assert isinstance(got["hidden"], tuple) and isinstance(got["hidden"][1], list)
    assert got["hidden"][1][2]["heads"] == 4 and got["ids"][3] == (1, 2)


@SENDS
@pytest.mark.parametrize("value", [None, 3, "text", (1, "a", None), {"k": [1, 2.5]}],
                         ids=["None", "int", "str", "tuple", "dict"])
def test_values_without_tensors(send: Send, value: Any) -> None:
    assert send(value) == value


@SENDS
def test_requires_grad_arrives_on_fresh_leaves(send: Send) -> None:
    weight = torch.randn(3, 3, requires_grad=True)
    activation = torch.randn(2, 3) @ weight  # not a leaf: it has a grad_fn
    complex_grad = torch.randn(2, dtype=torch.complex128, requires_grad=True)
    for value in (activation, {"a": activation, "b": torch.randn(2), "c": complex_grad}):
        got = send(value)
        assert_same(got, value)
        for leaf in pytree.tree_leaves(got):
            assert leaf.is_leaf and leaf.grad_fn is None


# -------------------------------------------------------- the layout drawn in envelope


def test_a_single_tensor_is_its_header_and_its_bytes() -> None:
    tensor = torch.randn(3, 5)
    header, pieces = _encode(ACTIVATION, 4, 7, tensor)
    assert header[:_SKELETON + 1] == [ACTIVATION, 4, 7, 60, 0]
    assert header[_DTYPE] == _DTYPES.index(torch.float32)
    assert header[_NDIM:_SHAPE + 3] == [2, 3, 5, 0]
    buffer = _assemble(header, pieces, with_header=True, device=CPU)
    assert buffer.numel() == _HEADER_BYTES + 60
    assert buffer[:_HEADER_BYTES].view(torch.int64).tolist() == header
    assert torch.equal(buffer[_HEADER_BYTES:], raw(tensor))


@pytest.mark.parametrize("container", [list, tuple])
@SENDS
def test_one_tensor_in_a_list_or_tuple_is_its_header_and_its_bytes(
        container: type, send: Send) -> None:
    # A stage's input gradients are a list, mostly of one tensor: no pickle for them.
    tensor = torch.randn(3, 5, dtype=torch.float64).requires_grad_()
    header, pieces = _encode(ACTIVATION, 4, 7, container([tensor]))
    assert header[_SKELETON] == 0 and header[_CONTAINER] == (1 if container is list else 2)
    assert header[_BODY] == tensor.numel() * 8
    got = send(container([tensor]))
    assert type(got) is container and len(got) == 1
    assert torch.equal(got[0], tensor) and got[0].requires_grad
    lone = send([torch.randn(2, 3).t()])  # a transposed one keeps its layout, in a skeleton
    assert type(lone) is list and lone[0].stride() == (1, 3)


def test_a_structure_is_a_padded_skeleton_then_aligned_tensors() -> None:
    assert [_padded(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]
    first, second = torch.randn(3), torch.randn(2, dtype=torch.float64)  # 12 and 16 bytes
    header, pieces = _encode(ACTIVATION, 4, 7, (first, "tag", second))
    skeleton = header[_SKELETON]
    assert skeleton % 64 == 0 and skeleton >= len(pieces[0]) > skeleton - 64
    assert header[_BODY] == skeleton + 64 + 64
    assert [offset for offset, _ in pieces[1:]] == [skeleton, skeleton + 64]
    body = _assemble(header, pieces, with_header=False, device=CPU)
    assert torch.equal(body[skeleton:skeleton + 12], raw(first))
    assert torch.equal(body[skeleton + 64:skeleton + 80], raw(second))


def test_an_abort_report_is_a_pickle_read_back_as_it_was() -> None:
    report = {"rank": 1, "error": "RuntimeError: boom", "stage": 1, "microbatch": 3,
              "action": "1F3"}
    header, pieces = _encode(_ABORT, -1, -1, pickle.dumps(report))
    buffer = _assemble(header, pieces, with_header=True, device=CPU)
    received = buffer[:_HEADER_BYTES].view(torch.int64).tolist()
    assert received[:3] == [_ABORT, -1, -1]
    assert _unpickle(buffer[_HEADER_BYTES:_HEADER_BYTES + received[_BODY]], "a report") == report


def test_an_abort_header_tells_where_the_failure_started_without_its_body() -> None:
    report = {"rank": 3, "error": "ValueError: injected", "stage": 6, "microbatch": 2,
              "action": "6F2"}
    header, pieces = _encode_abort(report)
    buffer = _assemble(header, pieces, with_header=True, device=CPU)
    received = buffer[:_HEADER_BYTES].view(torch.int64).tolist()
    assert _unpickle(buffer[_HEADER_BYTES:_HEADER_BYTES + received[_BODY]], "a report") == report
    assert _abort_summary(received, "Connection closed by peer") == {
        "rank": 3, "error": "its report was lost: Connection closed by peer", "stage": 6,
        "microbatch": 2, "action": "?"}


# ------------------------------------------------------------ malformed messages


def message(value: Any) -> tuple[list[int], torch.Tensor]:
    header, pieces = _encode(ACTIVATION, 4, 7, value)
    return header, _assemble(header, pieces, with_header=False, device=CPU)


def with_field(header: list[int], field: int, value: int) -> list[int]:
    changed = list(header)
    changed[field] = value
    return changed


WHAT = "the activation of micro-batch 7 for stage 4"


def test_a_truncated_body_names_the_message_and_both_sizes() -> None:
    header, body = message(torch.randn(3, 5))
    with pytest.raises(ConveyorError, match=f"^{WHAT} is truncated: its header announces a "
                                            "body of 60 bytes, 59 arrived$"):
        _decode(header, body[:-1])
    header, body = message({"x": torch.randn(3, 5)})
    for cut in (header[_BODY] - 1, header[_SKELETON] - 1, 10):
        with pytest.raises(ConveyorError, match=f"^{WHAT} is truncated: .*, {cut} arrived$"):
            _decode(header, body[:cut])


def test_a_header_of_the_wrong_length() -> None:
    header, body = message(torch.randn(3, 5))
    with pytest.raises(ConveyorError, match="^a message header has 20 fields, expected 32$"):
        _decode(header[:20], body)


@pytest.mark.parametrize("field, value, error", [
    (0, 5, r"a message header has kind code 5; known codes are \{0: 'activation', "
           r"1: 'gradient', 2: 'abort'\}"),
    (_DTYPE, 12, f"the header of {WHAT} gives dtype code 12 and 2 dims; known are codes "
                 "0-11, 0-12 dims"),
    (_NDIM, 13, f"the header of {WHAT} gives dtype code 0 and 13 dims"),
    (_SHAPE, -3, rf"the header of {WHAT} gives shape \[-3, 5\] of torch.float32 \(-60 bytes\) "
                 "and a body of 60 bytes"),
    (_SHAPE, 4, rf"the header of {WHAT} gives shape \[4, 5\] of torch.float32 \(80 bytes\) "
                "and a body of 60 bytes"),
    (_SKELETON, 64, f"the header of {WHAT} gives a skeleton of 64 bytes and a body of 60"),
    (_SKELETON, -1, f"the header of {WHAT} gives a skeleton of -1 bytes"),
    (_CONTAINER, 3, f"the header of {WHAT} gives container code 3; known are 0-2"),
], ids=["kind", "dtype", "ndim", "negative size", "shape", "skeleton", "negative skeleton",
        "container"])
def test_a_malformed_single_tensor_header(field: int, value: int, error: str) -> None:
    header, body = message(torch.randn(3, 5))
    with pytest.raises(ConveyorError, match=f"^{error}"):
        _decode(with_field(header, field, value), body)


def test_a_corrupt_skeleton_cannot_be_read() -> None:
    header, body = message({"x": torch.randn(3, 5)})
    body[:header[_SKELETON]] = 0xFF
    with pytest.raises(ConveyorError, match=rf"^the pickled part of {WHAT} \({header[_SKELETON]} "
                                            r"bytes\) cannot be read \(UnpicklingError: .*\): "
                                            "the message is corrupt or truncated$"):
        _decode(header, body)


def test_a_tensor_placed_past_the_announced_body() -> None:
    header, body = message({"x": torch.randn(3, 5)})
    short = with_field(header, _BODY, header[_SKELETON] + 32)
    with pytest.raises(ConveyorError, match=rf"^{WHAT} places a tensor of 60 bytes at byte "
                                            rf"{header[_SKELETON]} of a body of "
                                            rf"{header[_SKELETON] + 32}: the message is corrupt$"):
        _decode(short, body)


def test_random_bytes_behind_a_valid_kind_are_refused_by_name() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        noise = torch.randint(0, 256, (_HEADER_BYTES,), dtype=torch.uint8, generator=generator)
        header = with_field(noise.view(torch.int64).tolist(), 0, ACTIVATION)
        with pytest.raises(ConveyorError, match=r"the activation of micro-batch -?\d+ for "
                                                r"stage -?\d+"):
            _decode(header, torch.zeros(4096, dtype=torch.uint8))


def test_a_transposed_tensor_keeps_its_layout_through_a_message() -> None:
    """A stage's output handed on transposed (a batch norm over transposed features)
    arrives with the sender's strides: a dropout on it fills its mask in memory order,
    as it would have in one process (the generator's case found on processes). A
    tensor that is no permutation of a dense layout arrives contiguous, as before."""
    transposed = torch.randn(3, 4, 5).transpose(1, 2)
    for value in (transposed, {"h": transposed, "mask": torch.ones(3, 2).t()}):
        got = through_envelope(value)
        for sent, arrived in zip(pytree.tree_leaves(value), pytree.tree_leaves(got)):
            assert torch.equal(sent, arrived) and arrived.stride() == sent.stride()
    sliced = torch.randn(6, 4)[:, :2]
    arrived = through_envelope(sliced)
    assert torch.equal(arrived, sliced) and arrived.is_contiguous()
