"""Fixtures shared by the tests: test servers that are closed after the test, and threads-launcher
jobs whose transport injects faults at exact calls (tests/fakes.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from paramserver import native
from paramserver.launch import threads as threads_launcher
from paramserver.server.endpoint import ServerEndpoint
from paramserver.transport.base import Transport
from tests.fakes import FaultyTransport
from tests.helpers import FaultyJobs, MakeServer, new_server
from tests.procs import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on loopback for a module's stream tests (each test its own
    stream); stopped by its pid when the module ends, so no later test finds it among this
    process's children."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    """Builds servers as :func:`tests.helpers.new_server` does (same arguments) and stops each
    one's watchdog thread once the test ends, so that none ticks on through later tests.

    ``watchdog=False``: stopped at once, so deadlines and silences are acted on only when the
    test calls ``coordinator.check_liveness(now)`` with the time it chooses, never because the
    machine was slow between two lines of the test."""
    made: list[ServerEndpoint] = []

    def make(*args: Any, watchdog: bool = True, **kwargs: Any) -> ServerEndpoint:
        endpoint = new_server(*args, **kwargs)
        made.append(endpoint)
        if not watchdog:
            endpoint.coordinator.close()
        return endpoint

    yield make
    for endpoint in made:
        endpoint.coordinator.close()


@pytest.fixture
def faulty_jobs(monkeypatch: pytest.MonkeyPatch) -> FaultyJobs:
    """``faulty_jobs(rig)``: from then on, jobs of the threads launcher in this test run over a
    :class:`FaultyTransport` that ``rig`` sets up (its rules), one per job; returns the list
    they are appended to, for the test to inspect (``transport.inner.endpoints``: the servers)."""

    def install(rig: Callable[[FaultyTransport], object]) -> list[FaultyTransport]:
        made: list[FaultyTransport] = []
        local = threads_launcher.LocalTransport

        def faulty(endpoints: Any) -> Transport:
            transport = FaultyTransport(local(endpoints))
            rig(transport)
            made.append(transport)
            return transport

        monkeypatch.setattr(threads_launcher, "LocalTransport", faulty)
        return made

    return install


@pytest.fixture(params=["compiled", "numpy"])
def loop_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: with paramserver's compiled loops (:mod:`paramserver.native`) and
    with its numpy paths only, which must behave the same."""
    if request.param == "numpy":
        monkeypatch.setattr(native, "loops", None)
    elif native.loops is None:
        pytest.skip("the compiled loops are turned off (PARAMSERVER_NATIVE=0)")
    return str(request.param)
