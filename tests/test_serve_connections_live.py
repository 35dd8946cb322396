"""`paramserver serve` as a process, as its clients and its user meet it: it keeps answering a
normal client, correctly and never 503, while 1,000 idle and 100 trickling connections are
held open (issue 46; the latency it keeps is ``benchmarks/bench_serve_load.py``'s to measure),
and a port already taken is one line naming the port and the flag, exit status 2.

The serving process serves a recorded job's initial model (no change log: its answers never
change), so every answer is checked against that model's rows computed here.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from paramserver.cli import recorded_job
from paramserver.serving.model import ServedModel
from tests.procs import REPO, SMALL_JOB, free_port, stop, wait_until

pytestmark = pytest.mark.system

TABLE = "embeddings.3.weight"
IDS = [1, 5, 9, 1999, 0]
IDLE, SLOW = 1000, 100
SLOW_HEAD = f"POST /v2/models/{TABLE}/infer HTTP/1.1\r\nContent-Length: 100\r\n".encode()


@pytest.fixture
def job_record(tmp_path: Path) -> Path:
    """A small job's record, as `paramserver train --publish-dir` writes it."""
    record = tmp_path / "job.json"
    record.write_text(json.dumps({"train_argv": list(SMALL_JOB), "cwd": str(REPO)}))
    return record


def start_serve(record: Path, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "paramserver", "serve", "--job", str(record), *flags],
            cwd=REPO, stdout=out, stderr=out,
        )  # fmt: skip


def answer(connection: http.client.HTTPConnection, method: str, path: str, body: bytes = b""):
    connection.request(method, path, body or None)
    response = connection.getresponse()
    return response.status, response.read()


def connections_that_fit() -> tuple[int, int]:
    """Idle and slow connections this process can hold (a low hard limit of open files takes
    fewer, in the same proportion), the soft limit raised to fit them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = IDLE + SLOW + 200
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fit = min(1.0, (soft - 200) / (IDLE + SLOW))
    return int(IDLE * fit), int(SLOW * fit)


@contextlib.contextmanager
def held_open(port: int, idle: int, slow: int) -> Iterator[list[socket.socket]]:
    """``idle`` connections that send nothing and ``slow`` ones trickling a request's head a
    byte every 0.2 s (never whole), until the block ends; yields them all."""
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(idle + slow)]
    stop_trickling = threading.Event()

    def trickle() -> None:
        sent = 0
        while not stop_trickling.wait(0.2):
            for connection in held[idle:]:
                connection.send(SLOW_HEAD[sent : sent + 1])
            sent = (sent + 1) % len(SLOW_HEAD)

    trickling = threading.Thread(target=trickle, daemon=True)
    trickling.start()
    try:
        yield held
    finally:
        stop_trickling.set()
        trickling.join(10)
        for connection in held:
            connection.close()


def still_open(connection: socket.socket) -> bool:
    connection.setblocking(False)
    try:
        return connection.recv(1) != b""  # a byte from the server: not an idle client's
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        connection.setblocking(True)


def test_a_normal_client_is_answered_while_1000_idle_and_100_slow_connections_are_open(
    job_record: Path, tmp_path: Path
) -> None:
    job = recorded_job(job_record)
    served = ServedModel(job.model_fn, job.config.seed)
    expected = served.lookup(TABLE, torch.tensor(IDS))[0].reshape(-1).tolist()
    body = json.dumps({"inputs": [{"name": "ids", "shape": [len(IDS)], "datatype": "INT64",
                                   "data": IDS}]}).encode()  # fmt: skip
    port = free_port()
    serve = start_serve(job_record, tmp_path / "serve.log", "--http-port", str(port),
                        "--grpc-port", "0")  # fmt: skip
    try:
        wait_until(lambda: serve.poll() is not None or _ready(port), 60, "serve to answer ready")
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()
        idle, slow = connections_that_fit()
        with held_open(port, idle, slow) as held:
            time.sleep(1.0)  # every slow connection has trickled some of its head
            statuses: list[int] = []
            for new_connection_each in (False, True):
                client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                for i in range(150):
                    if new_connection_each:
                        client.close()
                        client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                    status, rows = answer(client, "POST", f"/v2/models/{TABLE}/infer", body)
                    statuses.append(status)
                    assert status == 200, rows
                    assert json.loads(rows)["outputs"][0]["data"] == expected
                    if i % 10 == 0:
                        statuses.append(answer(client, "GET", "/v2/health/ready")[0])
                client.close()
            assert set(statuses) == {200} and len(statuses) == 330
            closed = sum(not still_open(connection) for connection in held)
            assert closed == 0, f"serve dropped {closed} of the held connections"
        assert serve.poll() is None
    finally:
        stop(serve)


def _ready(port: int) -> bool:
    try:
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        return answer(client, "GET", "/v2/health/ready")[0] == 200
    except OSError:
        return False


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_taken_port_is_one_line_naming_it_and_its_flag_and_exit_2(
    job_record: Path, flag: str
) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "paramserver", "serve", "--job", str(job_record), flag,
             str(port), other, "0"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        taken.close()
    assert done.returncode == 2, done.stderr
    transport = "HTTP" if flag == "--http-port" else "gRPC"
    assert done.stderr.splitlines() == [
        f"paramserver: error: {transport} port {port} on 127.0.0.1 is in use by another "
        f"process: stop it, or give serve another {flag} (0: a free one)"
    ]
