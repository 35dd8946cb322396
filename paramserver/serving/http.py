"""Serving over HTTP: the Open Inference Protocol's REST endpoints, with its binary tensor
data extension (what ``tritonclient.http`` sends by default), and ``GET /metrics``.

Built on the standard library's threading HTTP server, with HTTP/1.1 keep-alive: a lookup is a
few hundred microseconds of Python, and a framework's routing and validation layers would add
their own to every request (benchmarks/bench_serve.py measures this server against a FastAPI
one). Each connection has its own thread; requests wait for the model's lock, not each other.

    GET  /v2/health/live | /v2/health/ready | /v2 | /metrics
    GET  /v2/models/NAME[/versions/V] | /v2/models/NAME[/versions/V]/ready
    POST /v2/models/NAME[/versions/V]/infer
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from paramserver.serving.frontend import Frontend
from paramserver.serving.protocol import Endpoint, ProtocolError, version_parameters

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
HEADER_LENGTH = "Inference-Header-Content-Length"
_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/[^/]+)?(/ready|/infer)?")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client's connection serves many requests
    disable_nagle_algorithm = True  # else a small answer waits for the client's delayed ACK
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:
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
        if match is None or match[2] != "/infer":
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {path}")
            return
        try:
            self._infer(match[1], body)
        except ProtocolError as error:
            status = HTTPStatus.NOT_FOUND if error.not_found else HTTPStatus.BAD_REQUEST
            self._error(status, str(error))
        except Exception as error:  # a bug, not the client's: say so, keep serving
            log.exception("http infer on %s failed", match[1])
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}")

    def _body(self) -> bytes | None:
        """The request's body, or None where it was refused (its answer sent)."""
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
        return self.rfile.read(length)

    def _infer(self, model: str, body: bytes) -> None:
        request, binary = _split(body, self.headers.get(HEADER_LENGTH))
        given = _inputs(request, binary)
        endpoint, outputs, version = self.server.frontend.infer("http", model, given)
        header, payload = _response(endpoint, request, outputs)
        header["parameters"] = version_parameters(version)
        text = json.dumps(header, separators=(",", ":")).encode()
        if payload:
            self.send_response(HTTPStatus.OK)
            self.send_header(HEADER_LENGTH, str(len(text)))
            self._send(text + b"".join(payload), "application/octet-stream")
        else:
            self.send_response(HTTPStatus.OK)
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


def _split(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The request's JSON and the binary data after it."""
    try:
        length = len(body) if header_length is None else int(header_length)
    except ValueError:
        raise ProtocolError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
    if not 0 <= length <= len(body):
        raise ProtocolError(f"{HEADER_LENGTH} {length} is past the body's {len(body)} bytes")
    try:
        request = json.loads(body[:length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProtocolError(f"the request is not JSON: {error}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise ProtocolError("the request must be a JSON object with a list of inputs")
    return request, memoryview(body)[length:]


def _inputs(request: dict[str, Any], binary: memoryview) -> list[tuple[str, str, Any, Any]]:
    """Each input's (name, datatype, shape, values), binary values taken in order."""
    given, offset = [], 0
    for entry in request["inputs"]:
        if not isinstance(entry, dict):
            raise ProtocolError("each input must be an object")
        name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise ProtocolError(f"an input needs a name and a datatype: {entry!r}")
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is None:
            if "data" not in entry:
                raise ProtocolError(f"input {name!r} has neither data nor binary_data_size")
            given.append((name, datatype, shape, entry["data"]))
            continue
        if type(size) is not int or not 0 <= size <= len(binary) - offset:
            raise ProtocolError(f"input {name!r}: binary_data_size {size!r} past the body")
        given.append((name, datatype, shape, binary[offset : offset + size]))
        offset += size
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data no input claims")
    return given


def _response(
    endpoint: Endpoint, request: dict[str, Any], outputs: dict[str, np.ndarray]
) -> tuple[dict[str, Any], list[bytes]]:
    """The answer's JSON and its binary parts: the outputs asked for (all by default), each
    binary where asked (``binary_data``, or the request's ``binary_data_output``)."""
    binary_default = bool((request.get("parameters") or {}).get("binary_data_output", False))
    asked = request.get("outputs")
    if asked is None:
        wanted = [(name, binary_default) for name in outputs]
    elif isinstance(asked, list) and all(isinstance(a, dict) for a in asked):
        wanted = [
            (a.get("name"), bool((a.get("parameters") or {}).get("binary_data", binary_default)))
            for a in asked
        ]
    else:
        raise ProtocolError("outputs must be a list of objects")
    header: dict[str, Any] = {"model_name": endpoint.name, "model_version": "1", "outputs": []}
    if "id" in request:
        header["id"] = request["id"]
    payload = []
    for name, binary in wanted:
        if name not in outputs:
            raise ProtocolError(f"model {endpoint.name!r} has no output {name!r}")
        array = np.ascontiguousarray(outputs[name])
        spec = next(s for s in endpoint.outputs if s.name == name)
        entry: dict[str, Any] = {
            "name": name,
            "datatype": spec.datatype,
            "shape": list(array.shape),
        }
        if binary:
            payload.append(array.tobytes())
            entry["parameters"] = {"binary_data_size": array.nbytes}
        else:
            entry["data"] = array.reshape(-1).tolist()
        header["outputs"].append(entry)
    return header, payload


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], frontend: Frontend):
        super().__init__(address, _Handler)
        self.frontend = frontend


class HttpServing:
    """``frontend`` served over HTTP on ``host``:``port`` (0: a free port) in a thread."""

    def __init__(self, frontend: Frontend, host: str = "127.0.0.1", port: int = 0):
        self._server = _Server((host, port), frontend)
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
