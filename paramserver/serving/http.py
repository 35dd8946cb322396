"""Serving over HTTP: the Open Inference Protocol's REST endpoints, with its binary tensor
data extension (what ``tritonclient.http`` sends by default), and ``GET /metrics``.

Built on the standard library's threading HTTP server, with HTTP/1.1 keep-alive: a lookup is a
few hundred microseconds of Python, and a framework's routing and validation layers would add
their own to every request (benchmarks/bench_serve.py measures this server against a FastAPI
one). Each connection has its own thread; requests wait for the model's lock, not each other.

    GET  /v2/health/live | /v2/health/ready | /v2 | /metrics
    GET  /v2/models/NAME[/versions/V] | /v2/models/NAME[/versions/V]/ready
    POST /v2/models/NAME[/versions/V]/infer

What one client can take is bounded: a body of at most :data:`MAX_BODY_BYTES` (413 beyond,
411 for a chunked one), whose JSON is checked field by field (a wrong type, NaN or Infinity:
400 naming the field); an answer of at most
:data:`~paramserver.serving.protocol.MAX_RESPONSE_BYTES` (400 beyond, before it is built). A
connection must send each request whole within ``timeout_s`` of starting to wait for it (an
idle keep-alive connection, or a client that stalls or trickles, is closed: a socket timeout
alone bounds each read, not a request sent a byte at a time), and not stall taking an answer
longer. Beyond ``max_connections`` connections at once, a new one is answered 503 at once and
closed (a client retries; each connection holds a thread and up to a body's memory).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from torch import Tensor

from paramserver.errors import ConfigError
from paramserver.serving.frontend import Frontend
from paramserver.serving.protocol import (
    Endpoint,
    ProtocolError,
    Requested,
    brief,
    datatype_of,
    raw_bytes,
    version_parameters,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
HEADER_LENGTH = "Inference-Header-Content-Length"
REFUSED_LINGER_S = 1.0  # a refused connection waits this long for its client to close first
_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/[^/]+)?(/ready|/infer)?")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client's connection serves many requests
    disable_nagle_algorithm = True  # else a small answer waits for the client's delayed ACK
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeout_s)  # each read and write of it

    def handle_one_request(self) -> None:
        self.server.waiting(self.connection, True)  # until the request is read whole
        super().handle_one_request()

    def finish(self) -> None:
        self.server.waiting(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self.server.waiting(self.connection, False)
        frontend, path = self.server.frontend, self.path.split("?")[0]
        if path == "/v2/health/live":
            self._reply(HTTPStatus.OK, b"")
        elif path in ("/v2/health/ready", "/v2/ready"):
            self._reply(HTTPStatus.OK if frontend.ready else HTTPStatus.SERVICE_UNAVAILABLE, b"")
        elif path == "/v2":
            self._json(HTTPStatus.OK, frontend.server_metadata())
        elif path == "/metrics":
            text = frontend.metrics.text(frontend.served.version).encode()
            self._reply(HTTPStatus.OK, text, "text/plain; version=0.0.4")
        elif (match := _MODEL_PATH.fullmatch(path)) and match[2] != "/infer":
            self._model_get(match[1], ready=match[2] == "/ready")
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {path}")

    def _model_get(self, name: str, *, ready: bool) -> None:
        try:
            endpoint = self.server.frontend.endpoint(name)
        except ProtocolError as error:
            self._error(HTTPStatus.NOT_FOUND, str(error))
            return
        if ready:
            ok = self.server.frontend.ready
            self._reply(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, b"")
        else:
            self._json(HTTPStatus.OK, endpoint.metadata())

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        match = _MODEL_PATH.fullmatch(path)
        body = self._body()
        if body is None:
            return
        self.server.waiting(self.connection, False)
        if match is None or match[2] != "/infer":
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {path}")
            return
        try:
            self._infer(match[1], body)
        except ProtocolError as error:
            status = HTTPStatus.NOT_FOUND if error.not_found else HTTPStatus.BAD_REQUEST
            self._error(status, str(error))
        except (TimeoutError, ConnectionError):
            raise  # the client's socket failed: there is nothing to answer on
        except Exception as error:  # a bug, not the client's: say so, keep serving
            log.exception("http infer on %s failed", match[1])
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}")

    def _body(self) -> bytes | None:
        """The request's body, or None where it was refused (its answer sent) or never came
        whole (the client stalled or left: the connection is dropped without an answer)."""
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True  # a chunked body's end cannot be found here
            self._error(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
            return None
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True  # what follows on it cannot be found
            self._error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"a body of {length} bytes: the limit is {MAX_BODY_BYTES}",
            )
            return None
        body = self.rfile.read(length)  # a socket timeout raises, ending the connection
        if len(body) < length:
            self.close_connection = True
            return None
        return body

    def _infer(self, model: str, body: bytes) -> None:
        request, binary = _split(body, self.headers.get(HEADER_LENGTH))
        given = _inputs(request, binary)
        requested, raw = _requested(request)
        endpoint, outputs, version = self.server.frontend.infer(
            "http", model, given, requested, raw
        )
        header, payload = _response(endpoint, request.get("id"), outputs)
        header["parameters"] = version_parameters(version)
        text = json.dumps(header, separators=(",", ":")).encode()
        self.send_response(HTTPStatus.OK)
        if payload:
            self.send_header(HEADER_LENGTH, str(len(text)))
            self._send(text + b"".join(payload), "application/octet-stream")
        else:
            self._send(text, "application/json")

    def _json(self, status: HTTPStatus, document: Any) -> None:
        self._reply(status, json.dumps(document).encode(), "application/json")

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._json(status, {"error": message})

    def _reply(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self._send(body, content_type)

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# ---- the request's JSON, field by field ----


def _refuse_constant(name: str) -> Any:
    raise ProtocolError(f"the request holds {name}, which is not a JSON number")


def _split(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The request's JSON and the binary data after it."""
    try:
        length = len(body) if header_length is None else int(header_length)
    except ValueError:
        raise ProtocolError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
    if not 0 <= length <= len(body):
        raise ProtocolError(f"{HEADER_LENGTH} {length} is past the body's {len(body)} bytes")
    try:  # Python's json takes NaN and Infinity, and a number of 10**6 digits: not from a client
        request = json.loads(body[:length], parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # bad UTF-8, JSON, huge ints, deep nesting
        raise ProtocolError(f"the request is not JSON: {brief(error, 200)}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise ProtocolError("the request must be a JSON object with a list of inputs")
    if not isinstance(request.get("id", ""), str):
        raise ProtocolError(f"the request's id must be a string, got {brief(request['id'])}")
    return request, memoryview(body)[length:]


def _object(document: dict[str, Any], field: str, where: str) -> dict[str, Any]:
    """``document[field]``, an object ({} where absent)."""
    found = document.get(field)
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise ProtocolError(f"{where}: {field} must be an object, got {brief(found)}")
    return found


def _flag(parameters: dict[str, Any], name: str, default: bool, where: str) -> bool:
    found = parameters.get(name, default)
    if not isinstance(found, bool):
        raise ProtocolError(f"{where}: parameter {name} must be true or false, got {brief(found)}")
    return found


def _inputs(request: dict[str, Any], binary: memoryview) -> list[tuple[str, Any, Any, Any]]:
    """Each input's (name, datatype, shape, values), binary values taken in order; the
    protocol checks the datatype, shape and values."""
    given, offset = [], 0
    for i, entry in enumerate(request["inputs"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ProtocolError(f"input {i} must be an object with a string name")
        name = entry["name"]
        where = f"input {brief(name)}"
        if not isinstance(entry.get("datatype"), str):
            raise ProtocolError(f"{where}: datatype must be a string")
        size = _object(entry, "parameters", where).get("binary_data_size")
        if size is None:
            if "data" not in entry:
                raise ProtocolError(f"{where} has neither data nor binary_data_size")
            given.append((name, entry["datatype"], entry.get("shape"), entry["data"]))
            continue
        if type(size) is not int or not 0 <= size <= len(binary) - offset:
            raise ProtocolError(f"{where}: binary_data_size {brief(size)} past the body")
        given.append((name, entry["datatype"], entry.get("shape"), binary[offset : offset + size]))
        offset += size
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data no input claims")
    return given


def _requested(request: dict[str, Any]) -> tuple[list[Requested], bool]:
    """The outputs asked for (none: all), each as binary data or not (``binary_data``, by
    default the request's ``binary_data_output``), and that default."""
    raw = _flag(_object(request, "parameters", "the request"), "binary_data_output", False,
                "the request")  # fmt: skip
    asked = request.get("outputs", [])
    if not isinstance(asked, list):
        raise ProtocolError(f"outputs must be a list of objects, got {brief(asked)}")
    requested = []
    for i, entry in enumerate(asked):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ProtocolError(f"output {i} must be an object with a string name")
        where = f"output {brief(entry['name'])}"
        binary = _flag(_object(entry, "parameters", where), "binary_data", raw, where)
        requested.append(Requested(entry["name"], binary))
    return requested, raw


def _response(
    endpoint: Endpoint, request_id: str | None, outputs: list[tuple[Requested, Tensor]]
) -> tuple[dict[str, Any], list[bytes]]:
    """The answer's JSON and its binary parts."""
    header: dict[str, Any] = {"model_name": endpoint.name, "model_version": "1", "outputs": []}
    if request_id is not None:
        header["id"] = request_id
    payload = []
    for output, tensor in outputs:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": datatype_of(tensor.dtype),
            "shape": list(tensor.shape),
        }
        if output.raw:
            payload.append(raw_bytes(tensor))
            entry["parameters"] = {"binary_data_size": len(payload[-1])}
        else:
            entry["data"] = tensor.reshape(-1).tolist()
        header["outputs"].append(entry)
    return header, payload


# ---- the server: its connections bounded ----


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], frontend: Frontend, timeout_s: float,
                 max_connections: int):  # fmt: skip
        self.frontend, self.timeout_s, self.max_connections = frontend, timeout_s, max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, float] = {}  # each waiting for a request: since when
        self._refused: dict[socket.socket, float] = {}  # each refused: when to close it
        super().__init__(address, _Handler)

    def waiting(self, connection: socket.socket, waiting: bool) -> None:
        """Mark ``connection`` as waiting for a whole request (from now), or not."""
        with self._lock:
            if waiting:
                self._waiting[connection] = time.monotonic()
            else:
                self._waiting.pop(connection, None)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots.acquire(blocking=False):  # released as its thread ends
            super().process_request(request, client_address)
        else:
            self._refuse(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, connection: socket.socket) -> None:
        """Answer 503 without reading the request (this is the accepting thread: it must not
        block), then close once the client has closed or REFUSED_LINGER_S passed: a socket
        closed with a request unread is reset, and the client could lose the answer."""
        body = json.dumps({"error": f"serving has {self.max_connections} connections open, "
                                    f"its most: retry later"}).encode()  # fmt: skip
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
        try:
            connection.setblocking(False)
            connection.send(head.encode() + body)  # a new socket's buffer takes it whole
            connection.shutdown(socket.SHUT_WR)
        except OSError:
            connection.close()
            return
        self._refused[connection] = time.monotonic() + REFUSED_LINGER_S

    def service_actions(self) -> None:
        """Run by the accepting thread at each poll: drop the connections that have waited
        longer than the timeout for a whole request, and close the refused ones done."""
        now = time.monotonic()
        with self._lock:
            late = [c for c, since in self._waiting.items() if now - since > self.timeout_s]
            for connection in late:
                del self._waiting[connection]
                with contextlib.suppress(OSError):  # closed by its thread meanwhile
                    connection.shutdown(socket.SHUT_RDWR)  # its thread reads the end, and ends
        for connection, until in list(self._refused.items()):
            try:
                done = not connection.recv(1 << 16)  # the client closed its side
            except BlockingIOError:
                done = now > until
            except OSError:
                done = True
            if done:
                del self._refused[connection]
                connection.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # the client's socket: reset, timed out, dropped
            log.debug("http connection from %s ended: %s", client_address, error)
        else:
            log.exception("http connection from %s failed", client_address)

    def server_close(self) -> None:
        super().server_close()
        for connection in self._refused:
            connection.close()
        self._refused.clear()


class HttpServing:
    """``frontend`` served over HTTP on ``host``:``port`` (0: a free port) in a thread;
    ``timeout_s`` and ``max_connections`` bound each connection and their number (see the
    module doc)."""

    def __init__(self, frontend: Frontend, host: str = "127.0.0.1", port: int = 0, *,
                 timeout_s: float = 30.0, max_connections: int = 64):  # fmt: skip
        if timeout_s <= 0 or max_connections < 1:
            raise ConfigError(
                f"timeout_s must be > 0 and max_connections >= 1, got {timeout_s} and "
                f"{max_connections}"
            )
        self._server = _Server((host, port), frontend, timeout_s, max_connections)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
            name="serving-http",
        )  # fmt: skip
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
