"""A step's data calls over sockets of their own: frames written straight to a TCP connection.

A round trip over torch RPC costs its caller about 240 us of CPU carrying nothing, and its
answers are decoded on TensorPipe's threads, which take the GIL from the trainer's loop
(``benchmarks/bench_rpc_floor.py``). The calls that move a step's data are a job's hottest path,
so they travel here instead (``--data-sockets``, on by default): one connection per trainer
and server; each call a small header, the call's frame (:mod:`paramserver.wire.frames`) and its
large tensors' bytes, written with one ``sendmsg``; each answer likewise, matched to its call by
number. Control calls stay on RPC, which also tells a trainer where a server listens
(:mod:`paramserver.transport.rpc`).

A server listens (:class:`FrameListener`) where its RPC agent does (loopback in local jobs;
see :func:`listening_host`), with a thread per connection that reads calls and hands them to
the endpoint. A trainer's :class:`FrameConnection` reads answers on a thread of its own, where
their futures complete. Each side writes through the connection's :class:`_Outbox`, which
never blocks the writing thread: a trainer's loop, or a server's thread completing a sync
round's answers to every trainer.

Failures read as over RPC: a connection that breaks fails every call under way with the
caller's error for a lost server; a call not answered within its timeout fails alike, and its
late answer is dropped. A server's own error travels pickled whole and is raised as it is. A
message the server cannot read (a header out of bounds, a damaged frame) closes the connection,
and the server goes on serving the others.

A message, little-endian::

    call number u64 | kind u8 (call, answer, error) | large tensors u16 | frame bytes u64
    | bytes after this header u64
    | per large tensor: dtype code u8, dimensions u8, sizes i64 each
    | the frame, from an offset aligned to 8
    | the large tensors' bytes, in order, each from an offset aligned to 8

A receiver reads a message in two calls (its header, then the rest into one buffer, whose
views its large tensors are), so a trainer's reader thread takes the GIL once per answer.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import math
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from paramserver.errors import ConfigError
from paramserver.transport.base import Endpoint
from paramserver.wire import frames
from paramserver.wire.frames import FrameError

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<QBHQQ")
_LARGE = struct.Struct("<BB")
_CALL, _ANSWER, _ERROR = 0, 1, 2
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(frames.DTYPES)}  # a large tensor's dtype
_MAX_DIMS = 8
_ALIGN = 8  # each large tensor starts at a multiple of this in its message
_PADDING = memoryview(bytes(_ALIGN))
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
DEADLINE_POLL_S = 0.1  # how often a connection looks for calls past their timeout
# A message this large is written by its connection's writer thread (see _Outbox); a smaller
# one costs less written at once than handed over.
WRITE_AHEAD_BYTES = 256 * 1024

# What a call fails with where its answer cannot come: ``lost(cause, timed_out)``.
Lost = Callable[[str, bool], BaseException]


class ConnectionLost(ConnectionError):
    """A connection that broke, was closed, or carried what cannot be read."""


def listening_host(loopback_only: bool) -> str:
    """Where a server listens for data calls: loopback in a local job; else the address of
    ``TP_SOCKET_IFNAME``'s interface, where TensorPipe listens too, or, without it, the
    address this host reaches ``MASTER_ADDR`` from (its hostname's where neither is set)."""
    if loopback_only:
        return "127.0.0.1"
    interface = os.environ.get("TP_SOCKET_IFNAME")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        if interface:
            packed = struct.pack("256s", interface.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, packed)
            except OSError as error:
                raise ConfigError(
                    f"TP_SOCKET_IFNAME={interface} names no interface with an IPv4 address "
                    f"here ({error.strerror}): name the interface of the hosts' network"
                ) from error
            return socket.inet_ntoa(answer[20:24])
        master = os.environ.get("MASTER_ADDR")
        if master:
            probe.connect((master, 1))  # a datagram socket's connect sends nothing
            return str(probe.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())


def _message(number: int, kind: int, frame: bytes | bytearray | memoryview,
             large: list[Tensor]) -> list[memoryview]:  # fmt: skip
    """A message's bytes as buffers to write in order (the large tensors' own, not copied)."""
    described = bytearray()
    for tensor in large:
        described += _LARGE.pack(_DTYPE_CODES[tensor.dtype], tensor.dim())
        described += struct.pack(f"<{tensor.dim()}q", *tensor.shape)
    described += bytes(_aligned(len(described)) - len(described))  # the frame starts aligned
    buffers = [memoryview(described), memoryview(frame)]
    at = len(described) + len(frame)
    for tensor in large:
        if tensor.numel():
            buffers += [_PADDING[: _aligned(at) - at], _bytes_of(tensor)]
            at = _aligned(at) + buffers[-1].nbytes
    return [memoryview(_HEAD.pack(number, kind, len(large), len(frame), at)), *buffers]


def _write(sock: socket.socket, buffers: list[memoryview], flags: int = 0) -> list[memoryview]:
    """Write ``buffers`` in order; what is left of them where the socket would block
    (``flags`` ``MSG_DONTWAIT``), else nothing."""
    while buffers:
        try:
            sent = sock.sendmsg(buffers, [], flags)
        except BlockingIOError:
            return buffers
        while buffers and sent >= buffers[0].nbytes:  # a write may stop part of the way
            sent -= buffers.pop(0).nbytes
        if buffers:
            buffers[0] = buffers[0][sent:]
    return buffers


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _bytes_of(tensor: Tensor) -> memoryview:
    """A contiguous tensor's bytes, in place."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy().data)


def _read(sock: socket.socket, nbytes: int) -> bytearray:
    data = bytearray(nbytes)
    view, at = memoryview(data), 0
    while at < nbytes:  # in one call where it all came (MSG_WAITALL), as it almost always has
        got = sock.recv_into(view[at:], nbytes - at, socket.MSG_WAITALL)
        if got == 0:
            raise ConnectionLost("the peer closed the connection")
        at += got
    return data


def _receive(sock: socket.socket, max_bytes: int) -> tuple[int, int, memoryview, list[Tensor]]:
    """The next message: its number, kind, frame and large tensors (views of the message,
    which the receiver owns). A message over ``max_bytes``, or one whose parts do not add up
    to it, raises :class:`ConnectionLost`."""
    number, kind, num_large, frame_bytes, body_bytes = _HEAD.unpack(_read(sock, _HEAD.size))
    if body_bytes > max_bytes:
        raise ConnectionLost(f"a message of {body_bytes} bytes, over the limit of {max_bytes}")
    body = _read(sock, body_bytes)
    view, at = memoryview(body), 0
    shapes: list[tuple[torch.dtype, tuple[int, ...]]] = []
    try:
        for _ in range(num_large):
            code, dims = _LARGE.unpack_from(body, at)
            if code >= len(frames.DTYPES) or dims > _MAX_DIMS:
                raise ConnectionLost(f"a tensor of dtype code {code} and {dims} dimensions")
            shapes.append((frames.DTYPES[code], struct.unpack_from(f"<{dims}q", body, at + 2)))
            at += 2 + 8 * dims
        at = _aligned(at)
        frame = view[at : at + frame_bytes]
        at += frame_bytes
        large = []
        for dtype, shape in shapes:
            numel = math.prod(shape)
            if numel == 0:
                large.append(torch.empty(shape, dtype=dtype))
                continue
            at = _aligned(at)
            large.append(torch.frombuffer(body, dtype=dtype, count=numel, offset=at).view(shape))
            at += numel * dtype.itemsize
    except (struct.error, ValueError, RuntimeError) as error:
        raise ConnectionLost(f"a message whose parts do not fit it: {error}") from error
    if at != body_bytes or frame.nbytes != frame_bytes:
        raise ConnectionLost("a message whose parts do not add up to its size")
    return number, kind, frame, large


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected (any more)
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class _Outbox:
    """Writes a connection's messages in order without blocking the sender: a small one at
    once where the socket takes it whole; a large one (whose copy into the kernel, about
    0.1 ms a MB, then runs beside the sender, as TensorPipe's writes do), and what the socket
    did not take of a small one, by a writer thread of its own, behind which later messages
    queue. ``failed(error)`` hears of a write that failed, on the writer thread."""

    def __init__(self, sock: socket.socket, failed: Callable[[OSError], None], name: str):
        self._sock, self._failed = sock, failed
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._unwritten: collections.deque[list[memoryview]] = collections.deque()
        self._closed = False
        threading.Thread(target=self._write_queued, name=name, daemon=True).start()

    def put(self, buffers: list[memoryview]) -> None:
        """Write ``buffers`` after every message put before; raises OSError where the socket
        failed, or :class:`ConnectionLost` once closed."""
        with self._lock:
            if self._closed:
                raise ConnectionLost("the connection was closed")
            if not self._unwritten and sum(b.nbytes for b in buffers) < WRITE_AHEAD_BYTES:
                buffers = _write(self._sock, buffers, socket.MSG_DONTWAIT)
            if buffers:
                self._unwritten.append(buffers)
                self._queued.notify()

    def close(self) -> None:
        """Drop what is unwritten and stop the writer (the socket is the owner's to close)."""
        with self._lock:
            self._closed = True
            self._unwritten.clear()
            self._queued.notify()

    def _write_queued(self) -> None:
        while True:
            with self._lock:
                while not self._unwritten and not self._closed:
                    self._queued.wait()
                if self._closed:
                    return
                buffers = self._unwritten[0]
            try:
                _write(self._sock, buffers)
            except OSError as error:
                self._failed(error)
                return
            with self._lock:
                if self._unwritten:  # (close() may have emptied it)
                    self._unwritten.popleft()  # only now: later messages queue behind it


class FrameListener:
    """A server's listening socket (on ``port``; 0: any free one), handing the calls of every
    connection to ``endpoint``; :attr:`address` is where trainers connect. A message over
    ``max_bytes`` closes its connection."""

    def __init__(self, endpoint: Endpoint, host: str, max_bytes: int, port: int = 0):
        self.endpoint, self.max_bytes = endpoint, max_bytes
        self._sock = socket.create_server((host, port))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="frames-accept", daemon=True).start()

    def close(self) -> None:
        """Stop listening and close every connection."""
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, set()
        self._sock.close()
        for conn in connections:
            _close(conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    _close(conn)
                    return
                self._connections.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="frames-serve", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        # Answers go out on the connection's own writer: a trainer that stops reading holds
        # up no other connection's thread, which may complete its answer (a sync round).
        outbox = _Outbox(conn, lambda error: _close(conn), "frames-answer")
        try:
            while True:
                number, kind, frame, large = _receive(conn, self.max_bytes)
                if kind != _CALL:
                    raise ConnectionLost(f"a message of kind {kind} where a call was due")
                self._handle(outbox, number, frame, large)
        except (OSError, ConnectionLost) as error:
            log.debug("a data connection ended: %s", error)
        finally:
            with self._lock:
                self._connections.discard(conn)
            outbox.close()
            _close(conn)

    def _handle(self, outbox: _Outbox, number: int, frame: memoryview,
                large: list[Tensor]) -> None:  # fmt: skip
        def answer(done: Future) -> None:
            try:
                message = frames.encode(done.value())
            except BaseException as error:  # the server's own error, or one encoding
                _answer(outbox, number, _ERROR, _pickled(error))
                return
            _answer(outbox, number, _ANSWER, *message)

        try:
            op, args = frames.decode(frame, large)
        except FrameError as error:
            _answer(outbox, number, _ERROR, _pickled(error))
            return
        self.endpoint.handle(op, args).add_done_callback(answer)


def _pickled(error: BaseException) -> bytes:
    try:
        return pickle.dumps(error)
    except Exception:  # an error that does not pickle arrives as its type's name and text
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


def _answer(outbox: _Outbox, number: int, kind: int, frame: bytes | bytearray,
            large: list[Tensor] | None = None) -> None:  # fmt: skip
    try:
        outbox.put(_message(number, kind, frame, large or []))
    except (OSError, ConnectionLost) as error:  # the trainer is gone: its calls fail there
        log.debug("an answer could not be written: %s", error)


class FrameConnection:
    """A trainer's connection to one server. :meth:`call` is safe from any thread; a call's
    future completes on the connection's reader thread. Connecting waits ``connect_timeout_s``
    at most (0: no limit)."""

    def __init__(self, address: tuple[str, int], connect_timeout_s: float):
        self.address = address
        self._sock = socket.create_connection(address, timeout=connect_timeout_s or None)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, float, Lost]] = {}
        self._next = 0
        self.broken: BaseException | None = None  # why the connection is no longer usable
        self._outbox = _Outbox(self._sock, self._write_failed, "frames-write")
        for run, name in ((self._read_answers, "frames-read"), (self._watch, "frames-watch")):
            threading.Thread(target=run, name=name, daemon=True).start()

    def call(self, op: str, args: tuple[Any, ...], timeout_s: float, lost: Lost) -> Future:
        """The answer to ``op(*args)``: its value, the server's own error, or ``lost``'s
        where the connection broke or no answer came within ``timeout_s`` (0: no limit).

        Never blocks on the socket (see :class:`_Outbox`), so ``args``' large tensors must
        stay unchanged until the answer comes, as over RPC."""
        answer: Future = Future()
        frame, large = frames.encode((op, args))
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
        with self._lock:
            broken = self.broken
            if broken is None:
                number = self._next
                self._next += 1
                self._pending[number] = (answer, deadline, lost)
                try:
                    self._outbox.put(_message(number, _CALL, frame, large))
                except (OSError, ConnectionLost) as error:
                    broken = ConnectionLost(f"writing a call failed: {error}")
        if broken is not None:
            self._break(broken)
            if not answer.done():
                answer.set_exception(lost(str(broken), False))
        return answer

    def close(self) -> None:
        """Close the connection; calls under way fail as lost."""
        self._break(ConnectionLost("the connection was closed"))

    def _break(self, cause: BaseException) -> None:
        """Mark the connection broken and fail every call under way (outside the lock: their
        callbacks may call again)."""
        with self._lock:
            if self.broken is None:
                self.broken = cause
                _close(self._sock)
                self._outbox.close()
            pending, self._pending = self._pending, {}
        for answer, _, lost in pending.values():
            answer.set_exception(lost(str(self.broken), False))

    def _write_failed(self, error: OSError) -> None:
        self._break(ConnectionLost(f"writing a call failed: {error}"))

    def _read_answers(self) -> None:
        try:
            while True:
                number, kind, frame, large = _receive(self._sock, 1 << 62)
                with self._lock:
                    waiting = self._pending.pop(number, None)
                if waiting is None:
                    continue  # its timeout passed: it failed already
                answer = waiting[0]
                try:
                    value = pickle.loads(frame) if kind == _ERROR else frames.decode(frame, large)
                except (FrameError, pickle.UnpicklingError) as error:
                    answer.set_exception(error)
                    continue
                if kind == _ERROR:
                    answer.set_exception(value)
                else:
                    answer.set_result(value)
        except (OSError, ConnectionLost) as error:
            self._break(error)

    def _watch(self) -> None:
        while self.broken is None:
            time.sleep(DEADLINE_POLL_S)
            now = time.monotonic()
            with self._lock:
                late = [n for n, (_, deadline, _) in self._pending.items() if deadline < now]
                expired = [self._pending.pop(n) for n in late]
            for answer, _, lost in expired:
                answer.set_exception(lost("no answer in time", True))
