"""HTTP connections under a deadline and a cap: uvicorn's httptools connection, with what a
serving endpoint needs that uvicorn leaves to a proxy in front of it.

An event loop holds a connection for the price of a socket and a few objects, so idle and
slow clients cost no thread; what they must not cost is other clients' answers. Each
connection is, at any moment, either *waiting* (for a request to arrive whole: idle between
requests, or trickling one in) or *busy* (its request read whole, its answer not yet handed to
the socket), and:

- each phase must end within ``timeout_s`` of the last one's end: a request arrive whole (the
  first, or the next on a kept-alive connection), its answer be handed to the socket (a client
  that does not read its answers stalls there); otherwise the connection is dropped, what is
  unsent with it (uvicorn alone has no deadline on a first request, nor on one trickled a byte
  at a time);
- at most ``max_connections`` are open: at the cap a new connection drops the one that has
  waited longest for its request, so idle and slow connections never shut out a new client;
  only where every open connection is busy is the new one answered 503 and closed;
- a request's head (its line and headers) is at most :data:`MAX_HEAD_BYTES` (431 beyond:
  httptools sets no limit of its own);
- a connection is closed gently (:meth:`Connection.linger`): its last answer, then a
  half-close, and what the client still sends dropped until it closes, so a client refused
  while sending (413, 411, 503) reads its answer instead of a reset.

Each connection is a file: :func:`fit_open_files` raises the process's soft limit of open
files to fit ``max_connections`` (up to the hard limit; beyond it the cap is lowered, with a
warning). Everything else here runs on the server's event loop thread; nothing is locked.
Everything here runs on the server's event loop thread; nothing is locked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10
REFUSED_LINGER_S = 1.0  # the most a refused connection waits for its client to close first
SPARE_FILES = 256  # open files the serving process needs beside its HTTP connections


class ConnectionLimits:
    """Every open connection of one HTTP server, waiting ones oldest first (see the module
    doc)."""

    def __init__(self, timeout_s: float, max_connections: int):
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self.waiting: dict[Connection, None] = {}  # a dict for its order: the oldest wait first
        self.busy: set[Connection] = set()

    def admit(self, connection: Connection) -> bool:
        """Whether ``connection`` may stay open; at the cap, the longest waiting one is
        dropped for it."""
        if len(self.waiting) + len(self.busy) < self.max_connections:
            return True
        if not self.waiting:
            return False
        oldest = next(iter(self.waiting))
        self.forget(oldest)
        oldest.drop()
        return True

    def mark(self, connection: Connection, *, busy: bool) -> None:
        self.forget(connection)  # a wait starts over: to the end of the order
        if busy:
            self.busy.add(connection)
        else:
            self.waiting[connection] = None

    def forget(self, connection: Connection) -> None:
        self.waiting.pop(connection, None)
        self.busy.discard(connection)


class _LingeringTransport:
    """A connection's transport as uvicorn sees it, whose ``close`` lingers (see
    :meth:`Connection.linger`); the rest is the transport's."""

    def __init__(self, transport: asyncio.Transport, connection: Connection):
        self._transport, self._connection = transport, connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._connection.linger()

    def is_closing(self) -> bool:
        return self._connection.lingering or self._transport.is_closing()


class Connection(HttpToolsProtocol):
    """One HTTP connection under its server's :class:`ConnectionLimits` (see the module doc);
    :func:`connection_class` binds the limits."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._socket: asyncio.Transport = None  # type: ignore[assignment]
        self._refused = self.lingering = self._lost = False
        self._head_bytes: int | None = 0  # bytes of a request head so far; None: none unread

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._socket = transport  # type: ignore[assignment]
        super().connection_made(_LingeringTransport(self._socket, self))  # type: ignore[arg-type]
        # An answer's head and body are two writes: without this the body waits for the
        # client's delayed ACK of the head (40 ms). asyncio sets it only on sockets made
        # with proto IPPROTO_TCP, which an accepted socket of socket.create_server is not.
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.limits.admit(self):
            self._refuse()
            return
        self._start_phase(busy=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        super().connection_lost(exc)
        if self._deadline is not None:
            self._deadline.cancel()
        self.limits.forget(self)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # its last answer is sent: what the client sends is read and dropped
        reading_head = self._head_bytes is not None
        super().data_received(data)
        if reading_head and self._head_bytes is not None:  # a head still not whole
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._answer_and_linger(431, f"a request's head is over {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        answered = self.cycle.response_complete  # refused before its body came (413, 411)
        super().on_message_complete()
        if not answered:
            self._start_phase(busy=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._start_phase(busy=False)

    def shutdown(self) -> None:
        """The server stops: drop this connection now (uvicorn would wait on its request)."""
        self.drop()

    def drop(self) -> None:
        """Close at once, dropping what is unsent: a client past its deadline, or the one
        waiting longest at the cap."""
        self._socket.abort()

    def linger(self) -> None:
        """Close gently, as every close of uvicorn's is made: the last answer sent, then the
        end of the stream (a half-close), and what the client sends meanwhile read and dropped,
        until it closes too or its deadline passes (a socket closed with a request unread is
        reset, and the client could lose the answer: a 413's client is still sending)."""
        if self.lingering or self._lost:
            return
        self.lingering = True
        if self._refused:  # not counted under the cap: a short deadline of its own
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(REFUSED_LINGER_S, self.drop)
        else:
            self._start_phase(busy=False)
        if not self._socket.is_closing() and self._socket.can_write_eof():
            self._socket.write_eof()

    def _start_phase(self, *, busy: bool) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.limits.timeout_s, self.drop)
        self.limits.mark(self, busy=busy)

    def _refuse(self) -> None:
        """Answer 503 without reading the request."""
        self._refused = True
        message = (f"serving has {self.limits.max_connections} connections open, each with a "
                   f"request in flight: retry later")  # fmt: skip
        self._answer_and_linger(503, message)

    def _answer_and_linger(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        reason = {431: "Request Header Fields Too Large", 503: "Service Unavailable"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
        self._socket.write(head.encode() + body)
        self.linger()


def connection_class(limits: ConnectionLimits) -> type[Connection]:
    """:class:`Connection` bound to ``limits`` (uvicorn makes each connection from a class)."""
    return type("BoundConnection", (Connection,), {"limits": limits})


def fit_open_files(max_connections: int) -> int:
    """Raise this process's soft limit of open files (``ulimit -n``) so that
    ``max_connections`` connections fit beside :data:`SPARE_FILES` others, up to the hard
    limit; returns the connections that fit (``max_connections``, or fewer, with a warning,
    where the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            log.info("serving: open files limit raised from %d to %d", soft, raised)
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return max_connections
    fits = max(1, soft - SPARE_FILES)
    log.warning(
        "serving: --http-max-connections %d lowered to %d: this process may open %d files "
        "(ulimit -Hn); raise that limit to hold more connections", max_connections, fits, soft,
    )  # fmt: skip
    return fits
