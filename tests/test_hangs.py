"""No wait without a limit: stuck trainers, servers frozen while a checkpoint is written,
checkpoints announced at the chief's last step, lateness decided per server, and no thread of
a job left behind."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import paramserver as ps
from paramserver.checkpoint import load_latest
from tests.fakes import FaultyTransport
from tests.helpers import (
    FaultyJobs,
    MakeServer,
    TinyRecModel,
    checkpoint_steps,
    mse,
    tiny_batches,
)
from tests.procs import children_of_launcher

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

STALL_S = 3.0


def stuck_data(victim: int, at_batch: int, release: threading.Event) -> Any:
    """Trainer ``victim``'s data blocks at batch ``at_batch`` until ``release`` (a hung read)."""

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=12)):
            if trainer == victim and index == at_batch:
                release.wait(60)
            yield batch

    return data


def stall_config(**overrides: Any) -> ps.TrainConfig:
    fields: dict[str, Any] = dict(
        servers=2, trainers=2, mode="sync", optimizer="sgd", lr=0.05, progress=False,
        heartbeat_interval=0.2, trainer_timeout=1.0, stall_timeout=STALL_S, launcher="threads",
    )  # fmt: skip
    fields.update(overrides)
    return ps.TrainConfig(**fields)


@pytest.mark.timeout(60)
def test_a_trainer_stuck_in_its_data_is_departed_and_the_job_finishes_without_it() -> None:
    release = threading.Event()
    started = time.monotonic()
    try:
        result = ps.train(TinyRecModel, stuck_data(1, 2, release), mse, stall_config())
    finally:
        release.set()
    assert result is not None
    elapsed = time.monotonic() - started
    summary = result.summary
    assert summary["departed_trainers"] == [1]
    # Declared once idle past the limit, within a few heartbeats of it.
    assert STALL_S <= summary["departed_after_s"]["1"] < STALL_S + 2
    assert elapsed < STALL_S + 15, elapsed
    assert summary["trainer_steps"][0] == 12  # the other trainer trained on to its end


@pytest.mark.timeout(60)
def test_a_stuck_chief_fails_the_job_naming_it() -> None:
    release = threading.Event()
    try:
        with pytest.raises(ps.JobFailedError, match=r"trainer0.*no progress"):
            ps.train(TinyRecModel, stuck_data(0, 2, release), mse, stall_config())
    finally:
        release.set()


@pytest.mark.timeout(120)
def test_a_stuck_trainer_process_leaves_and_no_process_is_left_behind() -> None:
    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=12)):
            if trainer == 1 and index == 2:
                time.sleep(3600)  # a read that never returns
            yield batch

    started = time.monotonic()
    result = ps.train(TinyRecModel, data, mse, stall_config(launcher="processes"))
    assert result is not None
    assert result.summary["departed_trainers"] == [1]
    assert time.monotonic() - started < 60
    assert children_of_launcher(os.getpid()) == []


def test_a_heartbeat_reporting_an_idle_loop_departs_the_trainer(make_server: MakeServer) -> None:
    server = make_server(mode="sync", trainer_timeout=2.0, stall_timeout=5.0)
    assert server.coordinator.heartbeat(1, 4.9).wait() == "member"
    answer = server.coordinator.heartbeat(1, 5.5).wait()
    assert answer.startswith("departed: it made no progress for 5.5 s")
    assert server.coordinator.liveness_stats()["departed"] == [1]
    with pytest.raises(ps.ParamServerError, match="bad idle time"):
        server.coordinator.heartbeat(0, float("nan")).wait()
    with pytest.raises(ps.ConfigError, match="--stall-timeout"):
        ps.TrainConfig(trainer_timeout=10.0, stall_timeout=5.0)
    assert ps.TrainConfig(trainer_timeout=10.0).stall_limit == 60.0
    server.coordinator.close()


@pytest.mark.timeout(60)
def test_a_server_frozen_while_the_last_checkpoint_is_written_fails_the_job(
    tmp_path: Path, faulty_jobs: FaultyJobs
) -> None:
    def rig(transport: FaultyTransport) -> None:
        # Server 1's part is never reported (its write hangs), and it freezes once the
        # chief's last push is answered: the chief is left waiting for the commit.
        transport.hold(lambda server, op, args: server == 1 and op == "checkpoint_part")
        transport.freeze_after(
            1, lambda server, op, args: op == "push_pull" and args[0].final and not args[0].trainer
        )

    faulty_jobs(rig)
    config = stall_config(
        trainers=1, mode="async", checkpoint_dir=str(tmp_path), checkpoint_every=4
    )
    started = time.monotonic()
    with pytest.raises(ps.JobFailedError, match="server 1 did not answer a heartbeat"):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=10), mse, config)
    assert time.monotonic() - started < 20


@pytest.mark.timeout(60)
def test_no_checkpoint_is_announced_at_the_chiefs_last_step(
    tmp_path: Path, faulty_jobs: FaultyJobs
) -> None:
    transports = faulty_jobs(lambda transport: None)

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        # The chief's 6 steps end where a checkpoint is due (every 3); trainer 1 goes on.
        return tiny_batches(trainer, num_batches=6 if trainer == 0 else 12)

    config = stall_config(checkpoint_dir=str(tmp_path), checkpoint_every=3)
    result = ps.train(TinyRecModel, data, mse, config)
    assert result is not None
    for endpoint in transports[0].inner.endpoints:  # type: ignore[attr-defined]
        checkpoints = endpoint.coordinator.checkpoints
        assert checkpoints.planned == 3  # then the final one, once every trainer left
        assert checkpoints.taken_through == 12
    found = load_latest(tmp_path)
    assert found is not None and (found.step, found.meta["final"]) == (12, True)
    assert checkpoint_steps(tmp_path) == [3, 12]


@pytest.mark.timeout(60)
def test_sync_lateness_is_decided_by_each_server_for_its_own_parameters(
    faulty_jobs: FaultyJobs,
) -> None:
    """Documented semantics: a push late at one server (its round there closed at the
    deadline) is dropped there only; a server it reached in time applies it."""

    def rig(transport: FaultyTransport) -> None:
        # Trainer 1's last push (step 3, final) reaches server 0 after its round's deadline.
        transport.delay(
            2.5,
            lambda server, op, args: (
                server == 0 and op == "push_pull" and args[0].trainer == 1 and args[0].call == 3
            ),
        )

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        return tiny_batches(trainer, num_batches=6 if trainer == 0 else 3)

    faulty_jobs(rig)
    config = stall_config(round_deadline=1.0, stall_timeout=None, trainer_timeout=5.0)
    result = ps.train(TinyRecModel, data, mse, config)
    assert result is not None
    late = [stats["late_pushes"] for stats in result.summary["server_stats"]]
    short = [stats["short_rounds"] for stats in result.summary["server_stats"]]
    # Server 0 closed short every round that trainer 1 (a member there until its delayed
    # push arrived) missed; server 1 never waited.
    assert late == [1, 0] and short[0] >= 1 and short[1] == 0
    assert result.summary["trainer_steps"] == [6, 3]


def job_threads() -> set[str]:
    names = ("paramserver-watchdog", "-heartbeats", "commit-", "checkpoint-")
    return {
        f"{t.name}:{t.ident}"
        for t in threading.enumerate()
        if t.name.startswith("trainer") or any(n in t.name for n in names)
    }


@pytest.mark.timeout(60)
def test_the_threads_launcher_leaves_no_thread_behind(tmp_path: Path) -> None:
    before = job_threads()
    for run in range(3):
        config = stall_config(
            mode="async", checkpoint_dir=str(tmp_path / str(run)), checkpoint_every=2
        )
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=5), mse, config)
        # A thread that has done its last work may take a moment to end.
        deadline = time.monotonic() + 2
        while job_threads() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job_threads() == before, run
