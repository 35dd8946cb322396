"""A resumed run: its summary covers its own work and time; a run the launcher restarted: its
summary covers every attempt; a checkpoint restored onto fewer servers than a dynamic table's
capacity allows is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import paramserver as ps
from paramserver.checkpoint import CheckpointError
from paramserver.cli import print_summary
from paramserver.launch.roles import build_server
from paramserver.store.snapshot import restore_store, snapshot_store
from tests.helpers import (
    NUM_IDS,
    TinyRecModel,
    hashed_batches,
    mse,
    threads_job,
    tiny_batches,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

STEPS = 12
SAVED_AT = 8
BATCH = 6  # tiny_batches'


def config(tmp_path: Path, **options: Any) -> ps.TrainConfig:
    return ps.TrainConfig(
        servers=2, trainers=2, mode="sync", optimizer="adam", lr=0.01, launcher="threads",
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"),
    ).replace(**options)  # fmt: skip


def crashing_once(marker: Path, root: Path) -> Any:
    """Trainer 0's data crashes at batch ``SAVED_AT + 2`` once checkpoint ``SAVED_AT`` is
    committed (see helpers.crashing_after), the first time only (``marker`` then holds the
    time of the crash)."""

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=STEPS)):
            if trainer == 0 and index == SAVED_AT + 2 and not marker.exists():
                wait_for_checkpoint(root, SAVED_AT)
                marker.write_text(str(time.time()))
                raise RuntimeError("crash")
            yield batch

    return data


def assert_covers_the_resumed_run(summary: dict[str, Any], straight: dict[str, Any]) -> None:
    """Counts, rates and per-step figures of the steps after the checkpoint, and where the
    run resumed: consistent with each other and with a run that never stopped."""
    assert summary["resumed_from"] == {
        "checkpoint_step": SAVED_AT,
        "trainer_steps": [SAVED_AT, SAVED_AT],
        "samples": 2 * SAVED_AT * BATCH,
    }
    assert summary["trainer_steps"] == [STEPS - SAVED_AT] * 2
    assert summary["steps"] == 2 * (STEPS - SAVED_AT)
    assert summary["samples"] == summary["steps"] * BATCH
    assert summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["train_seconds"])
    assert 0 < summary["train_seconds"] <= summary["wall_s"]
    traffic = summary["bytes"]["trainers"]
    assert summary["bytes_per_step"]["push"] == pytest.approx(traffic["sent"] / summary["steps"])
    assert summary["bytes_per_step"]["pull"] == pytest.approx(
        traffic["received"] / summary["steps"]
    )
    # Each step moves about what a step of the uninterrupted run moved.
    for direction in ("push", "pull"):
        ratio = summary["bytes_per_step"][direction] / straight["bytes_per_step"][direction]
        assert 0.7 < ratio < 1.4, (direction, ratio)
    assert 0.7 < summary["row_bytes_per_step"] / straight["row_bytes_per_step"] < 1.4
    assert straight["resumed_from"] is None


@pytest.mark.timeout(120)
def test_a_resumed_runs_summary_covers_the_run_since_its_checkpoint(tmp_path: Path) -> None:
    data = lambda t, n: tiny_batches(t, num_batches=STEPS)  # noqa: E731
    straight = ps.train(TinyRecModel, data, mse, config(tmp_path / "a"))
    job = config(tmp_path, checkpoint_every=SAVED_AT)
    marker = tmp_path / "crashed"
    with pytest.raises(ps.JobFailedError, match="crash"):
        ps.train(TinyRecModel, crashing_once(marker, tmp_path / "ckpt"), mse, job)
    resumed = ps.train(TinyRecModel, data, mse, job.replace(resume=True))
    assert straight is not None and resumed is not None
    assert_covers_the_resumed_run(resumed.summary, straight.summary)


@pytest.mark.timeout(240)
def test_a_restarted_runs_summary_covers_every_attempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The processes launcher restarts the job after trainer 0 crashed past checkpoint 8: the
    summary (printed and JSON) counts the run's steps over both attempts, its whole wall
    time, and says which process failed, why, where the job resumed and how long training
    paused."""
    data = lambda t, n: tiny_batches(t, num_batches=STEPS)  # noqa: E731
    job = config(
        tmp_path, launcher="processes", servers=1, checkpoint_every=SAVED_AT, max_restarts=1
    )
    marker = tmp_path / "crashed"
    started_at = time.time()
    result = ps.train(TinyRecModel, crashing_once(marker, tmp_path / "ckpt"), mse, job)
    ended_at, crashed_at = time.time(), float(marker.read_text())
    assert result is not None
    summary = result.summary
    # The run from its start: both attempts' steps that the final model holds.
    assert summary["resumed_from"] is None
    assert summary["trainer_steps"] == [STEPS, STEPS] and summary["steps"] == 2 * STEPS
    assert summary["samples"] == summary["steps"] * BATCH
    assert ended_at - crashed_at < summary["wall_s"] <= ended_at - started_at
    first, second = summary["attempts"]
    assert first["resumed_from"] is None and "RuntimeError: crash" in first["ended"]
    # As the progress lines told the launcher: the failing trainer's last one is sent as it
    # fails (it drew batch 10 ahead of step 10); the other's, at most 0.2 s old.
    assert first["trainer_steps"][0] == SAVED_AT + 1, first
    assert 1 <= first["trainer_steps"][1] <= STEPS, first
    assert second["resumed_from"] == SAVED_AT and second["ended"] == "finished"
    assert second["trainer_steps"] == [STEPS - SAVED_AT] * 2
    assert first["ended_s"] <= second["started_s"] < second["ended_s"] <= summary["wall_s"]
    train_seconds = first["train_seconds"] + second["train_seconds"]
    assert summary["train_seconds"] == pytest.approx(train_seconds)
    assert summary["samples_per_s"] == pytest.approx(summary["samples"] / train_seconds)
    [restart] = summary["restarts"]
    assert restart["process"] == "trainer0" and restart["exit"] == "exited with status 1"
    assert restart["error"] == "RuntimeError: crash" and restart["resumed_from"] == SAVED_AT
    assert restart["at_s"] == first["ended_s"]
    assert 0 < restart["paused_s"] < second["ended_s"] - restart["at_s"]
    # The finished attempt's own figures: its bytes per step as a run that never stopped.
    straight = ps.train(TinyRecModel, data, mse, config(tmp_path / "a", servers=1))
    assert straight is not None
    for direction in ("push", "pull"):
        ratio = summary["bytes_per_step"][direction] / straight.summary["bytes_per_step"][direction]
        assert 0.7 < ratio < 1.4, (direction, ratio)
    capsys.readouterr()
    print_summary(summary)  # what the command prints of it
    printed = capsys.readouterr().out
    assert f"steps          {2 * STEPS} (2 trainers, 1 servers, sync; 2 attempts)" in printed
    assert "attempt 1      " in printed and "attempt 2      " in printed
    assert f"from checkpoint {SAVED_AT}, trainer steps 4, 4: finished" in printed
    assert "restart        trainer0 exited with status 1 (RuntimeError: crash) at " in printed
    assert f"the job restarted from checkpoint {SAVED_AT}; training paused " in printed
    assert f"wall time      {summary['wall_s']:.1f} s" in printed


class CappedModel(nn.Module):
    """A dynamic table holding at most 12 rows per server, fed many more ids than that."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 1)
        self.emb = ps.DynamicEmbedding(4, mode="mean", capacity=12)

    def forward(self, bags: Any) -> Any:
        return self.out(self.emb(bags)).squeeze(1)


def test_restoring_onto_fewer_servers_than_a_capacity_allows_is_refused() -> None:
    assert NUM_IDS > 3 * 12
    job = ps.TrainConfig(servers=3, trainers=2, launcher="threads", progress=False)
    _, transport = threads_job(job, CappedModel, lambda t, n: hashed_batches(t), mse)
    saved = [snapshot_store(e.shard.store) for e in transport.endpoints]
    rows = [e.shard.store.tables["emb.weight"].ids.num_rows for e in transport.endpoints]
    assert all(10 <= r <= 12 for r in rows), rows  # each server at its capacity
    # As many servers: every server gets back its own rows, which fit. (On more servers the
    # ids re-route through hash buckets, and one server may still get more than its capacity.)
    for server in range(3):
        restore_store(build_server(server, job, CappedModel).shard.store, saved)
    fresh = build_server(0, job.replace(servers=1), CappedModel)
    with pytest.raises(CheckpointError) as refused:
        restore_store(fresh.shard.store, saved)
    message = str(refused.value)
    assert "'emb.weight'" in message and f"{sum(rows)} rows" in message
    assert "capacity of 12 rows per server" in message and "saved by 3 servers" in message
