"""One job per checkpoint directory: the lock, taking over a stale one, LATEST never going back."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import paramserver as ps
from paramserver.checkpoint import CheckpointError, commit, load_latest, lock_directory
from paramserver.checkpoint.lock import LOCK, read_holder
from paramserver.cli import main
from tests.helpers import (
    TinyRecModel,
    checkpoint_steps,
    commit_step,
    flip_byte,
    mse,
    tiny_batches,
    write_step,
)

REPO = Path(__file__).resolve().parents[1]
LOCK_LOGGER = "paramserver.checkpoint.lock"

# A process that takes the lock on argv[1], says so, and holds it until stdin closes or it is
# killed: another job, as far as this test process can tell.
HOLDER = """
import sys
from paramserver.checkpoint import lock_directory
lock = lock_directory(sys.argv[1])
print(lock.job_id, flush=True)
sys.stdin.read()
"""


class OtherJob:
    """A live process holding the lock on ``root``."""

    def __init__(self, root: Path):
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(root)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.job_id = self.process.stdout.readline().strip()
        assert self.job_id, "the holder process did not take the lock"

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def job_config(root: Path, **options: Any) -> ps.TrainConfig:
    return ps.TrainConfig(
        servers=2, trainers=2, mode="sync", launcher="threads", progress=False,
        checkpoint_dir=str(root), checkpoint_every=3, **options,
    )  # fmt: skip


def files_of(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def data(trainer: int, num_trainers: int) -> Iterator[Any]:
    return tiny_batches(trainer, num_batches=9)


@pytest.fixture
def other_job(tmp_path: Path) -> Iterator[OtherJob]:
    """Another job, holding ``tmp_path / "ckpt"`` after it committed step 5 there."""
    commit_step(tmp_path / "ckpt", 5)
    job = OtherJob(tmp_path / "ckpt")
    try:
        yield job
    finally:
        job.kill()


@pytest.mark.system
@pytest.mark.timeout(120)
def test_a_second_job_is_refused_naming_the_directory_and_a_dead_ones_lock_is_taken_over(
    tmp_path: Path, other_job: OtherJob, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    before = files_of(root)
    with pytest.raises(CheckpointError) as refused:
        ps.train(TinyRecModel, data, mse, job_config(root))
    message = str(refused.value)
    assert str(root) in message and "in use by job" in message
    assert other_job.job_id in message and f"pid {other_job.process.pid}" in message
    # A committer outside that job commits nothing, whatever its step.
    with pytest.raises(CheckpointError, match=other_job.job_id):
        commit(root, 9, write_step(root, 9), {})
    assert (root / "LATEST").read_text() == "ckpt-0000000005\n"
    assert not (root / "ckpt-0000000009" / "manifest.json").exists()
    assert {name: t for name, t in files_of(root).items() if name in before} == before

    other_job.kill()  # gone without releasing: its lock is stale
    with caplog.at_level(logging.WARNING, logger=LOCK_LOGGER), lock_directory(root) as lock:
        commit_step(root, 6)
    assert any("stale lock" in r.getMessage() and other_job.job_id in r.getMessage()
               for r in caplog.records)  # fmt: skip
    found = load_latest(root)
    assert found is not None and found.step == 6 and found.job_id == lock.job_id
    assert not (root / LOCK).exists()  # released when the lock's holder ended


@pytest.mark.timeout(120)
def test_jobs_of_one_process_take_turns_and_a_failed_one_releases_the_directory(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    go = threading.Event()
    outcome: dict[str, Any] = {}

    def waiting(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=9)):
            if index == 4:
                assert go.wait(60)
            yield batch

    def first_job() -> None:
        try:
            outcome["result"] = ps.train(TinyRecModel, waiting, mse, job_config(root))
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=first_job)
    thread.start()
    try:
        while read_holder(root) is None:
            assert thread.is_alive(), outcome
            threading.Event().wait(0.01)
        with pytest.raises(CheckpointError, match=f"{root}.*another job of this same process"):
            ps.train(TinyRecModel, data, mse, job_config(root))
    finally:
        go.set()
        thread.join(60)
    assert "result" in outcome, outcome
    found = load_latest(root)
    assert found is not None and found.job_id is not None

    def crashing(trainer: int, num_trainers: int) -> Iterator[Any]:
        yield from tiny_batches(trainer, num_batches=2)
        raise RuntimeError("crash")

    # The job ended with its final checkpoint, from which a resume trains no more: a job that
    # fails starts afresh elsewhere.
    other = tmp_path / "other"
    with pytest.raises(ps.JobFailedError, match="crash"):
        ps.train(TinyRecModel, crashing, mse, job_config(other))
    assert not (other / LOCK).exists()
    assert ps.train(TinyRecModel, data, mse, job_config(other)) is not None


def test_a_fresh_job_is_refused_where_checkpoints_were_committed(tmp_path: Path) -> None:
    """Its commits could never become the newest (LATEST never goes back): refused at start,
    before anything runs; with --resume it continues the saved job."""
    with lock_directory(tmp_path):
        commit_step(tmp_path, 3)
    with pytest.raises(ps.ConfigError, match=f"{tmp_path} already holds .* step 3.*--resume"):
        ps.train(TinyRecModel, data, mse, job_config(tmp_path))
    assert load_latest(tmp_path).step == 3  # type: ignore[union-attr]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ps.train(TinyRecModel, data, mse, job_config(empty)) is not None


def test_a_sync_resume_of_another_job_shape_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked from the manifest by the launcher: one message, exit status 2, no process."""
    commit(tmp_path, 6, write_step(tmp_path, 6), {"trainers": 2, "mode": "sync"})
    with pytest.raises(ps.ConfigError, match=r"saved by a job with 2 trainers in sync mode; "
                       r"this job has 3 in sync mode: a sync job continues bitwise"):  # fmt: skip
        ps.train(TinyRecModel, data, mse, job_config(tmp_path, resume=True).replace(trainers=3))
    commit(tmp_path, 7, write_step(tmp_path, 7), {"trainers": 2, "mode": "async"})
    argv = ["train", "--checkpoint-dir", str(tmp_path), "--resume", "--mode", "sync",
            "--trainers", "2", "--launcher", "threads", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("ckpt-0000000007: saved by a job with 2 trainers in async mode") == 1, err
    assert "resume it in async or ssp mode to change either" in err


def test_commits_record_the_job_holding_the_lock(tmp_path: Path) -> None:
    with lock_directory(tmp_path) as lock:
        assert read_holder(tmp_path) == lock.holder
        commit_step(tmp_path, 1)
        manifest = json.loads((tmp_path / "ckpt-0000000001" / "manifest.json").read_text())
        assert manifest["job_id"] == lock.job_id
        found = load_latest(tmp_path)
        assert found is not None and found.job_id == lock.job_id
    assert not (tmp_path / LOCK).exists()
    commit_step(tmp_path, 2)  # the store on its own, no job holding the directory
    found = load_latest(tmp_path)
    assert found is not None and (found.step, found.job_id) == (2, None)


def test_latest_never_goes_back(tmp_path: Path) -> None:
    commit_step(tmp_path, 10)
    write_step(tmp_path, 7)  # another writer, behind
    with pytest.raises(CheckpointError, match=r"not committing step 7: LATEST names ckpt-0+10"):
        commit(tmp_path, 7, write_step(tmp_path, 7), {})
    assert (tmp_path / "LATEST").read_text() == "ckpt-0000000010\n"
    assert checkpoint_steps(tmp_path) == [7, 10]
    assert not (tmp_path / "ckpt-0000000007" / "manifest.json").exists()
    found = load_latest(tmp_path)
    assert found is not None and found.step == 10
    # A later checkpoint that no longer verifies does not hold back a job resumed from an
    # earlier one: LATEST then names what a reader would load anyway.
    flip_byte(tmp_path / "ckpt-0000000010" / "server-0.pt")
    commit_step(tmp_path, 7)
    assert (tmp_path / "LATEST").read_text() == "ckpt-0000000007\n"
    found = load_latest(tmp_path)
    assert found is not None and found.step == 7


def test_a_lock_from_another_host_is_refused_naming_the_host(tmp_path: Path) -> None:
    holder = {
        "job_id": "0123456789abcdef", "host": "trainer-host-b.example", "pid": 4242,
        "pid_started": 99, "since": "2026-01-01T00:00:00+00:00",
    }  # fmt: skip
    (tmp_path / LOCK).write_text(json.dumps(holder))
    with pytest.raises(CheckpointError) as refused:
        lock_directory(tmp_path)
    message = str(refused.value)
    assert str(tmp_path) in message and "trainer-host-b.example" in message
    assert "pid 4242" in message and f"delete its lock file {LOCK}" in message
    with pytest.raises(CheckpointError, match="trainer-host-b.example"):
        commit_step(tmp_path, 1)
    assert json.loads((tmp_path / LOCK).read_text()) == holder  # untouched


@pytest.mark.parametrize(
    "lock_file",
    [
        "a reused pid",  # a live process, but not the one that took the lock
        "garbage",
    ],
)
def test_a_lock_no_live_process_matches_is_taken_over(tmp_path: Path, lock_file: str) -> None:
    if lock_file == "garbage":
        (tmp_path / LOCK).write_bytes(b"\x00{not json")
    else:
        holder = {
            "job_id": "feedfacefeedface", "host": socket.gethostname(), "pid": os.getppid(),
            "pid_started": 1, "since": "2026-01-01T00:00:00+00:00",
        }  # fmt: skip
        (tmp_path / LOCK).write_text(json.dumps(holder))
    with lock_directory(tmp_path) as lock:
        assert read_holder(tmp_path) == lock.holder
        assert lock.holder.pid == os.getpid()
