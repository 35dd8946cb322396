"""The servers' operations in one table (paramserver.transport.operations): the endpoint
dispatches by it and refuses what it does not list, and the trainers' typed stub
(paramserver.transport.stub.ServerStub) calls each operation of the table by its constant,
with arguments of the types the table lists."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.futures import Future

from paramserver.checkpoint import Part
from paramserver.errors import ParamServerError
from paramserver.futures import completed
from paramserver.server.endpoint import ServerEndpoint
from paramserver.transport.base import Transport
from paramserver.transport.operations import DATA_OPERATIONS, OPERATIONS
from paramserver.transport.stub import ServerStub
from tests.helpers import MakeServer

PACKAGE = Path(__file__).resolve().parent.parent / "paramserver"
# A value of each argument type the table lists, for calling every stub method.
SAMPLE = {int: 3, float: 0.5, bool: True, dict: {}, list: [], object: object()}


class Recording(Transport):
    """Records each call as ``(server, op, args, timeout_s)`` and answers None."""

    def __init__(self, num_servers: int):
        self.num_servers = num_servers
        self.calls: list[tuple[int, str, tuple[Any, ...], float | None]] = []

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        self.calls.append((server, op, args, timeout_s))
        return completed(None)


def sample_arguments(method: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, parameter in inspect.signature(method).parameters.items():
        if name == "self":
            continue
        if name == "server":
            values[name] = 1
        elif name == "part":
            values[name] = Part("server-0", {})
        elif parameter.default is inspect.Parameter.empty:
            annotation = str(parameter.annotation)
            kind = next(t for t in (bool, int, float, dict) if annotation.startswith(t.__name__))
            values[name] = SAMPLE[kind]
    return values


def test_every_control_operation_has_a_typed_stub_method_that_calls_it_as_the_table_says() -> None:
    control = set(OPERATIONS) - {op.name for op in DATA_OPERATIONS}
    methods = {
        name for name, _ in inspect.getmembers(ServerStub, inspect.isfunction)
        if not name.startswith("_")
    }  # fmt: skip
    assert methods == control
    for name in sorted(methods):
        transport = Recording(num_servers=2)
        getattr(ServerStub(transport), name)(**sample_arguments(getattr(ServerStub, name)))
        assert transport.calls, name
        for _, op, args, _ in transport.calls:
            expected = OPERATIONS[op].args
            assert op == name and len(args) == len(expected), name
            assert all(isinstance(a, t) for a, t in zip(args, expected, strict=True)), name


def test_every_operation_has_a_handler_and_the_package_names_none_by_a_string() -> None:
    for name in OPERATIONS:
        assert callable(getattr(ServerEndpoint, f"_op_{name}", None)), name
    quoted = [f'"{name}"' for name in OPERATIONS]
    for path in PACKAGE.rglob("*.py"):
        if path.name == "operations.py":
            continue
        text = path.read_text()
        calls = [q for q in quoted if f"call({q}" in text or f"call_all({q}" in text]
        calls += [q for q in quoted if f", {q}" in text and ".call" in text]
        assert not calls, f"{path.relative_to(PACKAGE)} names {calls} by a string"


def test_the_endpoint_refuses_an_unlisted_operation_and_arguments_of_other_types(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(0, servers=1, trainers=1)
    with pytest.raises(ParamServerError, match="unknown operation 'drop_tables'"):
        endpoint.handle("drop_tables", ()).wait()
    with pytest.raises(ParamServerError, match="bad arguments to take_checkpoint"):
        endpoint.handle("take_checkpoint", ("3",)).wait()
    assert ServerStub(_Local(endpoint)).fingerprint()[0].wait() == endpoint.shard.plan.fingerprint
    exported = ServerStub(_Local(endpoint)).export_state(False)[0].wait()
    assert all(torch.is_tensor(entry["value"]) for entry in exported.values())


class _Local(Transport):
    def __init__(self, endpoint: ServerEndpoint):
        self.num_servers, self.endpoint = 1, endpoint

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        return self.endpoint.handle(op, args)
