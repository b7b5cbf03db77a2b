"""Mailboxes between the threads of one process: what LocalTransport promises.

Every receive runs on a thread of its own and is joined with a bound, so a transport
that loses a message or never wakes a receive fails the test instead of hanging it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conveyor.engine.transport import Aborted, LocalTransport, MessageKind, emulated_links

CPU = torch.device("cpu")
FINISH = 5.0  # seconds a receive that should return may take
WATCH = 0.05  # seconds a receive that should wait is watched, still waiting


class Receive:
    """``transport.recv(kind, stage, microbatch)`` on a thread, and what came of it."""

    def __init__(self, transport: LocalTransport, kind: MessageKind, stage: int,
                 microbatch: int, source: int | None = None) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        args=(transport, kind, stage, microbatch, source))
        self._thread.start()

    def _run(self, transport: LocalTransport, kind: MessageKind, stage: int,
             microbatch: int, source: int | None) -> None:
        try:
            self.value = transport.recv(kind, stage, microbatch, source=source)
        except BaseException as exc:  # noqa: BLE001 - handed to the test to check
            self.error = exc

    def waiting(self) -> bool:
        """Whether the receive is still waiting after a short watch."""
        self._thread.join(WATCH)
        return self._thread.is_alive()

    def finished(self) -> Receive:
        """Waits (boundedly) for the receive to return or raise."""
        self._thread.join(FINISH)
        assert not self._thread.is_alive(), f"the receive still waits after {FINISH} s"
        return self

    def result(self) -> Any:
        self.finished()
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture
def transport() -> Iterator[LocalTransport]:
    transport = LocalTransport([CPU, CPU, CPU])
    yield transport
    transport.abort(None)  # frees any receive that a failing test left waiting


def test_messages_meet_their_receive_whatever_the_send_order(transport: LocalTransport) -> None:
    kinds: list[MessageKind] = ["activation", "gradient"]
    keys = [(kind, stage, m) for kind in kinds for stage in range(3) for m in range(4)]
    sends = list(keys)
    random.Random(0).shuffle(sends)
    for kind, stage, m in sends:
        transport.send(kind, stage, m, torch.tensor([kinds.index(kind), stage, m]))
    for kind, stage, m in reversed(keys):
        got = Receive(transport, kind, stage, m).result()
        assert got.tolist() == [kinds.index(kind), stage, m]
    # Each message is taken once: its box is empty now.
    assert Receive(transport, "activation", 0, 0).waiting()


def test_a_receive_waits_for_its_own_message(transport: LocalTransport) -> None:
    receive = Receive(transport, "activation", 1, 2)
    assert receive.waiting()
    transport.send("activation", 1, 3, torch.zeros(1))  # another micro-batch
    transport.send("activation", 2, 2, torch.zeros(1))  # another stage
    transport.send("gradient", 1, 2, torch.zeros(1))  # another kind
    assert receive.waiting()
    transport.send("activation", 1, 2, torch.ones(1))
    assert torch.equal(receive.result(), torch.ones(1))


def test_messages_from_two_senders_to_one_stage_meet_their_own_receives(
        transport: LocalTransport) -> None:
    # Stage 2 takes stage 1's output and, over an edge, values stage 0 made.
    transport.send("activation", 2, 0, {"skip": torch.zeros(3)}, source=0)
    from_next = Receive(transport, "activation", 2, 0)  # from stage 1, by default
    assert from_next.waiting()
    assert torch.equal(Receive(transport, "activation", 2, 0, source=0).result()["skip"],
                       torch.zeros(3))
    transport.send("activation", 2, 0, torch.ones(2))
    assert torch.equal(from_next.result(), torch.ones(2))
    transport.send("gradient", 0, 0, [torch.ones(3, dtype=torch.float64)], source=2)
    assert Receive(transport, "gradient", 0, 0, source=2).result()[0].dtype == torch.float64
    # Every message counted by kind, sender and receiver: its tensors' bytes.
    counted = {key: (flow.messages, flow.bytes) for key, flow in transport.traffic.flows.items()}
    assert counted == {("activation", 0, 2): (1, 12), ("activation", 1, 2): (1, 8),
                       ("gradient", 2, 0): (1, 24)}
    assert (transport.traffic.bytes, transport.traffic.messages) == (44, 3)
    transport.traffic.clear()
    assert transport.traffic.bytes == 0 and transport.traffic.between(0, 2).messages == 0


def test_abort_wakes_every_waiting_receive(transport: LocalTransport) -> None:
    receives = [Receive(transport, "activation", 1, 0), Receive(transport, "gradient", 0, 3),
                Receive(transport, "activation", 2, 1)]
    assert all(receive.waiting() for receive in receives)
    transport.abort(RuntimeError("stage 2 failed"))
    expected = ["stage 1 stopped waiting for activation of micro-batch 0 from stage 0",
                "stage 0 stopped waiting for gradient of micro-batch 3 from stage 1",
                "stage 2 stopped waiting for activation of micro-batch 1 from stage 1"]
    for receive, message in zip(receives, expected, strict=True):
        with pytest.raises(Aborted, match=f"^{message}$"):
            receive.result()


def test_a_receive_after_an_abort_raises_at_once(transport: LocalTransport) -> None:
    transport.abort(None)
    with pytest.raises(Aborted, match="^stage 2 stopped waiting for gradient of micro-batch 5 "
                                      "from stage 3$"):
        Receive(transport, "gradient", 2, 5).result()


def test_reset_clears_an_abort(transport: LocalTransport) -> None:
    transport.abort(None)
    transport.reset()
    receive = Receive(transport, "activation", 1, 0)
    assert receive.waiting()  # not Aborted
    transport.send("activation", 1, 0, torch.ones(2))
    assert torch.equal(receive.result(), torch.ones(2))


def test_poll_raises_after_an_abort_until_reset(transport: LocalTransport) -> None:
    transport.poll()  # nothing aborted: returns
    transport.send("activation", 1, 0, torch.zeros(2))
    transport.poll()  # a message waiting for its receive is no reason to stop
    transport.abort(RuntimeError("stage 1 failed"))
    with pytest.raises(Aborted, match="^another rank failed; this rank stops before its "
                                      "next action$"):
        transport.poll()
    transport.reset()
    transport.poll()


def test_reset_empties_the_boxes(transport: LocalTransport) -> None:
    transport.send("activation", 1, 0, torch.zeros(2))  # left over from an aborted run
    transport.reset()
    receive = Receive(transport, "activation", 1, 0)
    assert receive.waiting()
    transport.send("activation", 1, 0, torch.ones(2))
    assert torch.equal(receive.result(), torch.ones(2))


def test_deliveries_are_detached_and_keep_requires_grad(transport: LocalTransport) -> None:
    weight = torch.randn(3, 3, requires_grad=True)
    activation = torch.randn(2, 3) @ weight  # part of the sender's graph
    mask = torch.ones(2, dtype=torch.bool)
    transport.send("activation", 1, 0, {"x": activation, "extra": (mask, "causal", 4)})
    got = Receive(transport, "activation", 1, 0).result()
    x = got["x"]
    assert x.requires_grad and x.is_leaf and x.grad_fn is None
    assert torch.equal(x, activation.detach())
    assert not got["extra"][0].requires_grad and torch.equal(got["extra"][0], mask)
    assert got["extra"][1:] == ("causal", 4)
    x.sum().backward()  # the receiver's backward stops at its own leaf
    assert x.grad is not None and weight.grad is None


def test_on_its_own_device_a_delivery_shares_the_senders_memory(transport: LocalTransport) -> None:
    sent = torch.randn(4)
    transport.send("gradient", 0, 0, sent)
    got = Receive(transport, "gradient", 0, 0).result()
    assert got is not sent and got.data_ptr() == sent.data_ptr()


def test_deliveries_land_on_the_receiving_stage_device() -> None:
    # The meta device stands in for a second device on a machine with a CPU only.
    transport = LocalTransport([CPU, torch.device("meta")])
    transport.send("activation", 1, 0, (torch.randn(2, 3, requires_grad=True), torch.ones(2)))
    first, second = Receive(transport, "activation", 1, 0).result()
    assert first.device.type == second.device.type == "meta"
    assert first.shape == (2, 3) and first.requires_grad and first.is_leaf
    assert second.shape == (2,) and not second.requires_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_deliveries_to_a_gpu_are_copies_there() -> None:
    transport = LocalTransport([CPU, torch.device("cuda", 0)])
    sent = torch.randn(2, 3, requires_grad=True)
    transport.send("activation", 1, 0, sent)
    got = Receive(transport, "activation", 1, 0).result()
    assert got.device == torch.device("cuda", 0) and got.requires_grad and got.is_leaf
    assert torch.equal(got.cpu(), sent.detach())


def test_emulated_links_hold_each_message_for_its_own_links_latency(
        transport: LocalTransport) -> None:
    far = {(1, 2)}  # stage 1 to stage 2 crosses between "nodes"; 0 to 1 stays within one
    with emulated_links(between=lambda a, b: (1e12, 0.3 if (a, b) in far else 0.0)):
        start = time.monotonic()
        transport.send("activation", 1, 0, torch.ones(1))  # from stage 0
        transport.send("activation", 2, 0, torch.ones(1))  # from stage 1
        Receive(transport, "activation", 1, 0).result()
        near_took = time.monotonic() - start
        Receive(transport, "activation", 2, 0).result()
        far_took = time.monotonic() - start
    assert near_took < 0.3 <= far_took
    with pytest.raises(ValueError, match="link 0->1 needs bandwidth > 0"), \
            emulated_links(between=lambda a, b: (0.0, 0.0)):
        transport.send("activation", 1, 1, torch.ones(1))
