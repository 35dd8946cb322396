"""Serving over HTTP: the Open Inference Protocol's REST endpoints, with its binary tensor
data extension (what ``tritonclient.http`` sends by default), and ``GET /metrics``.

A plain ASGI application (a path's few endpoints need no framework's routing or validation)
on uvicorn with the httptools parser, in a thread of its own: one event loop holds every
connection, so a connection left idle or trickling a request costs a socket, not a thread,
and never another client's answer (issue 46: 1,000 idle and 100 trickling connections open,
a lookup's p99 stays within 5 ms; ``benchmarks/bench_serve_load.py``). What bounds each
connection, its deadline and their cap, is :mod:`paramserver.serving.connections`.

A request is read on the loop. A small one (a body of at most :data:`SMALL_BODY_BYTES`: a
lookup, a batch to score) is answered there too, in a few hundred microseconds, less than a
hand-off to another thread costs; a larger one, or any while a version is being applied (the
model's lock held: it would wait), is answered on :data:`WORKERS` threads, so the loop goes on
reading, answering health checks and enforcing deadlines meanwhile. (A small request can still
ask for a large answer as JSON: its encoding then holds the loop for as long as it takes.)

    GET  /v2/health/live | /v2/health/ready | /v2 | /metrics
    GET  /v2/models/NAME[/versions/V] | /v2/models/NAME[/versions/V]/ready
    POST /v2/models/NAME[/versions/V]/infer

What one client can take is bounded: a body of at most :data:`MAX_BODY_BYTES` (413 beyond,
411 for a chunked one), whose JSON is checked field by field (a wrong type, NaN or Infinity:
400 naming the field); an answer of at most
:data:`~paramserver.serving.protocol.MAX_RESPONSE_BYTES` (400 beyond, before it is built). All
clients together hold at most :data:`MAX_HELD_BYTES` of bodies over
:data:`SMALL_BODY_BYTES` at once (a large one beyond: 503, retry later), so many connections
cannot each hold a large body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from torch import Tensor

from paramserver.errors import ConfigError
from paramserver.serving.frontend import Frontend, cannot_listen
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
SMALL_BODY_BYTES = 64 << 10  # a body this small is not counted in MAX_HELD_BYTES
MAX_HELD_BYTES = 16 * MAX_BODY_BYTES
DEFAULT_MAX_CONNECTIONS = 2048
WORKERS = 4  # threads running inferences: they take the model's lock in turn
HEADER_LENGTH = "Inference-Header-Content-Length"
_HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/[^/]+)?(/ready|/infer)?")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes
    content_type: str = "text/plain"
    headers: tuple[tuple[bytes, bytes], ...] = ()
    close: bool = False  # the connection too: what follows the request on it cannot be found


def _json(status: int, document: Any, *, close: bool = False) -> _Answer:
    return _Answer(status, json.dumps(document).encode(), "application/json", close=close)


def _error(status: int, message: str, *, close: bool = False) -> _Answer:
    return _json(status, {"error": message}, close=close)


async def _send(send: Send, answer: _Answer) -> None:
    headers = [
        (b"content-type", answer.content_type.encode()),
        (b"content-length", str(len(answer.body)).encode()),
        *answer.headers,
    ]
    if answer.close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _read_body(receive: Receive) -> bytes | None:
    """The request's body, or None where the client left (or was dropped) before it came."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _body_length(headers: dict[bytes, bytes]) -> int | _Answer:
    """The body's length its headers give, or the answer refusing it before it is read."""
    if b"transfer-encoding" in headers:  # a chunked body's length is known only once read
        return _error(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length", close=True)
    try:
        length = int(headers.get(b"content-length", b"0"))
    except ValueError:
        length = -1
    if not 0 <= length <= MAX_BODY_BYTES:
        message = f"a body of {length} bytes: the limit is {MAX_BODY_BYTES}"
        return _error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message, close=True)
    return length


class _App:
    """The endpoints of the module doc as an ASGI application. Its coroutines run on the
    event loop's thread only (``_held`` needs no lock); inferences run on ``pool``."""

    def __init__(self, frontend: Frontend, pool: ThreadPoolExecutor):
        self.frontend, self._pool = frontend, pool
        self._held = 0  # bytes of bodies over SMALL_BODY_BYTES now read or answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        answer: _Answer | None
        if method in ("GET", "HEAD"):
            answer = self._get(path)
        elif method == "POST":
            answer = await self._post(path, dict(scope["headers"]), receive)
        else:
            answer = _error(HTTPStatus.METHOD_NOT_ALLOWED, f"no such endpoint: {method} {path}")
        if answer is not None:
            await _send(send, answer)

    def _get(self, path: str) -> _Answer:
        frontend = self.frontend
        ready = HTTPStatus.OK if frontend.ready else HTTPStatus.SERVICE_UNAVAILABLE
        if path == "/v2/health/live":
            return _Answer(HTTPStatus.OK, b"")
        if path in ("/v2/health/ready", "/v2/ready"):
            return _Answer(ready, b"")
        if path == "/v2":
            return _json(HTTPStatus.OK, frontend.server_metadata())
        if path == "/metrics":
            text = frontend.metrics.text(frontend.served.version).encode()
            return _Answer(HTTPStatus.OK, text, "text/plain; version=0.0.4")
        match = _MODEL_PATH.fullmatch(path)
        if match is None or match[2] == "/infer":
            return _error(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {path}")
        try:
            endpoint = frontend.endpoint(match[1])
        except ProtocolError as error:
            return _error(HTTPStatus.NOT_FOUND, str(error))
        return _Answer(ready, b"") if match[2] == "/ready" else _json(200, endpoint.metadata())

    async def _post(
        self, path: str, headers: dict[bytes, bytes], receive: Receive
    ) -> _Answer | None:
        length = _body_length(headers)
        if isinstance(length, _Answer):
            return length
        held = length if length > SMALL_BODY_BYTES else 0
        if self._held + held > MAX_HELD_BYTES:
            return _error(HTTPStatus.SERVICE_UNAVAILABLE, f"serving holds {self._held} bytes of "
                          f"large requests, its most: retry later", close=True)  # fmt: skip
        self._held += held
        try:
            body = await _read_body(receive)
            if body is None:
                return None
            match = _MODEL_PATH.fullmatch(path)
            if match is None or match[2] != "/infer":
                return _error(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {path}")
            header_length = headers.get(_HEADER_LENGTH_KEY)
            if not held and not self.frontend.served.lock.locked():  # see the module doc
                return self._infer(match[1], body, header_length)
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, self._infer, match[1], body, header_length
            )
        finally:
            self._held -= held

    def _infer(self, model: str, body: bytes, header_length: bytes | None) -> _Answer:
        """``model``'s answer to ``body`` (on the loop or a worker: see the module doc)."""
        try:
            return _inferred(self.frontend, model, body, header_length)
        except ProtocolError as error:
            status = HTTPStatus.NOT_FOUND if error.not_found else HTTPStatus.BAD_REQUEST
            return _error(status, str(error))
        except Exception as error:  # a bug, not the client's: say so, keep serving
            log.exception("http infer on %s failed", model)
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}")


def _inferred(frontend: Frontend, model: str, body: bytes, header_length: bytes | None) -> _Answer:
    length = None if header_length is None else header_length.decode("latin-1")
    request, binary = _split(body, length)
    given = _inputs(request, binary)
    requested, raw = _requested(request)
    endpoint, outputs, version = frontend.infer("http", model, given, requested, raw)
    header, payload = _response(endpoint, request.get("id"), outputs)
    header["parameters"] = version_parameters(version)
    text = json.dumps(header, separators=(",", ":")).encode()
    if not payload:
        return _Answer(HTTPStatus.OK, text, "application/json")
    size = ((_HEADER_LENGTH_KEY, str(len(text)).encode()),)
    return _Answer(HTTPStatus.OK, text + b"".join(payload), "application/octet-stream", size)


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


# ---- the server: uvicorn in a thread ----


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port``; a port taken is a ConfigError naming the flag."""
    try:
        return socket.create_server((host, port), backlog=2048)
    except OSError as error:
        raise ConfigError(cannot_listen("HTTP", "--http-port", host, port, error)) from None


class HttpServing:
    """``frontend`` served over HTTP on ``host``:``port`` (0: a free port) in a thread;
    ``timeout_s`` and ``max_connections`` bound each connection and their number (see
    :mod:`paramserver.serving.connections`)."""

    def __init__(
        self,
        frontend: Frontend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 30.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ):
        if not timeout_s > 0 or max_connections < 1:
            raise ConfigError(
                f"timeout_s must be > 0 and max_connections >= 1, got {timeout_s} and "
                f"{max_connections}"
            )
        try:
            import uvicorn

            from paramserver.serving import connections
        except ImportError as error:
            raise ConfigError(f"serving over HTTP needs the serve extra "
                              f"(pip install 'paramserver[serve]'): {error}") from None  # fmt: skip
        listener = _listen(host, port)
        limits = connections.ConnectionLimits(
            timeout_s, connections.fit_open_files(max_connections)
        )
        self.port = int(listener.getsockname()[1])
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="serving-http-infer")
        config = uvicorn.Config(
            _App(frontend, self._pool), http=connections.connection_class(limits),
            interface="asgi3", lifespan="off", ws="none", loop="asyncio", log_config=None,
            log_level=logging.ERROR, access_log=False, proxy_headers=False, server_header=False,
            date_header=False, timeout_keep_alive=math.ceil(timeout_s), timeout_graceful_shutdown=1,
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listener]}, daemon=True,
            name="serving-http",
        )  # fmt: skip
        self._thread.start()
        self._wait_started(listener)

    def _wait_started(self, listener: socket.socket) -> None:
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                listener.close()
                self._pool.shutdown(wait=False)
                raise RuntimeError(f"HTTP serving on port {self.port} did not start")
            time.sleep(0.005)

    def close(self) -> None:
        """Stop: every connection dropped, the listening socket closed."""
        self._server.should_exit = True
        self._thread.join(5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
