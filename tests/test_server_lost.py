"""A lost server as trainers and users see it: a typed ServerLostError naming the server, not
TensorPipe's bare RuntimeError, and one clear line where a traceback used to be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.rpc as rpc
from torch.futures import Future

import paramserver as ps
from paramserver.errors import InvalidPushError, JobFailedError, ServerLostError
from paramserver.futures import completed, failed
from paramserver.transport.rpc import RpcTransport
from tests.helpers import TinyRecModel, mse, tiny_batches
from tests.procs import REPO, SMALL_JOB, children_of_launcher, rank_pid, stop

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

EOF_ERROR = (
    "EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)"
)
TIMEOUT_ERROR = (
    "RPCErr:1:RPC ran for more than set timeout (500 ms) and will now be marked with an error"
)


def answered_with(monkeypatch: pytest.MonkeyPatch, future: Future) -> RpcTransport:
    """An RpcTransport whose every call over RPC (control calls: data calls take a socket,
    tests/test_sockets.py) gets ``future`` from the RPC layer."""
    monkeypatch.setattr(rpc, "rpc_async", lambda *args, **kwargs: future)
    return RpcTransport(num_servers=2, timeout_s=60.0)


def test_a_broken_connection_is_a_server_lost_error_naming_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transport = answered_with(monkeypatch, failed(RuntimeError(EOF_ERROR)))
    with pytest.raises(ServerLostError) as caught:
        transport.call(1, "stats").wait()
    assert caught.value.server == 1
    message = str(caught.value)
    assert message.startswith("server 1 was lost: stats failed with EOF: end of file"), message
    assert "tensorpipe" not in message


def test_a_call_past_its_timeout_is_a_server_lost_error_naming_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transport = answered_with(monkeypatch, failed(RuntimeError(TIMEOUT_ERROR)))
    with pytest.raises(ServerLostError, match=r"^server 0 did not answer stats within 0.5 s"):
        transport.call(0, "stats", timeout_s=0.5).wait()


def test_errors_from_the_server_keep_their_type(monkeypatch: pytest.MonkeyPatch) -> None:
    rejected = InvalidPushError("NaN in gradient", param="mlp.0.weight", server=1)
    transport = answered_with(monkeypatch, completed(rejected))
    with pytest.raises(InvalidPushError, match="server 1: parameter 'mlp.0.weight': NaN"):
        transport.call(1, "dense_check", {}).wait()
    # Re-raised by the RPC layer from the server's side (it could not unpickle the call, say):
    # the server is alive, so this is no ServerLostError.
    remote = RuntimeError("On WorkerInfo(id=1, name=server1):\nRuntimeError('unpickling')")
    transport = answered_with(monkeypatch, failed(remote))
    with pytest.raises(RuntimeError, match="On WorkerInfo") as caught:
        transport.call(1, "stats").wait()
    assert not isinstance(caught.value, ServerLostError)


@pytest.mark.timeout(180)
def test_a_killed_server_is_named_with_no_traceback_or_tensorpipe_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    log = tmp_path / "job.log"
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the job
        job = subprocess.Popen(
            [sys.executable, "-m", "paramserver", "train", *SMALL_JOB, "--servers", "2",
             "--trainers", "2", "--train-batches", "4000", "--no-progress",
             "--checkpoint-dir", str(root), "--checkpoint-every", "5"],
            cwd=REPO, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (root / "LATEST").exists():  # training is under way
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(rank_pid(1, launcher=job.pid), signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        stop(job)
    output = log.read_text()
    assert job.returncode == 1, output[-3000:]
    assert "paramserver: error: server1 (pid " in output and "was killed by SIGKILL" in output
    assert "Traceback" not in output, output[-3000:]
    assert "tensorpipe" not in output.lower(), output[-3000:]
    assert children_of_launcher(job.pid) == []


@pytest.mark.timeout(120)
def test_a_frozen_server_is_named_first_in_the_job_error(tmp_path: Path) -> None:
    running = tmp_path / "training"

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=400)):
            if index == 3:
                running.touch()
            time.sleep(0.02)
            yield batch

    config = ps.TrainConfig(
        servers=2, trainers=2, mode="sync", launcher="processes", progress=False,
        heartbeat_interval=0.2, trainer_timeout=2.0,
    )  # fmt: skip
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            ps.train(TinyRecModel, data, mse, config)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + 60
    while not running.exists():
        assert time.monotonic() < deadline and thread.is_alive(), "training never started"
        time.sleep(0.02)
    frozen = rank_pid(1)
    os.kill(frozen, signal.SIGSTOP)  # the launcher SIGKILLs it when it stops the job
    thread.join(timeout=60)
    assert not thread.is_alive()
    error = outcome["error"]
    assert isinstance(error, JobFailedError)
    message = str(error)
    # Its process still runs: a trainer notices, and the error leads with the server it lost.
    assert message.startswith("server1 was lost: trainer"), message
    assert "ServerLostError: server 1 did not answer" in message
    assert message.count("did not answer") == 1, message
    assert children_of_launcher(os.getpid()) == []
