"""Serving's HTTP connections and what a client is told when a limit is reached: a head too
long, large bodies past what all clients may hold at once, an answer too large (what each
transport's client can ask for instead), a port taken (the flag to change), and the open-files
limit raised to fit the connection cap.

Real servers on loopback free ports, raw sockets or tritonclient as clients; a limit is made
small where reaching the real one would take a big request.
"""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from paramserver.errors import ConfigError
from paramserver.serving import connections, protocol
from paramserver.serving import http as serving_http
from paramserver.serving.frontend import Frontend
from paramserver.serving.grpc import GrpcServing
from paramserver.serving.http import HttpServing
from tests.serving_helpers import INFER, raw_http, ready_frontend


@pytest.fixture
def frontend() -> Frontend:
    return ready_frontend()


@pytest.fixture
def http_serving(frontend: Frontend) -> Iterator[HttpServing]:
    serving = HttpServing(frontend)
    yield serving
    serving.close()


def lookup(ids: list[int], **request: object) -> bytes:
    document = {"inputs": [{"name": "ids", "shape": [len(ids)], "datatype": "INT64",
                            "data": ids}], **request}  # fmt: skip
    return json.dumps(document).encode()


def assert_lookups_answered(frontend: Frontend, port: int) -> None:
    status, answer = raw_http(port, "POST", INFER, lookup([1, 2]))
    expected = frontend.served.lookup("item.weight", torch.tensor([1, 2]))[0]
    assert status == 200
    assert json.loads(answer)["outputs"][0]["data"] == expected.reshape(-1).tolist()


def read_answer(connection: socket.socket) -> bytes:
    """What the server sends until it closes ``connection``."""
    connection.settimeout(10)
    received = b""
    while chunk := connection.recv(1 << 16):
        received += chunk
    return received


def test_a_head_over_the_limit_gets_431_and_serving_goes_on(
    frontend: Frontend, http_serving: HttpServing
) -> None:
    connection = socket.create_connection(("127.0.0.1", http_serving.port))
    connection.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
    header = b"X-Long: " + b"a" * 1000 + b"\r\n"
    for _ in range(connections.MAX_HEAD_BYTES // len(header) + 2):
        connection.sendall(header)  # read and dropped once the server has answered
    answer = read_answer(connection)
    assert answer.startswith(b"HTTP/1.1 431") and b"head is over 65536 bytes" in answer
    connection.close()
    assert_lookups_answered(frontend, http_serving.port)


def test_large_bodies_past_what_all_clients_may_hold_get_503_and_small_ones_go_on(
    frontend: Frontend, http_serving: HttpServing, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving_http, "MAX_HELD_BYTES", 150_000)
    holding = socket.create_connection(("127.0.0.1", http_serving.port))
    holding.sendall(f"POST {INFER} HTTP/1.1\r\nContent-Length: 100000\r\n\r\n".encode())
    holding.sendall(b"{")  # 100,000 bytes held for this body until it comes or is dropped
    time.sleep(0.2)
    body = b" " * 90_000 + lookup([1, 2])
    status, answer = raw_http(http_serving.port, "POST", INFER, body)
    assert status == 503 and b"bytes of large requests" in answer
    assert_lookups_answered(frontend, http_serving.port)  # a small body is not counted
    holding.close()
    time.sleep(0.2)
    status, answer = raw_http(http_serving.port, "POST", INFER, body)
    assert status == 200, answer


def test_an_answer_too_large_says_what_each_transports_client_can_ask_instead(
    frontend: Frontend, http_serving: HttpServing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1000 bytes at most: 11 ids' rows listed as JSON are 11 * 4 * 25 = 1100 bytes, 176 as
    binary data; 63 ids' rows are 1008 bytes even as binary data, as over gRPC."""
    monkeypatch.setattr(protocol, "MAX_RESPONSE_BYTES", 1000)
    port = http_serving.port
    status, answer = raw_http(port, "POST", INFER, lookup(list(range(11))))
    error = json.loads(answer)["error"]
    assert status == 400 and error == (
        "model 'item.weight': an answer of 1100 bytes is over the limit of 1000 bytes; ask for "
        "fewer ids per request, or for the outputs as binary data (the answer would be 176 "
        "bytes)"
    )
    binary = lookup([i % 50 for i in range(63)], parameters={"binary_data_output": True})
    status, answer = raw_http(port, "POST", INFER, binary)
    error = json.loads(answer)["error"]
    assert status == 400 and "an answer of 1008 bytes" in error
    assert error.endswith("ask for fewer ids per request")  # binary data would not help
    listed = lookup([i % 50 for i in range(63)])  # listed, and too large as binary data too
    error = json.loads(raw_http(port, "POST", INFER, listed)[1])["error"]
    assert error.endswith("ask for fewer ids per request")

    items = [i % 50 for i in range(300)]
    scores = json.dumps({"inputs": [
        {"name": "items", "shape": [300], "datatype": "INT64", "data": items},
        {"name": "users", "shape": [300], "datatype": "INT64", "data": list(range(300))},
    ], "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    status, answer = raw_http(port, "POST", "/v2/models/model/infer", scores)
    assert status == 400
    assert json.loads(answer)["error"].endswith("ask for fewer rows (a smaller batch) per request")

    grpc_serving = GrpcServing(frontend)
    try:
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_serving.port}")
        ids = triton_grpc.InferInput("ids", [63], "INT64")
        ids.set_data_from_numpy(np.arange(63) % 50)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("item.weight", [ids])
        message = refused.value.message()
        assert "an answer of 1008 bytes is over the limit of 1000 bytes" in message
        assert message.endswith("ask for fewer ids per request") and "binary" not in message
    finally:
        grpc_serving.close()


def test_a_taken_port_is_a_config_error_naming_the_flag(frontend: Frontend) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        with pytest.raises(
            ConfigError, match=f"HTTP port {port} on 127.0.0.1 is in use.*--http-port"
        ):
            HttpServing(frontend, port=port)
        with pytest.raises(
            ConfigError, match=f"gRPC port {port} on 127.0.0.1 is in use.*--grpc-port"
        ):
            GrpcServing(frontend, port=port)
    finally:
        taken.close()


def test_the_open_files_limit_is_raised_to_fit_the_connection_cap() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"the hard limit of open files ({hard}) leaves no room to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        assert connections.fit_open_files(1000) == 1000
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 1000 + connections.SPARE_FILES
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
