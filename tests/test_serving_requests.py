"""Serving's front-end under requests it must refuse or bound: every field of a request's JSON
checked, outputs asked for checked, shapes and answers bounded, slow and idle HTTP clients
dropped, connections capped, a failed start leaving nothing behind, and bfloat16 tables served.

The servers are real (HTTP and gRPC on loopback free ports), the clients tritonclient's or raw
sockets; a limit is made small for a test where reaching the real one would take a big request.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from torch import Tensor, nn
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from paramserver.cli import build_parser
from paramserver.errors import ConfigError, InvalidBatchError
from paramserver.serving import protocol
from paramserver.serving.frontend import Frontend
from paramserver.serving.grpc import GrpcServing
from paramserver.serving.http import HttpServing
from paramserver.serving.model import ServedModel
from paramserver.serving.run import serve
from tests.procs import free_port
from tests.serving_helpers import EXAMPLE, INFER, Ranker, raw_http, ready_frontend


@pytest.fixture
def frontend() -> Frontend:
    return ready_frontend()


@pytest.fixture
def serving(frontend: Frontend) -> Iterator[tuple[Frontend, HttpServing, GrpcServing]]:
    http_serving, grpc_serving = HttpServing(frontend), GrpcServing(frontend)
    yield frontend, http_serving, grpc_serving
    http_serving.close()
    grpc_serving.close()


@pytest.fixture
def http_with(frontend: Frontend) -> Iterator[Callable[..., HttpServing]]:
    """HTTP serving of ``frontend`` with the options given."""
    started: list[HttpServing] = []

    def start(**options: Any) -> HttpServing:
        started.append(HttpServing(frontend, **options))
        return started[-1]

    yield start
    for one in started:
        one.close()


def ids_input(data: Any, shape: Any = None, **fields: Any) -> dict[str, Any]:
    shape = [len(data)] if shape is None else shape
    return {"name": "ids", "shape": shape, "datatype": "INT64", "data": data, **fields}


def post(port: int, document: Any, path: str = INFER) -> tuple[int, dict[str, Any]]:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    status, answer = raw_http(port, "POST", path, body)
    return status, json.loads(answer)


def assert_still_serving(frontend: Frontend, port: int) -> None:
    status, answer = post(port, {"inputs": [ids_input([1, 2])]})
    expected = frontend.served.lookup("item.weight", torch.tensor([1, 2]))[0]
    assert status == 200 and answer["outputs"][0]["data"] == expected.reshape(-1).tolist()


# ---- every field of the JSON checked ----

NAN = b'{"inputs": [{"name": "ids", "shape": [1], "datatype": "INT64", "data": [NaN]}]}'


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"inputs": {"ids": [1]}}, "a list of inputs"),
        ({"inputs": [1]}, "input 0 must be an object with a string name"),
        ({"inputs": [ids_input([1], name=5)]}, "input 0 must be an object with a string name"),
        ({"inputs": [ids_input([1], datatype=64)]}, "datatype must be a string"),
        ({"inputs": [ids_input([1], datatype="INT65")]}, "datatype 'INT65' is none of"),
        ({"inputs": [ids_input([1], shape="1")]}, "shape must be a list of at most 8"),
        ({"inputs": [ids_input([1], shape=[True])]}, "shape must be of integers >= 0"),
        ({"inputs": [ids_input([1], shape=[1.0])]}, "shape must be of integers >= 0"),
        ({"inputs": [ids_input([], shape=[-1])]}, "shape must be of integers >= 0"),
        ({"inputs": [ids_input([1], shape=[1] * 9)]}, "shape must be a list of at most 8"),
        ({"inputs": [ids_input(1, shape=[1])]}, "data must be a list of values"),
        ({"inputs": [ids_input([1.5, 2])]}, "INT64 values must be integers, got ['float']"),
        ({"inputs": [ids_input([True, 2])]}, "INT64 values must be integers, got ['bool']"),
        ({"inputs": [ids_input(["1"])]}, "INT64 values must be integers, got ['str']"),
        ({"inputs": [ids_input([2**70])]}, "out of INT64's range"),
        ({"inputs": [ids_input([[[[[[[[[[1]]]]]]]]]], shape=[1])]}, "nested at most 8 deep"),
        ({"inputs": [ids_input([1], parameters=[])]}, "parameters must be an object"),
        ({"inputs": [ids_input([1])], "parameters": 5}, "parameters must be an object"),
        ({"inputs": [ids_input([1])], "parameters": {"binary_data_output": "yes"}},
         "binary_data_output must be true or false"),
        ({"inputs": [ids_input([1])], "outputs": {"name": "rows"}}, "outputs must be a list"),
        ({"inputs": [ids_input([1])], "outputs": [{"name": 1}]},
         "output 0 must be an object with a string name"),
        ({"inputs": [ids_input([1])], "outputs": ["rows"]},
         "output 0 must be an object with a string name"),
        ({"inputs": [ids_input([1])], "outputs": [{"name": "rows", "parameters": {
            "binary_data": 1}}]}, "binary_data must be true or false"),
        ({"inputs": [ids_input([1])], "outputs": [{"name": "scores"}]},
         "has no output 'scores'; its outputs are ['rows']"),
        ({"inputs": [ids_input([1])], "id": 7}, "id must be a string"),
        (NAN, "NaN, which is not a JSON number"),
        (NAN.replace(b"NaN", b"-Infinity"), "-Infinity, which is not a JSON number"),
        (NAN.replace(b"NaN", b"9" * 5000), "not JSON"),  # past Python's digits for an int
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # past Python's recursion
    ],
)  # fmt: skip
def test_each_malformed_json_field_gets_400_naming_it_and_serving_goes_on(
    serving, document: Any, message: str
) -> None:
    frontend, http_serving, _ = serving
    before = frontend.served.lookup("item.weight", torch.arange(50))[0]
    status, answer = post(http_serving.port, document)
    assert status == 400 and message in answer["error"], answer
    assert len(answer["error"]) < 400  # a client's value is quoted briefly
    assert_still_serving(frontend, http_serving.port)
    assert torch.equal(frontend.served.lookup("item.weight", torch.arange(50))[0], before)


def test_nested_json_data_and_mixed_output_encodings_are_answered(serving) -> None:
    frontend, http_serving, _ = serving
    document = {
        "id": "request-1",
        "inputs": [ids_input([[1, 2], [3, 4]], shape=[4])],  # nested data, read row-major
        "outputs": [{"name": "rows", "parameters": {"binary_data": False}}],
        "parameters": {"binary_data_output": True},
    }
    status, answer = post(http_serving.port, document)
    expected = frontend.served.lookup("item.weight", torch.tensor([1, 2, 3, 4]))[0]
    assert status == 200 and answer["id"] == "request-1"
    assert answer["outputs"][0]["shape"] == [4, 4]
    assert answer["outputs"][0]["data"] == expected.reshape(-1).tolist()


def test_an_output_the_model_lacks_is_refused_over_grpc_before_it_runs(serving) -> None:
    frontend, _, grpc_serving = serving
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_serving.port}")
    given = triton_grpc.InferInput("ids", [2], "INT64")
    given.set_data_from_numpy(np.array([1, 2], dtype=np.int64))
    with pytest.raises(InferenceServerException, match="has no output 'scores'") as refused:
        client.infer("item.weight", [given], outputs=[triton_grpc.InferRequestedOutput("scores")])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    counted = frontend.metrics.requests
    assert counted[("grpc", "item.weight", "bad_request")] == 1
    rows = client.infer("item.weight", [given], outputs=[triton_grpc.InferRequestedOutput("rows")])
    assert rows.as_numpy("rows").shape == (2, 4)


# ---- ids a table cannot take; shapes as declared ----


def clients(http_serving: HttpServing, grpc_serving: GrpcServing) -> list[tuple[Any, Any]]:
    return [
        (triton_http.InferenceServerClient(f"127.0.0.1:{http_serving.port}"), triton_http),
        (triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_serving.port}"), triton_grpc),
    ]


@pytest.mark.parametrize(("items", "named"), [([1, 50], 50), ([-3, 2], -3)])
def test_an_id_outside_a_table_given_to_the_whole_model_is_refused_naming_input_and_table(
    serving, items: list[int], named: int
) -> None:
    frontend, http_serving, grpc_serving = serving
    expected = (
        rf"model 'model' cannot run on these inputs: input 'items' holds id {named} for "
        rf"table 'item.weight', whose ids are 0\.\.49"
    )
    for client, module in clients(http_serving, grpc_serving):
        given = [module.InferInput("items", [2], "INT64"), module.InferInput("users", [2], "INT64")]
        given[0].set_data_from_numpy(np.array(items, dtype=np.int64))
        given[1].set_data_from_numpy(np.array([10, 11], dtype=np.int64))
        with pytest.raises(InferenceServerException, match=expected) as refused:
            client.infer("model", given)
        assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert frontend.metrics.requests[("http", "model", "bad_request")] == 1
    assert_still_serving(frontend, http_serving.port)


class Looked(nn.Module):
    """A model that looks its ids up by ``F.embedding`` on its table's weight (``computed``:
    ids offset first, so they are no input's) or through an ``nn.EmbeddingBag``."""

    def __init__(self, computed: bool = False, bag: bool = False) -> None:
        super().__init__()
        self.computed, self.bag = computed, bag
        self.table = nn.EmbeddingBag(10, 2, mode="sum") if bag else nn.Embedding(10, 2)

    def forward(self, ids: Tensor) -> Tensor:
        if self.bag:
            return self.table(ids[:, :2])
        return F.embedding(ids + 1 if self.computed else ids, self.table.weight).sum(1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"input 'ids' holds id 10 for table 'table.weight', whose ids are 0\.\.9"),
        ({"bag": True}, r"input 'ids' holds id 10 for table 'table.weight'"),
        ({"computed": True}, r"ids computed from the inputs hold id 10 for table 'table.weight'"),
    ],
)
def test_an_id_outside_a_table_is_named_however_the_model_looks_it_up(
    options: dict[str, bool], message: str
) -> None:
    served = ServedModel(lambda: Looked(**options), 0)
    ids = torch.tensor([[1, 9 if options.get("computed") else 10], [2, 3]])
    with pytest.raises(InvalidBatchError, match=message):
        served.predict([ids], ["ids"])
    assert served.predict([torch.tensor([[1, 2], [3, 4]])], ["ids"])[0].shape == (2, 2)


def test_a_tables_ids_are_taken_in_the_shape_its_metadata_declares(serving) -> None:
    """The protocol's shapes say "any size" of a dimension (-1), not "any number of
    dimensions": a table declares ids of one dimension, over HTTP and gRPC alike, and takes
    those only."""
    _, http_serving, grpc_serving = serving
    for client, module in clients(http_serving, grpc_serving):
        metadata = client.get_model_metadata("item.weight")
        if module is triton_http:
            declared = [(t["name"], t["datatype"], t["shape"])
                        for t in metadata["inputs"] + metadata["outputs"]]  # fmt: skip
        else:
            declared = [(t.name, t.datatype, list(t.shape))
                        for t in [*metadata.inputs, *metadata.outputs]]  # fmt: skip
        assert declared == [("ids", "INT64", [-1]), ("rows", "FP32", [-1, 4])]
        lookup = module.InferInput("ids", [2, 2], "INT64")
        lookup.set_data_from_numpy(np.array([[1, 2], [3, 4]], dtype=np.int64))
        with pytest.raises(InferenceServerException, match=r"shape \[2, 2\] does not fit \[-1\]"):
            client.infer("item.weight", [lookup])
        lookup = module.InferInput("ids", [4], "INT64")
        lookup.set_data_from_numpy(np.array([1, 2, 3, 4], dtype=np.int64))
        assert client.infer("item.weight", [lookup]).as_numpy("rows").shape == (4, 4)


# ---- shapes and raw data bounded ----


def raw_grpc(port: int, shape: list[int], raw: bytes) -> grpc.RpcError:
    """The error a lookup of ``raw`` bytes as ids of ``shape`` gets, sent as tritonclient
    cannot (it checks shapes itself)."""
    request = service_pb2.ModelInferRequest(model_name="item.weight")
    request.inputs.add(name="ids", datatype="INT64", shape=shape)
    request.raw_input_contents.append(raw)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=10)
    return refused.value


@pytest.mark.parametrize(
    ("shape", "raw", "message"),
    [
        ([3], bytes(16), "16 bytes for 3 INT64 values of shape [3]"),
        ([2**62, 2**62, 2**62], bytes(8), "shape [4611686018427387904, 46116860184"),
        ([1 << 23], bytes(8), "is over the limit of 4194304 values"),
        ([1] * 9, bytes(8), "shape must be a list of at most 8 integers"),
    ],
)
def test_raw_data_that_disagrees_with_its_shape_or_is_too_big_is_refused(
    serving, shape: list[int], raw: bytes, message: str
) -> None:
    frontend, http_serving, grpc_serving = serving
    error = raw_grpc(grpc_serving.port, shape, raw)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()
    size = {"binary_data_size": len(raw)}
    header = json.dumps({"inputs": [ids_input([], shape, parameters=size)]}).encode()
    length = {"Inference-Header-Content-Length": str(len(header))}
    status, answer = raw_http(http_serving.port, "POST", INFER, header + raw, length)
    assert status == 400 and message.encode() in answer
    assert_still_serving(frontend, http_serving.port)


def test_a_chunked_body_is_refused_with_411(serving) -> None:
    _, http_serving, _ = serving
    connection = http.client.HTTPConnection("127.0.0.1", http_serving.port, timeout=10)
    connection.request("POST", INFER, iter([b'{"inputs": []}']), encode_chunked=True)
    answer = connection.getresponse()
    assert answer.status == 411 and b"Content-Length" in answer.read()


# ---- answers bounded ----


def binary_lookup(count: int) -> dict[str, Any]:
    ids = [i % 50 for i in range(count)]
    return {"inputs": [ids_input(ids)], "parameters": {"binary_data_output": True}}


def test_an_answer_over_the_limit_is_refused_instead_of_built(
    serving, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1000 bytes at most: 62 ids' rows (62 * 4 FP32) fit as binary data; as JSON 10 fit
    (10 * 4 values of 25 bytes), 11 do not; a prediction of 300 scores (1200 bytes) does not."""
    monkeypatch.setattr(protocol, "MAX_RESPONSE_BYTES", 1000)
    frontend, http_serving, grpc_serving = serving
    port = http_serving.port
    assert post(port, {"inputs": [ids_input(list(range(10)))]})[0] == 200
    status, answer = post(port, {"inputs": [ids_input(list(range(11)))]})
    assert status == 400 and "an answer of 1100 bytes is over the limit of 1000" in answer["error"]
    assert raw_http(port, "POST", INFER, json.dumps(binary_lookup(62)).encode())[0] == 200
    status, answer = post(port, binary_lookup(63))
    assert status == 400 and "an answer of 1008 bytes" in answer["error"]

    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_serving.port}")
    items = triton_grpc.InferInput("items", [300], "INT64")
    items.set_data_from_numpy(np.arange(300) % 50)
    users = triton_grpc.InferInput("users", [300], "INT64")
    users.set_data_from_numpy(np.arange(300))
    with pytest.raises(InferenceServerException, match="1200 bytes is over") as refused:
        client.infer("model", [items, users])
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert frontend.metrics.requests[("grpc", "model", "too_large")] == 1
    assert_still_serving(frontend, port)


# ---- slow, idle and too many HTTP clients ----


def closed_within(connection: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``connection``, sending ``trickle`` a byte every
    0.05 s meanwhile; fails after ``seconds``."""
    start = time.monotonic()
    connection.settimeout(0.05)
    for i in range(int(seconds / 0.05)):
        if i < len(trickle):
            try:
                connection.send(trickle[i : i + 1])
            except OSError:  # reset: closed
                return time.monotonic() - start
        try:
            if connection.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
    raise AssertionError(f"the server kept the connection past {seconds} s")


STALLED = b"POST " + INFER.encode() + b' HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"inp'


def test_a_client_that_stalls_trickles_or_idles_is_dropped_after_the_timeout(
    frontend: Frontend, http_with
) -> None:
    http_serving = http_with(timeout_s=0.5)
    stalled = socket.create_connection(("127.0.0.1", http_serving.port))
    stalled.sendall(STALLED)  # half a body, then nothing
    assert 0.4 < closed_within(stalled, 5) < 2
    trickling = socket.create_connection(("127.0.0.1", http_serving.port))
    headers = b"GET /v2/health/live HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 200
    assert closed_within(trickling, 5, trickle=headers) < 2  # each byte in time, the whole not
    idle = http.client.HTTPConnection("127.0.0.1", http_serving.port, timeout=10)
    idle.request("GET", "/v2/health/live")
    assert idle.getresponse().read() == b""  # kept alive, then idle
    assert closed_within(idle.sock, 5) < 2
    for connection in (stalled, trickling, idle):
        connection.close()
    assert_still_serving(frontend, http_serving.port)


def test_at_the_connection_cap_a_new_client_drops_the_longest_idle_connection(
    frontend: Frontend, http_with
) -> None:
    http_serving = http_with(max_connections=2)
    oldest = socket.create_connection(("127.0.0.1", http_serving.port))
    time.sleep(0.05)  # the order of their waits
    newer = socket.create_connection(("127.0.0.1", http_serving.port))
    time.sleep(0.05)
    assert raw_http(http_serving.port, "GET", "/v2/health/live", b"")[0] == 200
    assert closed_within(oldest, 5) < 2
    newer.settimeout(0.2)
    with pytest.raises(TimeoutError):  # still open: only the oldest made room
        newer.recv(1)
    assert_still_serving(frontend, http_serving.port)
    oldest.close()
    newer.close()


def test_at_the_cap_with_every_connection_mid_request_a_new_one_gets_503(
    frontend: Frontend, http_with
) -> None:
    http_serving = http_with(max_connections=2)
    answers: list[tuple[int, dict[str, Any]]] = []
    lookups = [threading.Thread(target=lambda: answers.append(post(http_serving.port, {
        "inputs": [ids_input([1, 2])]}))) for _ in range(2)]  # fmt: skip
    with frontend.served.lock:  # each lookup waits for it: both connections busy
        for lookup in lookups:
            lookup.start()
        time.sleep(0.5)
        status, answer = raw_http(http_serving.port, "GET", "/v2/health/live", b"")
        assert status == 503 and b"2 connections open, each with a request" in answer
    for lookup in lookups:
        lookup.join(10)
    assert [status for status, _ in answers] == [200, 200]
    assert_still_serving(frontend, http_serving.port)


def test_serve_and_its_command_line_take_the_http_limits() -> None:
    argv = ["serve", "--http-timeout", "5", "--http-max-connections", "1"]
    args = build_parser().parse_args(argv)
    assert (args.http_timeout, args.http_max_connections) == (5.0, 1)
    serving = serve(Ranker, example_inputs=EXAMPLE, http_port=0, grpc_port=None,
                    http_timeout_s=args.http_timeout,
                    http_max_connections=args.http_max_connections)  # fmt: skip
    try:
        held = socket.create_connection(("127.0.0.1", serving.http_port))
        time.sleep(0.05)
        assert raw_http(serving.http_port, "GET", "/v2/health/live", b"")[0] == 200
        assert closed_within(held, 5) < 2  # the one connection allowed: the new client's
        held.close()
    finally:
        serving.close()


def test_http_serving_refuses_limits_that_serve_nothing(frontend: Frontend) -> None:
    with pytest.raises(ConfigError, match="max_connections"):
        HttpServing(frontend, max_connections=0)


# ---- a failed start leaves nothing behind ----


def serving_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("serving-follow", "serving-http")]


@pytest.mark.parametrize("failure", ["grpc port taken", "grpc extra missing"])
def test_a_failed_start_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    busy = socket.create_server(("127.0.0.1", 0))
    if failure == "grpc extra missing":
        monkeypatch.setitem(__import__("sys").modules, "paramserver.serving.grpc", None)
    http_port = free_port()
    with pytest.raises(ConfigError, match="is in use by another process|serve extra"):
        serve(Ranker, follow=tmp_path, example_inputs=EXAMPLE, http_port=http_port,
              grpc_port=busy.getsockname()[1], poll_s=0.01)  # fmt: skip
    busy.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", http_port), timeout=5)
    assert serving_threads() == []


# ---- bfloat16 tables ----


class Bf16Ranker(nn.Module):
    """A bfloat16 table, and a bfloat16 input."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(20, 4, dtype=torch.bfloat16)
        self.out = nn.Linear(4, 1)

    def forward(self, items: Tensor, weights: Tensor) -> Tensor:
        return self.out((self.item(items) * weights[:, None]).float())


BF16_EXAMPLE = [torch.tensor([1, 2]), torch.tensor([1.0, 0.5], dtype=torch.bfloat16)]


def test_a_bfloat16_table_and_input_are_served_as_bf16() -> None:
    served = ServedModel(Bf16Ranker, 0)
    frontend = Frontend(served, example=BF16_EXAMPLE)
    frontend.ready = True
    http_serving, grpc_serving = HttpServing(frontend), GrpcServing(frontend)
    ids = np.array([3, 4, 5, 19], dtype=np.int64)
    expected = served.lookup("item.weight", torch.from_numpy(ids))[0].float().numpy()
    scores = served.predict(BF16_EXAMPLE)[0].numpy()
    try:
        for module, port in ((triton_http, http_serving.port), (triton_grpc, grpc_serving.port)):
            client = module.InferenceServerClient(f"127.0.0.1:{port}")
            metadata = client.get_model_metadata("item.weight")
            rows_type = (metadata["outputs"][0]["datatype"] if module is triton_http
                         else metadata.outputs[0].datatype)  # fmt: skip
            assert rows_type == "BF16"
            lookup = module.InferInput("ids", list(ids.shape), "INT64")
            lookup.set_data_from_numpy(ids)
            rows = client.infer("item.weight", [lookup]).as_numpy("rows")
            assert rows.dtype == ml_dtypes.bfloat16 and rows.shape == (4, 4)
            assert np.array_equal(rows.astype(np.float32), expected)
            items = module.InferInput("items", [2], "INT64")
            items.set_data_from_numpy(BF16_EXAMPLE[0].numpy())
            weights = module.InferInput("weights", [2], "BF16")
            weights.set_data_from_numpy(np.array([1.0, 0.5], dtype=ml_dtypes.bfloat16))
            assert np.array_equal(client.infer("model", [items, weights]).as_numpy("output"),
                                  scores)  # fmt: skip
        listed = triton_http.InferRequestedOutput("rows", binary_data=False)
        client = triton_http.InferenceServerClient(f"127.0.0.1:{http_serving.port}")
        lookup = triton_http.InferInput("ids", list(ids.shape), "INT64")
        lookup.set_data_from_numpy(ids)
        rows = client.infer("item.weight", [lookup], outputs=[listed]).as_numpy("rows")
        assert np.array_equal(rows.astype(np.float32), expected)  # bf16 values are exact floats
        status, answer = post(http_serving.port, {"inputs": [
            {"name": "items", "shape": [2], "datatype": "INT64", "data": [1, 2]},
            {"name": "weights", "shape": [2], "datatype": "BF16", "data": [1.0, 0.5]}]},
            path="/v2/models/model/infer")  # fmt: skip
        assert status == 200 and answer["outputs"][0]["data"] == scores.reshape(-1).tolist()
    finally:
        http_serving.close()
        grpc_serving.close()
