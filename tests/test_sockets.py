"""A step's data calls over sockets of their own (paramserver.transport.sockets), as a trainer's
RpcTransport makes them: answers arrive equal and matched to their calls in any order, a
server's error keeps its type, a broken connection or a call past its timeout is a
ServerLostError naming the server, the next call connects again, and a peer's nonsense closes
only its own connection. A whole job gives the same model with the sockets as without."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.futures import Future

import paramserver as ps
from paramserver.errors import ConfigError, InvalidPushError, ServerLostError
from paramserver.futures import completed, failed
from paramserver.transport import rpc as rpc_transport
from paramserver.transport import sockets
from paramserver.transport.rpc import RpcTransport
from paramserver.transport.sockets import FrameListener
from paramserver.wire import frames
from paramserver.wire.frames import FrameError
from tests.helpers import TinyRecModel, mse, tiny_batches
from tests.procs import wait_until

MAX_BYTES = 1 << 24


class Echo:
    """Answers each call with its ``(op, args)``; a call whose first argument is "hold" waits
    until :meth:`release`, which answers the held calls last first."""

    def __init__(self) -> None:
        self.held: list[tuple[Future, Any]] = []
        self.calls = 0

    def handle(self, op: object, args: Any) -> Future:
        self.calls += 1
        if args and isinstance(args[0], str) and args[0] == "hold":
            answer: Future = Future()
            self.held.append((answer, (op, args)))
            return answer
        if args and isinstance(args[0], Exception):
            return failed(args[0])
        return completed((op, args))

    def release(self) -> None:
        for answer, value in reversed(self.held):
            answer.set_result(value)
        self.held.clear()


@pytest.fixture
def listener() -> Iterator[FrameListener]:
    served = FrameListener(Echo(), "127.0.0.1", MAX_BYTES)
    yield served
    served.close()


def transport_to(monkeypatch: pytest.MonkeyPatch, listeners: list[FrameListener]) -> RpcTransport:
    """A trainer's transport whose servers listen at ``listeners`` (what RPC would tell it;
    the list may change, as a restarted server's address does)."""
    transport = RpcTransport(num_servers=len(listeners), timeout_s=60.0)
    monkeypatch.setattr(transport, "_address", lambda server, timeout: listeners[server].address)
    return transport


def test_answers_arrive_equal_and_each_to_its_call(
    monkeypatch: pytest.MonkeyPatch, listener: FrameListener
) -> None:
    transport = transport_to(monkeypatch, [listener])
    values = {
        "small": torch.arange(7),
        "large": torch.randn(300, 64),  # beside the frame
        "bf16": torch.randn(5000, dtype=torch.bfloat16),
        "bool": torch.rand(20000) > 0.5,
        "empty": torch.zeros(0, 16),
        "other": [1, "two", None],
    }
    op, args = transport.call(0, "push_pull", values).wait()
    assert op == "push_pull"
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            assert args[0][name].dtype == value.dtype and torch.equal(args[0][name], value)
        else:
            assert args[0][name] == value
    # Answered in the reverse order of their calls, each still reaches its own.
    held = [transport.call(0, "pull", "hold", torch.full((5000,), i)) for i in range(5)]
    endpoint = listener.endpoint
    assert isinstance(endpoint, Echo)
    wait_until(lambda: len(endpoint.held) == 5, 10, "five held calls")
    endpoint.release()
    for i, future in enumerate(held):
        assert torch.equal(future.wait()[1][1], torch.full((5000,), i))
    transport.close()


def test_a_servers_error_arrives_as_itself(
    monkeypatch: pytest.MonkeyPatch, listener: FrameListener
) -> None:
    transport = transport_to(monkeypatch, [listener])
    refused = InvalidPushError("NaN in gradient", param="mlp.0.weight", server=0)
    with pytest.raises(InvalidPushError, match="^server 0: parameter 'mlp.0.weight': NaN"):
        transport.call(0, "push_pull", refused).wait()
    transport.close()


def test_a_broken_connection_is_a_lost_server_and_the_next_call_connects_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = FrameListener(Echo(), "127.0.0.1", MAX_BYTES)
    second = FrameListener(Echo(), "127.0.0.1", MAX_BYTES)
    servers = [second, first]
    transport = transport_to(monkeypatch, servers)
    under_way = transport.call(1, "push_pull", "hold")
    wait_until(lambda: first.endpoint.held, 10, "the held call")  # type: ignore[attr-defined]
    first.close()  # as a server that died
    with pytest.raises(ServerLostError, match="^server 1 was lost: push_pull failed") as caught:
        under_way.wait()
    assert caught.value.server == 1
    servers[1] = FrameListener(Echo(), "127.0.0.1", MAX_BYTES)  # restarted elsewhere
    try:
        assert transport.call(1, "push_pull", 7).wait() == ("push_pull", (7,))
        assert transport.call(0, "pull", 8).wait() == ("pull", (8,))
    finally:
        transport.close()
        servers[1].close()
        second.close()


def test_a_call_past_its_timeout_is_a_lost_server_and_its_late_answer_is_dropped(
    monkeypatch: pytest.MonkeyPatch, listener: FrameListener
) -> None:
    transport = transport_to(monkeypatch, [listener])
    late = transport.call(0, "push_pull", "hold", timeout_s=0.3)
    with pytest.raises(ServerLostError, match=r"^server 0 did not answer push_pull within 0.3 s"):
        late.wait()
    listener.endpoint.release()  # type: ignore[attr-defined]
    assert transport.call(0, "push_pull", 1).wait() == ("push_pull", (1,))
    transport.close()


HEAD = "<QBHQQ"  # as the module docstring lays a message out


def raw_message(number: int, frame: bytes, body_bytes: int | None = None) -> bytes:
    """A call with no large tensors, written here from the documented layout."""
    claimed = len(frame) if body_bytes is None else body_bytes
    return struct.pack(HEAD, number, 0, 0, len(frame), claimed) + frame


def test_a_frame_of_another_version_is_refused_to_its_caller(listener: FrameListener) -> None:
    frame = bytearray(frames.encode(("push_pull", ()))[0])
    struct.pack_into("<H", frame, 4, frames.VERSION + 1)
    with socket.create_connection(listener.address) as peer:
        peer.sendall(raw_message(3, bytes(frame)))
        head = peer.recv(struct.calcsize(HEAD), socket.MSG_WAITALL)
        number, kind, _, size, _ = struct.unpack(HEAD, head)
        error = pickle.loads(peer.recv(size, socket.MSG_WAITALL))
    assert (number, kind) == (3, 2) and isinstance(error, FrameError)
    assert f"version {frames.VERSION + 1}" in str(error)


def test_nonsense_closes_only_its_own_connection(
    monkeypatch: pytest.MonkeyPatch, listener: FrameListener
) -> None:
    transport = transport_to(monkeypatch, [listener])
    assert transport.call(0, "push_pull", 1).wait() == ("push_pull", (1,))
    # A frame claimed over the limit (the server would otherwise wait for it), then a header
    # of no known form.
    for junk in (raw_message(0, b"", body_bytes=MAX_BYTES + 1), b"\xff" * 64):
        with socket.create_connection(listener.address) as peer:
            peer.sendall(junk)
            peer.settimeout(5)
            assert peer.recv(1) == b""  # closed by the server at once
    assert transport.call(0, "push_pull", 2).wait() == ("push_pull", (2,))
    assert listener.endpoint.calls == 2  # type: ignore[attr-defined]
    transport.close()


def test_a_server_listens_where_its_rpc_agent_does(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sockets.listening_host(loopback_only=True) == "127.0.0.1"  # a local job
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")  # torchrun's, an interface named
    assert sockets.listening_host(loopback_only=False) == "127.0.0.1"
    monkeypatch.delenv("TP_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # none named: the way to the master
    assert sockets.listening_host(loopback_only=False) == "127.0.0.1"
    monkeypatch.setenv("TP_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ConfigError, match="TP_SOCKET_IFNAME=nosuch0 names no interface"):
        sockets.listening_host(loopback_only=False)


@pytest.mark.system
@pytest.mark.timeout(180)
def test_a_job_ends_with_the_same_model_with_or_without_data_sockets() -> None:
    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        return tiny_batches(trainer, num_batches=20)

    def trained(data_sockets: bool) -> dict[str, torch.Tensor]:
        config = ps.TrainConfig(
            servers=2, trainers=2, mode="sync", launcher="processes", progress=False,
            data_sockets=data_sockets,
        )  # fmt: skip
        result = ps.train(TinyRecModel, data, mse, config)
        assert result.summary["steps"] == 20 * 2
        return result.model.state_dict()

    with_sockets, without = trained(True), trained(False)
    assert with_sockets.keys() == without.keys()
    for name, value in with_sockets.items():
        assert torch.equal(value, without[name]), name


def test_calls_from_many_threads_each_get_their_answer(
    monkeypatch: pytest.MonkeyPatch, listener: FrameListener
) -> None:
    transport = transport_to(monkeypatch, [listener])
    answers: dict[int, Any] = {}

    def caller(index: int) -> None:
        answers[index] = [transport.call(0, "pull", index, k).wait() for k in range(20)]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert answers == {i: [("pull", (i, k)) for k in range(20)] for i in range(4)}
    transport.close()


def test_large_calls_are_written_in_order_and_never_block_the_caller(
    monkeypatch: pytest.MonkeyPatch, listener: FrameListener
) -> None:
    transport = transport_to(monkeypatch, [listener])
    sizes = [3 << 20, 10, 1 << 20, 7, 5 << 20, 3]  # large (the writer's) and small, mixed
    calls = [transport.call(0, "push_pull", torch.full((n // 4 + 1,), float(n))) for n in sizes]
    for n, call in zip(sizes, calls, strict=True):
        assert torch.equal(call.wait()[1][0], torch.full((n // 4 + 1,), float(n)))
    transport.close()
    # A server that reads nothing: a call far larger than the socket's buffers still returns
    # at once, and fails as lost when the connection is closed.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        connection = sockets.FrameConnection(silent.getsockname()[:2], 10.0)
        started = time.monotonic()
        stuck = connection.call("push_pull", (torch.zeros(16 << 20),), 0, lambda c, t: OSError(c))
        assert time.monotonic() - started < 5 and not stuck.done()
        connection.close()
        with pytest.raises(OSError, match="closed"):
            stuck.wait()


class Round:
    """A sync round's shape: ``hold`` calls wait; a ``release`` call answers them all (on the
    releasing call's thread), then itself."""

    def __init__(self) -> None:
        self.held: list[tuple[Future, Any]] = []

    def handle(self, op: object, args: Any) -> Future:
        if op == "hold":
            answer: Future = Future()
            self.held.append((answer, args))
            return answer
        for answer, value in self.held:
            answer.set_result(value)
        return completed("released")


def test_a_trainer_that_stops_reading_holds_up_no_other_connection() -> None:
    listener = FrameListener(Round(), "127.0.0.1", 1 << 28)
    try:
        with socket.create_connection(listener.address) as silent:
            # Its held call's answer (64 MB) is more than the sockets' buffers take.
            frame, large = frames.encode(("hold", (torch.zeros(16 << 20),)))
            sockets._write(silent, sockets._message(0, 0, frame, large))
            wait_until(lambda: listener.endpoint.held, 10, "the held call")  # type: ignore[attr-defined]
            other = sockets.FrameConnection(listener.address, 10.0)
            answer = other.call("release", (), 10.0, lambda c, t: OSError(c))
            assert answer.wait() == "released"
            other.close()
    finally:
        listener.close()


def test_a_server_that_cannot_be_reached_is_a_lost_server(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        address = closed.getsockname()[:2]
    transport = RpcTransport(num_servers=1, timeout_s=60.0)
    monkeypatch.setattr(transport, "_address", lambda server, timeout: address)
    with pytest.raises(ServerLostError, match="^server 0 was lost: pull failed with .*refused"):
        transport.call(0, "pull", 1).wait()


def test_a_new_world_asks_the_address_again_and_keeps_a_connection_where_it_did_not_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = FrameListener(Echo(), "127.0.0.1", MAX_BYTES)
    restarted = FrameListener(Echo(), "127.0.0.1", MAX_BYTES)
    servers, world = [first], [0]
    monkeypatch.setattr(rpc_transport, "generation", lambda: world[0])
    transport = transport_to(monkeypatch, servers)
    try:
        transport.call(0, "pull", 1).wait()
        kept = transport._connections[0][1]
        world[0] = 1  # a member was restarted: this server kept its address
        transport.call(0, "pull", 2).wait()
        assert transport._connections[0][1] is kept and kept is not None
        servers[0], world[0] = restarted, 2  # this server was restarted elsewhere
        assert transport.call(0, "pull", 3).wait() == ("pull", (3,))
        assert kept.broken is not None  # the old connection was closed
        assert [listener.endpoint.calls for listener in (first, restarted)] == [2, 1]  # type: ignore[attr-defined]
    finally:
        transport.close()
        first.close()
        restarted.close()
