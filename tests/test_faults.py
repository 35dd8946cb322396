"""Faults a job survives or reports: a killed trainer, a killed server (a process SIGKILLed, or a
server lost at an exact call of an in-process job), a frozen trainer."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import paramserver as ps
from paramserver.checkpoint import load_latest, verify
from tests.fakes import FaultyTransport
from tests.helpers import FaultyJobs, TinyRecModel, mse, tiny_batches
from tests.procs import (
    REPO,
    SMALL_JOB,
    children_of_launcher,
    descendants,
    free_port,
    process_state,
    rank_pid,
    stop,
    wait_until,
)

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier


def dying_at(step: int, victim: int = 1) -> Any:
    """Data whose trainer ``victim`` SIGKILLs its own process at ``step``."""

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=30)):
            if trainer == victim and index == step:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)
            yield batch

    return data


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_killed_trainer_is_left_out_and_the_job_finishes(mode: str) -> None:
    step = random.Random(mode).randrange(2, 20)
    config = ps.TrainConfig(
        servers=2, trainers=3, mode=mode, optimizer="sgd", lr=0.05, launcher="processes",
        progress=False, heartbeat_interval=0.2, trainer_timeout=2.0,
    )  # fmt: skip
    result = ps.train(TinyRecModel, dying_at(step), mse, config)
    summary = result.summary
    assert summary["departed_trainers"] == [1]
    assert len(summary["trainer_steps"]) == 2  # the survivors' reports
    assert summary["trainer_steps"] == [30, 30]
    assert children_of_launcher(os.getpid()) == []


def slow_data(trainer: int, num_trainers: int) -> Iterator[Any]:
    for batch in tiny_batches(trainer, num_batches=60):
        time.sleep(0.03)
        yield batch


@pytest.mark.timeout(180)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_killed_server_stops_the_job_or_it_resumes_from_the_last_checkpoint(
    tmp_path: Path, restarts: int
) -> None:
    root = tmp_path / "ckpt"
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="sync", optimizer="sgd", lr=0.05, launcher="processes",
        progress=False, checkpoint_dir=str(root), checkpoint_every=5, max_restarts=restarts,
    )  # fmt: skip
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            outcome["result"] = ps.train(TinyRecModel, slow_data, mse, config)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + 90
    while not (root / "LATEST").exists():
        assert time.monotonic() < deadline, "no checkpoint was committed"
        time.sleep(0.05)
    os.kill(rank_pid(1), signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(timeout=150)
    assert not thread.is_alive()
    if restarts == 0:
        error = outcome["error"]
        assert isinstance(error, ps.JobFailedError) and "server1" in str(error)
        assert "SIGKILL" in str(error)
        assert time.monotonic() - killed_at < 30  # seconds, not the 60 s RPC timeout
    else:
        summary = outcome["result"].summary
        [restart] = summary["restarts"]
        assert restart["process"] == "server1"  # killed, or lost by the trainer that failed
        # The summary covers the whole run: both attempts, from the start to the data's end.
        assert summary["trainer_steps"] == [60, 60] and summary["resumed_from"] is None
        assert summary["attempts"][1]["resumed_from"] == restart["resumed_from"] is not None
    assert children_of_launcher(os.getpid()) == []


@pytest.mark.timeout(60)
def test_a_server_lost_while_a_checkpoint_is_written_fails_the_job_and_keeps_the_last_one(
    tmp_path: Path, faulty_jobs: FaultyJobs, caplog: pytest.LogCaptureFixture
) -> None:
    def rig(transport: FaultyTransport) -> None:
        # Server 1 dies when asked for its part of the checkpoint after 3 (at 6, or later
        # where 3's commit was still under way at step 6): checkpoint 3 is the last whole one.
        transport.crash_at(
            1, lambda server, op, args: server == 1 and op == "checkpoint_part" and args[0] > 3
        )

    transports = faulty_jobs(rig)
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="sync", optimizer="sgd", lr=0.05, launcher="threads",
        progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=3,
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ps.JobFailedError, match="ServerLostError: server 1 was lost"):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=30), mse, config)
    assert time.monotonic() - started < 30  # failed at the next call, not after a timeout
    assert transports[0].crashed == {1}
    found = load_latest(tmp_path)
    assert found is not None and found.step == 3
    assert verify(found.directory) == []
    # The lost server is reported in one line, the job's own error, not as a traceback (by
    # the chief's commit thread, which may log after the job has failed).
    uncommitted = wait_until(
        lambda: next((r for r in caplog.records if "not committed" in r.getMessage()), None),
        timeout=10,
        what="the uncommitted checkpoint's log line",
    )
    assert "server 1 was lost" in uncommitted.getMessage() and uncommitted.exc_info is None


@pytest.mark.timeout(120)
def test_a_frozen_trainer_is_declared_departed_and_refused_when_it_wakes() -> None:
    freeze_at = 5

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(slow_data(trainer, num_trainers)):
            if trainer == 2 and index == freeze_at:
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen at a known step until woken
            yield batch

    config = ps.TrainConfig(
        servers=1, trainers=3, mode="sync", optimizer="sgd", lr=0.05, launcher="processes",
        progress=False, heartbeat_interval=0.2, trainer_timeout=1.5,
    )  # fmt: skip
    steps: dict[int, int] = {}
    outcome: dict[str, Any] = {}

    def job() -> None:
        record = lambda p: steps.update({p.trainer: p.steps})  # noqa: E731
        outcome.update(result=ps.train(TinyRecModel, data, mse, config, on_progress=record))

    thread = threading.Thread(target=job)
    thread.start()
    pid = wait_until(lambda: stopped_rank(1 + 2), 60, "trainer 2 (rank 3) to freeze")
    # Sync rounds wait for trainer 2 until the server declares it departed (silent past
    # --trainer-timeout): trainer 0 stepping well past where trainer 2 stopped proves it did.
    wait_until(lambda: steps.get(0, 0) >= freeze_at + 4, 60, "trainer 0 to go on without it")
    os.kill(pid, signal.SIGCONT)  # it wakes, its next call is refused, it leaves
    thread.join(timeout=100)
    summary = outcome["result"].summary
    assert summary["departed_trainers"] == [2]
    assert summary["trainer_steps"] == [60, 60]
    assert children_of_launcher(os.getpid()) == []


def stopped_rank(rank: int) -> int | None:
    """The pid of rank ``rank`` of this process's job once it is stopped (SIGSTOP), else None."""
    try:
        pid = rank_pid(rank)
    except AssertionError:  # not started yet
        return None
    return pid if process_state(pid) == "T" else None


@pytest.mark.timeout(240)
def test_torchrun_restarts_a_job_whose_server_died_and_it_resumes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    summary = tmp_path / "summary.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun), "--nnodes", "1", "--nproc-per-node", "3", "--max-restarts", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "--rdzv-backend", "static", "--node-rank", "0",
        "-m", "paramserver", "train", "--servers", "1", "--trainers", "2", *SMALL_JOB,
        "--train-batches", "400", "--no-progress", "--summary-json", str(summary),
        "--checkpoint-dir", str(root), "--checkpoint-every", "20", "--resume",
    ]  # fmt: skip
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the workers
        job = subprocess.Popen(
            command, cwd=REPO, text=True, start_new_session=True, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 120
        while not (root / "LATEST").exists():
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        server = next(
            pid
            for pid in descendants(job.pid)
            if b"--servers" in Path(f"/proc/{pid}/cmdline").read_bytes()
            and b"\0RANK=0\0" in Path(f"/proc/{pid}/environ").read_bytes()
        )
        os.kill(server, signal.SIGKILL)
        job.wait(timeout=180)
    finally:
        stop(job)
    output = log.read_text()
    assert job.returncode == 0, output[-3000:]
    finished = json.loads(summary.read_text())  # the restarted run's, from its checkpoint on
    resumed = finished["resumed_from"]["trainer_steps"]
    assert [a + b for a, b in zip(resumed, finished["trainer_steps"], strict=True)] == [200, 200]
    assert "resumed from" in output
